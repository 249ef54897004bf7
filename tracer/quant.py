"""The quantized DDR tier (`--ddr-dtype int8|int4`): offloaded blocks are stored as integer codes.

Scheme (asymmetric min/max, one grid per block and KV head, separately for K and V; KIVI-style group
quantization with the group = one head's `block_size x head_dim` tile):

    zero  = min(x)                          float32, per (block, head)
    scale = (max(x) - min(x)) / (2**bits - 1)   float32, per (block, head); 1 where the tile is constant
    code  = round((x - zero) / scale)       in [0, 2**bits - 1]
    x_hat = code * scale + zero             (dequantized on the compute device at recall)

so |x - x_hat| <= scale / 2 <= max|x| / (2**bits - 1) per element: at most 1/255 (int8) or 1/15 (int4) of the
tile's largest magnitude, plus float rounding. int4 packs two codes per byte (element 2i in the low nibble,
2i+1 in the high nibble), so the stored codes are exactly a quarter of bf16's bytes; the float32 scale and zero
are stored and moved too, and counted. Quantization runs on the compute device before the D2H copy, so the
PCIe traffic and the DDR footprint shrink by the same factor (bytes = `numel * element_size` of every stored
tensor). The Quest key bounds kept on the device are taken from the *dequantized* keys, so they bound exactly
the keys that recall will bring back. A recalled block that is promoted stays in HBM dequantized (its error
persists); offloading it again re-quantizes it on a grid recomputed from the dequantized tile.

`QuantizedBlockStore` has the interface of `tracer.transfer.PinnedBlockStore` (reserve/put/get/block_bytes/
key_min/key_max, by (row, block id)) plus the relative error (relative to the block's max |x|, over K and V)
of the blocks stored since the last call, for the trace's `quant_max_rel_err` / `quant_rms_rel_err`: per block
(`pop_block_errors`, what the cache records without reading it) or as max and RMS (`pop_quant_error`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thoughtkv_base import UserError
from tracer.transfer import KeyBounds, mapped_view
from traces.policy import DDR_DTYPES

BITS = {"int8": 8, "int4": 4}


class BadDdrDtype(UserError):
    pass


def check_ddr_dtype(name: str) -> str:
    if name not in DDR_DTYPES:
        raise BadDdrDtype(f"unknown --ddr-dtype {name!r}; use one of {', '.join(DDR_DTYPES)}")
    return name


@dataclass
class QuantizedTiles:
    """Blocks [n, H, block, d] as codes (uint8; int4: [n, H, block, d/2], two codes per byte) + per-tile grid."""

    codes: torch.Tensor
    scale: torch.Tensor  # [n, H, 1, 1] float32
    zero: torch.Tensor  # [n, H, 1, 1] float32

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.codes, self.scale, self.zero

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def quantize(x: torch.Tensor, bits: int) -> QuantizedTiles:
    """Quantize [n, H, block, d] per (block, head) tile onto a `bits`-bit asymmetric grid (see module doc)."""
    levels = 2**bits - 1
    x32 = x.float()
    zero = x32.amin(dim=(2, 3), keepdim=True)
    spread = x32.amax(dim=(2, 3), keepdim=True) - zero
    scale = torch.where(spread > 0, spread / levels, torch.ones_like(spread))
    codes = ((x32 - zero) / scale).round_().clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        if codes.shape[-1] % 2:
            raise BadDdrDtype(f"int4 packs two values per byte and needs an even head_dim (got {codes.shape[-1]})")
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedTiles(codes, scale, zero)


def dequantize(tiles: QuantizedTiles, bits: int, dtype: torch.dtype) -> torch.Tensor:
    codes = tiles.codes
    if bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2)
    return (codes.float() * tiles.scale + tiles.zero).to(dtype)


def relative_errors(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """(x - x_hat) / max|x| of each block [n, H, block, d] (over heads and elements), float32."""
    x32 = x.float()
    block_max = x32.abs().amax(dim=(1, 2, 3), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (x32 - x_hat.float()) / block_max


class QuantizedBlockStore:
    """DDR tier of one layer for every row of a batch, storing whole blocks quantized to int8 or int4 codes
    (host, pinned on CUDA), addressed like `tracer.transfer.PinnedBlockStore` by (row, block id) on the device."""

    def __init__(
        self, n_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        ddr_dtype: str = "int8",
    ):
        self.bits = BITS[check_ddr_dtype(ddr_dtype)] if ddr_dtype != "same" else None
        if self.bits is None:
            raise BadDdrDtype("QuantizedBlockStore needs --ddr-dtype int8 or int4; `same` uses PinnedBlockStore")
        if self.bits == 4 and head_dim % 2:
            raise BadDdrDtype(f"--ddr-dtype int4 packs two values per byte and needs an even head_dim (got {head_dim})")
        self.shape = (n_kv_heads, block_size, head_dim)
        self.code_dim = head_dim if self.bits == 8 else head_dim // 2
        self.dtype, self.device = dtype, device
        self.pin = device.type == "cuda"
        self.rows = self.capacity_blocks = 0
        self.host: dict[str, torch.Tensor] = {}  # k_codes, k_scale, k_zero, v_codes, v_scale, v_zero
        self.views: dict[str, torch.Tensor | None] = {}
        self.bounds = KeyBounds(n_kv_heads, head_dim, dtype, device)
        self._errors: list[torch.Tensor] = []  # per stored block: [max |rel err|, mean rel err^2] since the last pop
        self.reserve(1, 64)

    def _host_shapes(self, n_rows: int, n_blocks: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n_heads, block_size, _ = self.shape
        tile = ((n_rows, n_blocks, n_heads, 1, 1), torch.float32)
        codes = ((n_rows, n_blocks, n_heads, block_size, self.code_dim), torch.uint8)
        return {f"{t}_{part}": spec for t in "kv" for part, spec in (("codes", codes), ("scale", tile), ("zero", tile))}

    def reserve(self, n_rows: int, n_blocks: int) -> None:
        """Room for rows below `n_rows` and block ids below `n_blocks` (bounds the cache knows on the host)."""
        if n_rows <= self.rows and n_blocks <= self.capacity_blocks:
            return
        rows = max(n_rows, 2 * self.rows) if n_rows > self.rows else self.rows  # doubling, as blocks
        blocks = max(n_blocks, 2 * self.capacity_blocks) if n_blocks > self.capacity_blocks else self.capacity_blocks
        grown = {
            name: torch.empty(shape, dtype=dtype, pin_memory=self.pin)
            for name, (shape, dtype) in self._host_shapes(rows, blocks).items()
        }
        old_rows, old_blocks = self.rows, self.capacity_blocks
        if old_rows and old_blocks:
            if self.pin:  # scatters through mapped views are kernels: let them land before the host copies
                torch.cuda.current_stream(self.device).synchronize()
            for name, tensor in grown.items():
                tensor[:old_rows, :old_blocks] = self.host[name]
        self.host = grown
        self.bounds.reserve(rows, blocks)
        # Indexed by (row, block id) on the device (tracer.transfer.mapped_view); None where CUDA refuses it.
        self.views = {name: mapped_view(tensor, self.device) for name, tensor in grown.items()}
        self.rows, self.capacity_blocks = rows, blocks

    key_max = property(lambda self: self.bounds.key_max)
    key_min = property(lambda self: self.bounds.key_min)

    def _scatter(self, name: str, rows: torch.Tensor, ids: torch.Tensor, tensor: torch.Tensor) -> None:
        view = self.views[name]
        if view is not None:
            view[rows, ids] = tensor
        else:  # no mapping: the ids and codes come to the host (one synchronisation)
            self.host[name][rows.cpu(), ids.cpu()] = tensor.cpu()

    def _gather(self, name: str, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        view = self.views[name]
        if view is not None:
            return view[rows, ids]
        return self.host[name][rows.cpu(), ids.cpu()].to(self.device, non_blocking=self.pin)

    def put(self, rows: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Quantize blocks [n, H, block, d] on the device and store them at (`rows`, `block_ids`) (device tensors,
        below the `reserve`d bounds); returns bytes D2H."""
        moved, errors = 0, []
        for prefix, x in (("k", keys), ("v", values)):
            tiles = quantize(x, self.bits)
            x_hat = dequantize(tiles, self.bits, self.dtype)
            errors.append(relative_errors(x, x_hat).flatten(1))
            if prefix == "k":
                self.bounds.put(rows, block_ids, x_hat)
            for part, tensor in zip(("codes", "scale", "zero"), tiles.tensors(), strict=True):
                self._scatter(f"{prefix}_{part}", rows, block_ids, tensor)
                moved += tensor.numel() * tensor.element_size()
        both = torch.cat(errors, dim=1)  # [n, elements of K and V]
        self._errors.append(torch.stack([both.abs().amax(1), both.square().mean(1)], dim=1))
        return moved

    def get(self, rows: torch.Tensor, block_ids: torch.Tensor, row: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Copy blocks' codes and grids to the device and dequantize: (keys, values, bytes copied H2D). (`row`, the
        one row every block is known to be from, is not needed here: each gather is by (row, id) already.)"""
        out, moved = [], 0
        for prefix in "kv":
            parts = [self._gather(f"{prefix}_{part}", rows, block_ids) for part in ("codes", "scale", "zero")]
            tiles = QuantizedTiles(*parts)
            moved += tiles.nbytes()
            out.append(dequantize(tiles, self.bits, self.dtype))
        return out[0], out[1], moved

    def block_bytes(self) -> int:
        """Bytes of one stored block: K and V codes plus their float32 scales and zero points."""
        n_heads, block_size, _ = self.shape
        return 2 * (n_heads * block_size * self.code_dim + 2 * n_heads * 4)

    def pop_block_errors(self) -> torch.Tensor | None:
        """Per block stored since the last call, in order: [max |relative error|, mean squared relative error]
        ([n, 2] on the device; every block has the same number of elements, so a run of blocks' RMS is the root
        of their mean). None when none were stored. The cache records it without reading it."""
        errors, self._errors = self._errors, []
        return torch.cat(errors) if errors else None

    def pop_quant_error(self) -> dict[str, float | None]:
        """Max and RMS relative error over the blocks stored since the last call (None when none were)."""
        errors = self.pop_block_errors()
        if errors is None:
            return {"quant_max_rel_err": None, "quant_rms_rel_err": None}
        return {"quant_max_rel_err": float(errors[:, 0].max()), "quant_rms_rel_err": float(errors[:, 1].mean().sqrt())}


def make_block_store(ddr_dtype: str, n_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    """The DDR store for `--ddr-dtype`: real data movement (`PinnedBlockStore`: a preallocated pinned pool
    addressed by (row, block) from the device) for `same`, else a quantized one."""
    if check_ddr_dtype(ddr_dtype) == "same":
        from tracer.transfer import PinnedBlockStore

        return PinnedBlockStore(n_kv_heads, block_size, head_dim, dtype, device)
    return QuantizedBlockStore(n_kv_heads, block_size, head_dim, dtype, device, ddr_dtype)
