"""Real data movement between the HBM tier (device tensors) and the DDR tier (host memory).

`PinnedBlockStore` is the DDR tier of one layer for every row of a batch: one preallocated host tensor of
blocks (K and V side by side, pinned on CUDA), addressed by (row, block id). The ids stay on the compute
device: a put scatters and a get gathers through `mapped_view`, which on CUDA is the pinned memory mapped into
the device's address space (unified virtual addressing), so a kernel reads or writes host memory over the link
and the host never waits for the ids; on a CPU the view is the host tensor itself, so the CPU runs the same
code. Where CUDA refuses the mapping the store reads the ids back and copies through the host (one
synchronisation per call). Writes through the view run in order on the compute stream, so a recall that follows
an offload reads what was written; the offload does not overlap later compute (`asynchronous_offload` is
False), which the cross-check's measured profile takes into account. Bytes are counted from the tensors moved
(`numel * element_size`). The quantized tier (tracer/quant.py) has the same interface.
"""

from __future__ import annotations

import math

import torch


def host_to_device(values, device: torch.device) -> torch.Tensor:
    """Host-known values (a list, a NumPy array) as a tensor on the compute device, without making the host wait:
    on CUDA through pinned memory, non-blocking (PyTorch's caching host allocator keeps the pinned buffer until
    the copy has run). `torch.tensor(values, device=cuda)` would copy from pageable memory, which synchronises
    the stream: the host would wait for every kernel queued before it. On a CPU: the tensor itself."""
    tensor = torch.as_tensor(values)
    if (device.type if isinstance(device, torch.device) else torch.device(device).type) != "cuda":
        return tensor  # (the cache passes a torch.device: making one per call showed in a step's profile)
    return tensor.pin_memory().to(device, non_blocking=True)


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


class KeyBounds:
    """Per-block key bounds of a DDR store (elementwise max and min over a block's tokens, Quest-style), on the
    compute device, laid out for recall: `tensor` [rows, Hkv, blocks, 2d + 1] holds, per row, KV head and block,
    the block's kmax (d values), its kmin (d values), then one recall-mask value: 0 for a block whose home is DDR,
    the dtype's lowest value for every other block (never offloaded, in HBM, evicted). Block-major, so that the
    first n blocks of a row and head, all recall reads, are one contiguous run (blocks as the last axis, a
    column of n per row of 2d + 1 over the whole capacity, made the bound's batched GEMM ~2x slower on a CPU,
    more when cold). One batched GEMM then bounds every block's logit, `[q+, q-, 1] @ tensor[row, head]^T`
    (q+ = max(q, 0), q- = min(q, 0): per element the larger of q * kmax and q * kmin, as Quest's bound asks),
    and ranks every block outside DDR below every DDR block, so recall needs no mask of its own. The cache marks DDR membership where it places blocks
    (`mark`); `key_max` / `key_min` are [rows, blocks, Hkv, d] views. Unwritten bounds hold zeros (defined, and
    masked)."""

    def __init__(self, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.head_dim, self.lowest = head_dim, torch.finfo(dtype).min  # lowest + a finite bound stays lowest
        self.tensor = torch.zeros((0, n_kv_heads, 0, 2 * head_dim + 1), dtype=dtype, device=device)
        self._queries: dict[tuple, torch.Tensor] = {}  # query shape -> its [q+, q-, 1] buffer

    def reserve(self, n_rows: int, n_blocks: int) -> None:
        old_rows, n_kv_heads, old_blocks, width = self.tensor.shape
        if n_rows <= old_rows and n_blocks <= old_blocks:
            return
        grown = self.tensor.new_zeros((max(n_rows, old_rows), n_kv_heads, max(n_blocks, old_blocks), width))
        grown[..., 2 * self.head_dim] = self.lowest  # new blocks are not in DDR
        grown[:old_rows, :, :old_blocks] = self.tensor
        self.tensor = grown

    def put(self, rows: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor) -> None:
        """The bounds of blocks [n, Hkv, block, d] stored at (`rows`, `block_ids`): one scatter (DDR membership is
        the cache's to `mark`: it decides where a block's home is)."""
        # (the two advanced indices, apart, lead the indexed result: [n, Hkv, 2d], as the cat below)
        self.tensor[rows, :, block_ids, : 2 * self.head_dim] = torch.cat([keys.amax(dim=2), keys.amin(dim=2)], -1)

    def mark(self, rows: torch.Tensor, in_ddr: torch.Tensor) -> None:
        """Recall's mask for `rows`' first blocks: `in_ddr` [m, blocks] True where a block's home is DDR."""
        mask = torch.where(in_ddr, 0.0, self.lowest).to(self.tensor.dtype)
        self.tensor[rows, :, : in_ddr.shape[1], 2 * self.head_dim] = mask[:, None, :]

    def clear(self, row: int) -> None:
        """A refilled row has no block in DDR."""
        self.tensor[row, ..., 2 * self.head_dim] = self.lowest

    def in_ddr(self, rows: slice | torch.Tensor, n_blocks: int) -> torch.Tensor:
        """[m, n_blocks] True where a block of `rows` is in DDR (the mask row, read as a mask)."""
        return self.tensor[rows, 0, :n_blocks, 2 * self.head_dim] == 0

    def logit_bounds(self, query: torch.Tensor, rows: slice | torch.Tensor, n_blocks: int) -> torch.Tensor:
        """Quest's upper bound on each block's attention logit, sum_d max(q_d kmax_d, q_d kmin_d), for the
        queries [m, Hkv, group, d] of `rows` (a slice or index of m rows) over their first `n_blocks` blocks,
        with every block outside DDR at the dtype's lowest value: [m, Hkv, group, n_blocks]. One GEMM: no
        [m, blocks, Hkv, group, d] intermediate; q+ and q- are written into the query buffer (no concatenation)."""
        d = self.head_dim
        signed = self._queries.get(query.shape)
        if signed is None or signed.dtype != query.dtype:
            signed = query.new_ones((*query.shape[:-1], 2 * d + 1))
            self._queries[query.shape] = signed
        torch.clamp_min(query, 0, out=signed[..., :d])
        torch.clamp_max(query, 0, out=signed[..., d : 2 * d])
        # (bmm on [m x Hkv] batches, not matmul's 4-D dispatch: ~1.5 us less per layer and step on a CPU)
        bounds = self.tensor[rows, :, :n_blocks]
        return torch.bmm(signed.flatten(0, 1), bounds.flatten(0, 1).transpose(1, 2)).view(*query.shape[:-1], n_blocks)

    @property
    def key_max(self) -> torch.Tensor:
        return self.tensor[..., : self.head_dim].transpose(1, 2)

    @property
    def key_min(self) -> torch.Tensor:
        return self.tensor[..., self.head_dim : 2 * self.head_dim].transpose(1, 2)


class PinnedBlockStore:
    """The DDR tier of one layer, for every row (sequence) of a batch, with real data movement.

    Blocks live in one preallocated host tensor `[rows, blocks, 2, n_kv_heads, block_size, head_dim]` (pinned
    on CUDA): slot = (row, logical block id), K and V side by side, so a block is contiguous. Rows and block ids
    stay on the compute device: `put` scatters the blocks into their slots and `get` gathers them through
    `mapped_view` (on a CPU the host tensor itself; on CUDA the mapped pinned pages, a kernel that reads or
    writes host memory over the link), so neither reads an id back and a decode step never waits for the host;
    one call moves every row's blocks of the layer. Where CUDA refuses the mapping, both read the ids back and
    copy through the host (one synchronisation per call). Per-block key bounds (`KeyBounds`: elementwise
    min/max over the block's tokens, Quest-style) stay on the compute device, as the cache expects.
    """

    def __init__(self, n_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.shape = (n_kv_heads, block_size, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.pin = self.device.type == "cuda"
        self.storage = torch.empty((0, 0, 2, *self.shape), dtype=dtype)
        self.view: torch.Tensor | None = self.storage
        self.bounds = KeyBounds(n_kv_heads, head_dim, dtype, self.device)
        self._row_base: tuple = (None, 0, None)  # (rows of the last get, capacity, their offsets in the flat pool)
        self._written = False  # whether any block was put (growth then keeps the pool's contents)
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
        if self._written:  # (a pool nothing was put into has nothing to keep: the cache sizes a fresh one once)
            old_rows, old_blocks = self.storage.shape[:2]
            storage[:old_rows, :old_blocks].copy_(self.storage)
        self.storage, self.view = storage, mapped_view(storage, self.device)
        self.bounds.reserve(rows, blocks)

    def put(self, rows: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Store blocks [n, H, block, d] (on the compute device) at (`rows`, `block_ids`) (device tensors of n,
        below the `reserve`d bounds); returns bytes copied D2H."""
        return self.put_blocks(rows, block_ids, torch.stack([keys, values], dim=1))

    def put_blocks(self, rows: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> int:
        """`put` of blocks laid out as stored, [n, 2, H, block, d] (K and V side by side): one scatter."""
        self.bounds.put(rows, block_ids, blocks[:, 0])
        self._written = True
        if self.view is not None:  # one flat index, a contiguous block copy per id (a 2-D advanced-index put of a
            # B = 32 prefill's offloaded blocks took ~4x as long on a CPU)
            self.view.flatten(0, 1).index_copy_(0, rows * self.view.shape[1] + block_ids, blocks)
        else:  # no mapping: the ids and blocks come to the host (one synchronisation)
            self.storage[rows.cpu(), block_ids.cpu()] = blocks.cpu()
        return blocks.numel() * blocks.element_size()

    def _slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Each of `rows`' first slot in the flat pool ([rows, blocks] flattened), kept while the cache passes the
        same rows tensor (step after step) and the pool keeps its capacity."""
        capacity = self.view.shape[1]
        if self._row_base[0] is not rows or self._row_base[1] != capacity:
            self._row_base = (rows, capacity, rows * capacity)
        return self._row_base[2]

    def get(self, rows: torch.Tensor, block_ids: torch.Tensor, row: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Copy blocks (`rows`, `block_ids`) to the compute device: ([n, H, block, d] keys, values, bytes H2D).
        `row`: when the caller knows every block is that one row's (then no row offset is added on the device)."""
        blocks, n_bytes = self.get_blocks(rows, block_ids, row)
        return blocks[:, 0], blocks[:, 1], n_bytes

    def get_blocks(self, rows: torch.Tensor, block_ids: torch.Tensor, row: int | None = None,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """`get` as stored: ([n, 2, H, block, d] blocks, K and V side by side, bytes H2D); into `out` when given
        (and the pool is mapped)."""
        if self.view is not None and row is not None:
            blocks = torch.index_select(self.view[row], 0, block_ids, out=out)
        elif self.view is not None:  # one flat index: a contiguous block copy per id, not a 2-D advanced index
            blocks = torch.index_select(self.view.flatten(0, 1), 0, self._slots(rows) + block_ids, out=out)
        else:  # no mapping: the ids come to the host (one synchronisation)
            blocks = self.storage[row if row is not None else rows.cpu(), block_ids.cpu()].to(
                self.device, non_blocking=self.pin)
        return blocks, blocks.numel() * blocks.element_size()

    def get_into(self, row: int, block_ids: torch.Tensor, out: torch.Tensor) -> int:
        """`get_blocks` for blocks of one `row`, written straight into `out` ([n, 2, H, block, d], a view such as a
        row's staging pages): one gather, no intermediate copy. Returns bytes copied H2D."""
        if self.view is None:  # no mapping: through the host, as `get_blocks` copies
            blocks, n_bytes = self.get_blocks(None, block_ids, row)
            out.copy_(blocks)
            return n_bytes
        torch.index_select(self.view[row], 0, block_ids, out=out)
        return block_ids.shape[0] * self.block_bytes()

    def get_pages_into(self, rows: torch.Tensor, block_ids: torch.Tensor, pages: list[torch.Tensor]) -> int:
        """`rows`' blocks `block_ids` [m, width] (the j-th of each row into `pages[j]`, a [m, 2, H, block, d] view
        such as every row's j-th staging page): one gather per page, straight into it, no intermediate buffer
        (measured on the micro shapes at m = 32, width 4: ~10% less than one gather and a copy into the pages,
        alone; more in a decode step, whose caches the buffer's extra 1.5 MB pass also cleared). Returns bytes
        copied H2D."""
        if self.view is None:  # no mapping: through the host, as `get_blocks` copies
            blocks, n_bytes = self.get_blocks(rows.repeat_interleave(block_ids.shape[1]), block_ids.reshape(-1))
            for j, page in enumerate(pages):
                page.copy_(blocks.view(*block_ids.shape, *blocks.shape[1:])[:, j])
            return n_bytes
        slots = block_ids.t() + self._slots(rows)  # [width, m]: each page's flat slots, one kernel
        flat = self.view.flatten(0, 1)
        for j, page in enumerate(pages):
            torch.index_select(flat, 0, slots[j], out=page)
        return block_ids.numel() * self.block_bytes()

    key_max = property(lambda self: self.bounds.key_max)
    key_min = property(lambda self: self.bounds.key_min)

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
        """Bytes of one stored block: its K and V."""
        return 2 * math.prod(self.shape) * self.storage.element_size()
