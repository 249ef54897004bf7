"""Real data movement between the HBM tier (device tensors) and the DDR tier (host memory).

- `HostPool`: the DDR tier of one layer, preallocated: one host tensor of `capacity` slots, each slot one KV
  block (K and V side by side, `[2, n_kv_heads, block_size, head_dim]`, so a block is contiguous), pinned when
  the compute device is CUDA. Slots come from a free stack of slot ids kept in a tensor (no Python loop over
  blocks, no allocation per step); the pool doubles when full (rare, amortised).
- `StagingCopier`: moves many blocks as ONE copy each way. Recall gathers the blocks' slots into a contiguous
  pinned staging buffer (`index_select(out=...)`), copies it to a device staging buffer with `non_blocking=True`
  on a dedicated H2D stream and makes the compute stream wait on that copy's event; offload gathers device
  blocks into a device staging buffer, copies it D2H on a dedicated stream and scatters into the pool later
  (`drain`), so attention never waits for an offload.

Ordering rules (why it is correct): every copy first waits for the compute stream's work issued so far, so it
never overwrites a staging buffer that a kernel still reads, nor reads blocks not yet written; a host staging
buffer is reused only after its previous copy's event completed. The recall thus behaves as "recall, then
compute" (the simulator's `overlap=none`); offloads overlap with later compute (`async_offload`).

`PinnedBlockStore` is the DDR-tier interface the cache calls (reserve / put / get / key_min / key_max / block_bytes /
keys / values). It addresses its pool through `mapped_view` by block ids that stay on the device, so no step
waits for the host; the staged copies above are its fallback where CUDA refuses the mapping, and the
calibration's copy benchmarks.

The CPU path runs the same code with plain host tensors and no streams: copies are synchronous, and each
direction is one copy (the gather into staging is the recall; the offload writes straight into its slots).
Bytes are counted from the tensors actually copied (`numel * element_size`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


class HostPool:
    """Preallocated DDR-tier storage for one layer: `capacity` block slots of `block_shape`."""

    def __init__(self, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        """`capacity` slots of `block_shape`; use slot = block id (`ensure_capacity`) or the free stack
        (`allocate` / `release`), not both."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1 block")
        self.block_shape, self.dtype, self.pin = tuple(block_shape), dtype, pin
        self.storage = torch.empty((capacity, *self.block_shape), dtype=dtype, pin_memory=pin)
        self._free = torch.arange(capacity - 1, -1, -1, dtype=torch.long)  # a stack: top = _free[_n_free - 1]
        self._n_free = capacity

    @property
    def capacity(self) -> int:
        return self.storage.shape[0]

    @property
    def used(self) -> int:
        return self.capacity - self._n_free

    @property
    def block_bytes(self) -> int:
        return self.storage[0].numel() * self.storage.element_size()

    def ensure_capacity(self, n_slots: int) -> None:
        while n_slots > self.capacity:
            self._grow()

    def allocate(self, n: int) -> torch.Tensor:
        """Slot ids for `n` blocks (int64 tensor); grows the pool (x2) when it is full."""
        while n > self._n_free:
            self._grow()
        slots = self._free[self._n_free - n : self._n_free].clone()
        self._n_free -= n
        return slots

    def release(self, slots: torch.Tensor) -> None:
        """Returns slots to the free stack (blocks recalled for good, or evicted from DDR)."""
        n = slots.numel()
        if n > self.used:
            raise ValueError(f"releasing {n} slots but only {self.used} are in use")
        self._free[self._n_free : self._n_free + n] = slots
        self._n_free += n

    def _grow(self) -> None:
        old = self.capacity
        storage = torch.empty((2 * old, *self.block_shape), dtype=self.dtype, pin_memory=self.pin)
        storage[:old].copy_(self.storage)
        free = torch.empty(2 * old, dtype=torch.long)
        free[: self._n_free] = self._free[: self._n_free]
        new_slots = torch.arange(2 * old - 1, old - 1, -1, dtype=torch.long)
        free[self._n_free : self._n_free + old] = new_slots
        self.storage, self._free, self._n_free = storage, free, self._n_free + old


@dataclass
class _PendingOffload:
    pool: HostPool
    slots: torch.Tensor
    n: int
    done: torch.cuda.Event | None


class StagingCopier:
    """One H2D and one D2H staging buffer pair per compute device, shared by all layers (they run in turn)."""

    def __init__(self, device: torch.device, block_shape: tuple[int, ...], dtype: torch.dtype, max_blocks: int):
        self.device = torch.device(device)
        self.cuda = _is_cuda(self.device)
        self.block_shape, self.dtype = tuple(block_shape), dtype
        self._max_blocks = 0
        self._h2d_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._d2h_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._h2d_done: torch.cuda.Event | None = None  # last recall's copy: host staging is busy until then
        self._pending: _PendingOffload | None = None
        self._ensure_capacity(max_blocks)

    def new_pool(self, capacity: int) -> HostPool:
        return HostPool(capacity, self.block_shape, self.dtype, pin=self.cuda)

    def _ensure_capacity(self, n: int) -> None:
        if n <= self._max_blocks:
            return
        self.drain()
        if self._h2d_done is not None:
            self._h2d_done.synchronize()
        size = max(n, 2 * self._max_blocks)
        shape = (size, *self.block_shape)
        self._host_in = torch.empty(shape, dtype=self.dtype, pin_memory=self.cuda)
        self._host_out = torch.empty(shape, dtype=self.dtype, pin_memory=self.cuda)
        if self.cuda:  # the CPU path needs no device-side staging
            self._dev_in = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._dev_out = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._max_blocks = size

    def recall(self, pool: HostPool, slots: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Blocks `slots` of `pool` -> (device tensor `[n, *block_shape]`, bytes copied H2D).

        The returned tensor is a view of a staging buffer, valid until the next `recall`; the compute stream
        already waits for it, so kernels may use it at once (concatenate it into attention's K/V).
        """
        n = slots.numel()
        if n == 0:
            return (self._dev_in if self.cuda else self._host_in)[:0], 0
        self._ensure_capacity(n)
        self.drain()  # a block offloaded earlier must be in the pool before it is gathered
        if self._h2d_done is not None:
            self._h2d_done.synchronize()  # the previous recall's copy has left the host staging buffer
        host = self._host_in[:n]
        torch.index_select(pool.storage, 0, slots, out=host)
        if not self.cuda:
            return host, host.numel() * host.element_size()  # on the CPU the gather is the one copy
        dev = self._dev_in[:n]
        compute = torch.cuda.current_stream(self.device)
        self._h2d_stream.wait_stream(compute)  # kernels still reading the device staging buffer finish first
        with torch.cuda.stream(self._h2d_stream):
            dev.copy_(host, non_blocking=True)
            self._h2d_done = torch.cuda.Event()
            self._h2d_done.record(self._h2d_stream)
        compute.wait_event(self._h2d_done)
        return dev, host.numel() * host.element_size()

    def offload(self, pool: HostPool, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Device blocks (K and V, each `[n, *block_shape[1:]]`) -> pool slots `slots` (host int64); returns the
        bytes copied D2H. Asynchronous on CUDA: the copy runs on the D2H stream and lands in the pool at the
        next `drain` (every later call drains first)."""
        n = keys.shape[0]
        if n == 0:
            return 0
        self._ensure_capacity(n)
        self.drain()  # the staging buffers of the previous offload are free again
        host = self._host_out[:n]
        if not self.cuda:  # on the CPU the blocks go straight into their slots: one copy
            pool.storage[slots, 0], pool.storage[slots, 1] = keys, values
            return host.numel() * host.element_size()
        dev = self._dev_out[:n]
        dev[:, 0], dev[:, 1] = keys, values  # on the compute stream: K/V are complete; the caller may free them
        self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h_stream):
            host.copy_(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._d2h_stream)
        self._pending = _PendingOffload(pool, slots, n, done)
        return host.numel() * host.element_size()

    def drain(self) -> None:
        """Finishes the last offload: waits for its copy, scatters the blocks into their pool slots."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.done is not None:
            pending.done.synchronize()
        pending.pool.storage.index_copy_(0, pending.slots, self._host_out[: pending.n])


def kv_to_blocks(keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Blocks `block_ids` of a layer's K/V (`[1, n_kv_heads, T, head_dim]`, T a multiple of block_size)
    -> `[n, 2, n_kv_heads, block_size, head_dim]` (one gather per tensor)."""
    _, heads, length, dim = keys.shape
    n_blocks = length // block_size

    def gather(x: torch.Tensor) -> torch.Tensor:
        by_block = x[0, :, : n_blocks * block_size].reshape(heads, n_blocks, block_size, dim).transpose(0, 1)
        return by_block.index_select(0, block_ids.to(x.device))

    return torch.stack([gather(keys), gather(values)], dim=1)


def blocks_to_kv(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[n, 2, n_kv_heads, block_size, head_dim]` -> K, V as `[1, n_kv_heads, n * block_size, head_dim]`."""
    n, _, heads, block_size, dim = blocks.shape
    kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, heads, n * block_size, dim)
    return kv[0:1], kv[1:2]


_COPIERS: dict[tuple, StagingCopier] = {}


def shared_copier(device: torch.device, block_shape: tuple[int, ...], dtype: torch.dtype) -> StagingCopier:
    """One copier (staging buffers + streams) per device and block layout, shared by all layers: they run one
    after another, and the copier's ordering rules make reusing its buffers safe."""
    key = (str(torch.device(device)), tuple(block_shape), dtype)
    if key not in _COPIERS:
        _COPIERS[key] = StagingCopier(device, block_shape, dtype, max_blocks=16)
    return _COPIERS[key]


def mapped_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """`host` as a tensor the compute device's kernels index directly: the tensor itself on a CPU; on CUDA a
    view of its pinned pages in the device's address space (unified virtual addressing: a page-locked
    allocation is mapped, and its host pointer is valid on the device), so a gather or scatter by block ids that
    live on the device reads or writes host memory over the link without the host ever seeing the ids: no
    synchronisation (the way vLLM's `get_cuda_view_from_cpu_tensor` addresses its CPU KV pool). None when the
    memory is not pinned or the mapping is refused (the caller then reads the ids back).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return host
    if not host.is_pinned():
        return None

    class _Mapped:  # the CUDA array interface over the pinned bytes (bf16 has no typestr, so as bytes)
        __cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                    "data": (host.data_ptr(), False), "version": 3, "strides": None}

    try:
        view = torch.as_tensor(_Mapped(), device=device).view(host.dtype).view(host.shape)
        if not torch.equal(view.reshape(-1)[:1].cpu(), host.reshape(-1)[:1]):  # once, at allocation
            return None
    except (RuntimeError, TypeError, ValueError):
        return None
    view._thoughtkv_host = host  # the view does not own the pages: keep them alive with it
    return view


class PinnedBlockStore:
    """The DDR tier of one layer, for every row (sequence) of a batch, with real data movement.

    Blocks live in one preallocated host tensor `[rows, blocks, 2, n_kv_heads, block_size, head_dim]` (pinned
    on CUDA): slot = (row, logical block id), K and V side by side, so a block is contiguous. Rows and block ids
    stay on the compute device: `put` scatters the blocks into their slots and `get` gathers them through
    `mapped_view` (on a CPU the host tensor itself; on CUDA the mapped pinned pages, a kernel that reads or
    writes host memory over the link), so neither reads an id back and a decode step never waits for the host;
    one call moves every row's blocks of the layer. Where CUDA refuses the mapping, both read the ids back and
    copy through the host (one synchronisation per call). Per-block key bounds (elementwise min/max over the
    block's tokens, Quest-style) stay on the compute device, as the cache expects.
    """

    def __init__(self, n_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.shape = (n_kv_heads, block_size, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.pin = self.device.type == "cuda"
        self.storage = torch.empty((0, 0, 2, *self.shape), dtype=dtype)
        self.view: torch.Tensor | None = self.storage
        self.key_min = self.key_max = torch.empty((0, 0, n_kv_heads, head_dim), dtype=dtype, device=self.device)
        self.reserve(1, 64)

    asynchronous_offload = False  # scatters run in order on the compute stream

    def _settle(self) -> None:
        """Wait for every write into the pool: before the host reads or copies it (growth, `keys`)."""
        if self.pin:  # scatters through the view are kernels on the compute stream
            torch.cuda.current_stream(self.device).synchronize()

    def reserve(self, n_rows: int, n_blocks: int) -> None:
        """Room for rows below `n_rows` and block ids below `n_blocks` (bounds the cache knows on the host, so
        no id is read back). Growing (the block capacity doubles: rare) copies the pool on the host."""
        rows, blocks = self.storage.shape[:2]
        if n_rows <= rows and n_blocks <= blocks:
            return
        self._settle()
        rows = max(n_rows, 2 * rows) if n_rows > rows else rows  # doubling: rows and blocks come one by one
        blocks = max(n_blocks, 2 * blocks) if n_blocks > blocks else blocks
        storage = torch.empty((rows, blocks, 2, *self.shape), dtype=self.dtype, pin_memory=self.pin)
        old_rows, old_blocks = self.storage.shape[:2]
        storage[:old_rows, :old_blocks].copy_(self.storage)
        self.storage, self.view = storage, mapped_view(storage, self.device)
        for name in ("key_min", "key_max"):
            old = getattr(self, name)
            grown = torch.empty((rows, blocks, *old.shape[2:]), dtype=self.dtype, device=self.device)
            grown[:old_rows, :old_blocks] = old
            setattr(self, name, grown)

    def put(self, rows: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Store blocks [n, H, block, d] (on the compute device) at (`rows`, `block_ids`) (device tensors of n,
        below the `reserve`d bounds); returns bytes copied D2H."""
        self.key_min[rows, block_ids] = keys.amin(dim=2)
        self.key_max[rows, block_ids] = keys.amax(dim=2)
        blocks = torch.stack([keys, values], dim=1)
        if self.view is not None:
            self.view[rows, block_ids] = blocks
        else:  # no mapping: the ids and blocks come to the host (one synchronisation)
            self.storage[rows.cpu(), block_ids.cpu()] = blocks.cpu()
        return blocks.numel() * blocks.element_size()

    def get(self, rows: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Copy blocks (`rows`, `block_ids`) to the compute device: ([n, H, block, d] keys, values, bytes H2D)."""
        if self.view is not None:
            blocks = self.view[rows, block_ids]
        else:
            blocks = self.storage[rows.cpu(), block_ids.cpu()].to(self.device, non_blocking=self.pin)
        return blocks[:, 0], blocks[:, 1], blocks.numel() * blocks.element_size()

    @property
    def keys(self) -> torch.Tensor:
        """Host keys [rows, blocks, H, block, d] (after every pending write)."""
        self._settle()
        return self.storage[:, :, 0]

    @property
    def values(self) -> torch.Tensor:
        self._settle()
        return self.storage[:, :, 1]

    def block_bytes(self) -> int:
        return self.storage[0, 0].numel() * self.storage.element_size()
