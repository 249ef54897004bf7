"""The DDR tier of one layer: whole KV blocks kept on the host, indexed by logical block id.

Host tensors are pinned when the compute device is CUDA (so copies can be asynchronous); on CPU the same code
path runs with plain tensors. Every copy returns the bytes of the tensors actually moved
(`numel() * element_size()`), which the recorder writes as bytes_h2d / bytes_d2h. Per-block key bounds
(elementwise min and max over the block's tokens, Quest-style) stay on the compute device: they are small and
the recall rule reads them every step.
"""

from __future__ import annotations

import torch


class HostBlockStore:
    def __init__(self, n_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.shape = (n_kv_heads, block_size, head_dim)
        self.dtype, self.device = dtype, device
        self.pin = device.type == "cuda"
        self.capacity_blocks = 0
        self.keys = self.values = torch.empty(0)
        self.key_min = self.key_max = torch.empty(0)
        self._grow(64)

    def _host_empty(self, n_blocks: int) -> torch.Tensor:
        return torch.empty((n_blocks, *self.shape), dtype=self.dtype, pin_memory=self.pin)

    def _grow(self, n_blocks: int) -> None:
        capacity = max(n_blocks, 2 * self.capacity_blocks)
        old = self.capacity_blocks
        keys, values = self._host_empty(capacity), self._host_empty(capacity)
        bounds_shape = (capacity, self.shape[0], self.shape[2])
        key_min = torch.empty(bounds_shape, dtype=self.dtype, device=self.device)
        key_max = torch.empty(bounds_shape, dtype=self.dtype, device=self.device)
        if old:
            keys[:old], values[:old] = self.keys, self.values
            key_min[:old], key_max[:old] = self.key_min, self.key_max
        self.keys, self.values, self.key_min, self.key_max = keys, values, key_min, key_max
        self.capacity_blocks = capacity

    def put(self, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            host_ids: torch.Tensor | None = None) -> int:
        """Store blocks [n, H, block, d] (on the compute device) under `block_ids`; returns bytes copied D2H.
        (`host_ids` is accepted for the stores' common interface; this reference store reads the ids itself.)"""
        needed = int(block_ids.max()) + 1
        if needed > self.capacity_blocks:
            self._grow(needed)
        self.key_min[block_ids.to(self.device)] = keys.amin(dim=2)
        self.key_max[block_ids.to(self.device)] = keys.amax(dim=2)
        host_keys = keys.to("cpu", non_blocking=self.pin)
        host_values = values.to("cpu", non_blocking=self.pin)
        host_ids = block_ids.cpu()
        self.keys[host_ids], self.values[host_ids] = host_keys, host_values
        return host_keys.numel() * host_keys.element_size() + host_values.numel() * host_values.element_size()

    def get(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Copy blocks to the compute device: ([n, H, block, d] keys, values, bytes copied H2D)."""
        host_ids = block_ids.cpu()
        keys = self.keys[host_ids].to(self.device, non_blocking=self.pin)
        values = self.values[host_ids].to(self.device, non_blocking=self.pin)
        return keys, values, keys.numel() * keys.element_size() + values.numel() * values.element_size()

    def block_bytes(self) -> int:
        """Bytes of one stored block, K and V."""
        n_heads, block_size, head_dim = self.shape
        return 2 * n_heads * block_size * head_dim * torch.empty(0, dtype=self.dtype).element_size()
