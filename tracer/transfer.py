"""Real data movement between the HBM tier (device tensors) and the DDR tier (host memory).

`PinnedBlockStore` is the DDR tier of one layer for every row of a batch: one preallocated host tensor of
blocks (K and V side by side, pinned on CUDA), addressed by (row, block id). Two ways to move blocks
(`DDR_COPY_MODES`, chosen per store, by default from the environment variable `THOUGHTKV_DDR_COPY`):

- `kernel` (the default): the ids stay on the compute device; a put scatters and a get gathers through
  `mapped_view`, which on CUDA is the pinned memory mapped into the device's address space (unified virtual
  addressing), so a kernel reads or writes host memory over the link on the compute stream's SMs and the host
  never waits for the ids; on a CPU the view is the host tensor itself, so the CPU runs the same code. Writes
  run in order on the compute stream, so a recall that follows an offload reads what was written; the offload
  does not overlap later compute (`asynchronous_offload` False).
- `copy-engine`: the DMA engines move the bytes, not the SMs. An offload copies the (device-gathered) blocks
  and their slots into a pinned staging buffer on a side stream and scatters them into the pool on the host
  when the pool is next read (`_settle`): it overlaps later compute (`asynchronous_offload` True). A recall
  reads the ids back (one synchronisation per call), gathers the blocks on the host into a pinned staging
  buffer and copies it to the device on the side stream, which the compute stream then waits for. Also the
  path wherever CUDA refuses the mapping (`probe_mapping`).

Bytes are counted from the tensors moved (`numel * element_size`). The quantized tier (tracer/quant.py) has the
same interface. `MoveTimer` times each store's recalls and offloads per call (tests/gpu/tracer_throughput.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from thoughtkv_base import UserError

DDR_COPY_ENV = "THOUGHTKV_DDR_COPY"
DDR_COPY_MODES = ("kernel", "copy-engine")


class BadDdrCopy(UserError):
    pass


def ddr_copy_mode(mode: str | None = None) -> str:
    """The DDR tier's way of moving blocks: `mode` when given, else `$THOUGHTKV_DDR_COPY`, else `kernel`."""
    chosen = (os.environ.get(DDR_COPY_ENV) or "kernel") if mode is None else mode
    if chosen not in DDR_COPY_MODES:
        raise BadDdrCopy(f"DDR copy mode {chosen!r} (from {'$' + DDR_COPY_ENV if mode is None else 'the caller'}) is "
                         f"not one of {', '.join(DDR_COPY_MODES)}: set {DDR_COPY_ENV} to one of them or unset it")
    return chosen


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
    memory is not pinned, the mapping is refused, or `probe_mapping` found that kernels cannot use it (the caller
    then moves blocks by copies). Making the view neither copies nor waits: it is checked to alias the pages (the
    same address, on `device`), and the probe runs once per process and device.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return host
    if not host.is_pinned() or not probe_mapping(device).mapped:
        return None
    return _device_view(host, device)


def _device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The CUDA tensor over `host`'s pinned pages (through the CUDA array interface), or None where torch would
    not alias them (another device, or a copy)."""

    class _Mapped:  # the CUDA array interface over the pinned bytes (bf16 has no typestr, so as bytes)
        __cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                    "data": (host.data_ptr(), False), "version": 3, "strides": None}

    try:
        # (no `device=`: the view lands on the pointer's own device, checked below; given another, torch would copy)
        view = torch.as_tensor(_Mapped())
    except (RuntimeError, TypeError, ValueError):
        return None
    same_device = view.device.type == "cuda" and device.index in (None, view.device.index)
    if not same_device or view.data_ptr() != host.data_ptr():
        return None
    view = view.view(host.dtype).view(host.shape)
    view._thoughtkv_host = host  # the view does not own the pages: keep them alive with it
    return view


@dataclass(frozen=True)
class MappingProbe:
    mapped: bool  # whether kernels read and write pinned host memory through its mapped view
    reason: str


PROBE_BYTES = 1 << 16


@functools.cache
def probe_mapping(device: torch.device) -> MappingProbe:
    """Whether kernels on `device` can use mapped pinned memory, tried once per process and device on a small
    pinned buffer of known bytes (`kernels_use_mapping`). A copy through the mapping would not prove it: a copy
    runs on the copy engine, not in a kernel. Where a runtime maps no such memory (a sandbox might), the probe's
    own kernel may fault and take the process: tests/gpu/on_device.sh runs it in a process of its own first."""
    device = torch.device(device)
    if device.type != "cuda":
        return MappingProbe(True, "a CPU: the host tensor itself")
    host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.arange(PROBE_BYTES, dtype=torch.int64).remainder_(251).to(torch.uint8))  # known bytes
    view = _device_view(host, device)
    if view is None:
        return MappingProbe(False, "CUDA did not map the pinned buffer into the device's address space")
    return kernels_use_mapping(view, host)


def kernels_use_mapping(view: torch.Tensor, host: torch.Tensor) -> MappingProbe:
    """Whether kernels on `view`'s device read `host`'s bytes and write into them through `view` (two 1-D uint8
    tensors over the same initialised bytes: on CUDA the mapped view, on a CPU the tensor itself). Gathers every
    seventh byte in reverse through the view with an add (a kernel that reads the mapped pages) and compares it
    with the host's own; then scatters bytes that differ from the ones there through the view and reads them on
    the host. Compared as bytes: a NaN pattern cannot make equal bytes differ."""
    picks_host = torch.arange(host.numel() - 1, -1, -7)
    picks = picks_host.to(view.device)
    expected = host[picks_host].add(1)
    if not torch.equal(torch.index_select(view, 0, picks).add_(1).cpu(), expected):
        return MappingProbe(False, "a kernel gathering through the mapped view read other bytes than the host's")
    view.index_copy_(0, picks, expected.to(view.device))  # (each byte + 1: none equals what was there)
    if view.device.type == "cuda":
        torch.cuda.synchronize(view.device)
    if not torch.equal(host[picks_host], expected):
        return MappingProbe(False, "a kernel scattering through the mapped view did not write the host's bytes")
    return MappingProbe(True, "kernels gather and scatter the pinned pages through the mapped view")


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
        # (bmm on [m x Hkv] batches: a cheaper dispatch than matmul's 4-D broadcasting)
        bounds = self.tensor[rows, :, :n_blocks]
        return torch.bmm(signed.flatten(0, 1), bounds.flatten(0, 1).transpose(1, 2)).view(*query.shape[:-1], n_blocks)

    @property
    def key_max(self) -> torch.Tensor:
        return self.tensor[..., : self.head_dim].transpose(1, 2)

    @property
    def key_min(self) -> torch.Tensor:
        return self.tensor[..., self.head_dim : 2 * self.head_dim].transpose(1, 2)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The copy engine's stream on `device`, one for every store (their copies queue on the same engines)."""
    return torch.cuda.Stream(device)


class PinnedBlockStore:
    """The DDR tier of one layer, for every row (sequence) of a batch, with real data movement.

    Blocks live in one preallocated host tensor `[rows, blocks, 2, n_kv_heads, block_size, head_dim]` (pinned
    on CUDA): slot = (row, logical block id), K and V side by side, so a block is contiguous. Rows and block ids
    stay on the compute device. `copy_mode` (`ddr_copy_mode`: `kernel` unless `$THOUGHTKV_DDR_COPY` says
    otherwise) picks how blocks move: `kernel`, `put` scatters the blocks into their slots and `get` gathers them
    through `mapped_view` (on a CPU the host tensor itself; on CUDA the mapped pinned pages, a kernel that reads
    or writes host memory over the link), so neither reads an id back and a decode step never waits for the
    host; `copy-engine` (also wherever the mapping is refused), through pinned staging buffers and copies on a
    side stream (the module's docstring). One call moves every row's blocks of the layer. Per-block key bounds
    (`KeyBounds`: elementwise min/max over the block's tokens, Quest-style) stay on the compute device, as the
    cache expects.
    """

    def __init__(self, n_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 copy_mode: str | None = None):
        self.shape = (n_kv_heads, block_size, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.copy_mode = ddr_copy_mode(copy_mode)
        self.pin = self.device.type == "cuda"
        self.side = _side_stream(self.device) if self.pin and self.copy_mode == "copy-engine" else None
        self.storage = torch.empty((0, 0, 2, *self.shape), dtype=dtype)
        self.view: torch.Tensor | None = None
        self.bounds = KeyBounds(n_kv_heads, head_dim, dtype, self.device)
        self._row_base: tuple = (None, 0, None)  # (rows of the last get, capacity, their offsets in the flat pool)
        self._written = False  # whether any block was put (growth then keeps the pool's contents)
        self._pending: list[tuple] = []  # copy-engine offloads not yet in the pool: (event, slots, blocks)
        self.reserve(1, 64)

    @property
    def asynchronous_offload(self) -> bool:
        """Whether an offload's copies overlap the compute that follows it: on CUDA, on the copy engine's side
        stream; the kernel path's scatters run in order on the compute stream."""
        return self.side is not None

    def _settle(self) -> None:
        """Land every write into the pool before the host reads or copies it (growth, `keys`, a copy-engine
        recall): the kernel path's scatters (on the compute stream), the copy engine's pending offloads."""
        if self.pin and self.view is not None and self._written:
            torch.cuda.current_stream(self.device).synchronize()
        pending, self._pending = self._pending, []
        flat = self.storage.flatten(0, 1)
        for event, slots, blocks in pending:
            if event is not None:
                event.synchronize()
            flat.index_copy_(0, slots, blocks)

    def reserve(self, n_rows: int, n_blocks: int) -> None:
        """Room for rows below `n_rows` and block ids below `n_blocks` (bounds the cache knows on the host, so
        no id is read back). Growing (the block capacity doubles: rare) copies the pool on the host; a pool
        nothing was put into is replaced without waiting for anything."""
        rows, blocks = self.storage.shape[:2]
        if n_rows <= rows and n_blocks <= blocks:
            return
        if self._written:
            self._settle()
        rows = max(n_rows, 2 * rows) if n_rows > rows else rows  # doubling: rows and blocks come one by one
        blocks = max(n_blocks, 2 * blocks) if n_blocks > blocks else blocks
        storage = torch.empty((rows, blocks, 2, *self.shape), dtype=self.dtype, pin_memory=self.pin)
        if self._written:  # (a pool nothing was put into has nothing to keep: the cache sizes a fresh one once)
            old_rows, old_blocks = self.storage.shape[:2]
            storage[:old_rows, :old_blocks].copy_(self.storage)
        self.storage = storage
        self.view = mapped_view(storage, self.device) if self.copy_mode == "kernel" else None
        self.bounds.reserve(rows, blocks)

    @contextlib.contextmanager
    def _on_side_stream(self, *used: torch.Tensor) -> Iterator[None]:
        """Run the block's copies on the side stream, after the compute stream's work so far; `used`: device
        tensors the copies read or write (kept from the allocator until the side stream is done with them). On
        a CPU: in place."""
        if self.side is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)
        with torch.cuda.stream(self.side):
            yield
        for tensor in used:
            tensor.record_stream(self.side)

    def put(self, rows: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Store blocks [n, H, block, d] (on the compute device) at (`rows`, `block_ids`) (device tensors of n,
        below the `reserve`d bounds); returns bytes copied D2H."""
        return self.put_blocks(rows, block_ids, torch.stack([keys, values], dim=1))

    def put_blocks(self, rows: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> int:
        """`put` of blocks laid out as stored, [n, 2, H, block, d] (K and V side by side): one scatter."""
        self.bounds.put(rows, block_ids, blocks[:, 0])
        self._written = True
        slots = rows * self.storage.shape[1] + block_ids
        if self.view is not None:  # one flat index, a contiguous block copy per id (a 2-D advanced-index put of a
            # B = 32 prefill's offloaded blocks took ~4x as long on a CPU)
            self.view.flatten(0, 1).index_copy_(0, slots, blocks)
        else:  # the copy engine: blocks and slots to pinned staging, scattered into the pool when it is next read
            staged = (torch.empty(slots.shape, dtype=slots.dtype, pin_memory=self.pin),
                      torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=self.pin))
            with self._on_side_stream(slots, blocks):
                staged[0].copy_(slots, non_blocking=self.pin)
                staged[1].copy_(blocks, non_blocking=self.pin)
            event = None
            if self.side is not None:  # (the host scatters them once this has passed: `_settle`)
                event = torch.cuda.Event()
                event.record(self.side)
            self._pending.append((event, *staged))
        return blocks.numel() * blocks.element_size()

    def _slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Each of `rows`' first slot in the flat pool ([rows, blocks] flattened), kept while the cache passes the
        same rows tensor (step after step) and the pool keeps its capacity."""
        capacity = self.storage.shape[1]
        if self._row_base[0] is not rows or self._row_base[1] != capacity:
            self._row_base = (rows, capacity, rows * capacity)
        return self._row_base[2]

    def _copy_in(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The copy engine's recall: the blocks at flat `slots` (on the device) on the device, in `out` when
        given: the slots read back (the one synchronisation), the blocks gathered on the host into pinned
        staging, one copy to the device on the side stream, which the compute stream then waits for."""
        host_slots = slots.cpu()
        self._settle()
        staged = torch.empty((host_slots.shape[0], 2, *self.shape), dtype=self.dtype, pin_memory=self.pin)
        torch.index_select(self.storage.flatten(0, 1), 0, host_slots, out=staged)
        if out is None:
            out = torch.empty(staged.shape, dtype=self.dtype, device=self.device)
        with self._on_side_stream(out):
            out.copy_(staged, non_blocking=self.pin)
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        return out

    def get(self, rows: torch.Tensor, block_ids: torch.Tensor, row: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Copy blocks (`rows`, `block_ids`) to the compute device: ([n, H, block, d] keys, values, bytes H2D).
        `row`: when the caller knows every block is that one row's (then no row offset is added on the device)."""
        blocks, n_bytes = self.get_blocks(rows, block_ids, row)
        return blocks[:, 0], blocks[:, 1], n_bytes

    def get_blocks(self, rows: torch.Tensor, block_ids: torch.Tensor, row: int | None = None,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """`get` as stored: ([n, 2, H, block, d] blocks, K and V side by side, bytes H2D); into `out` when given."""
        if self.view is not None and row is not None:
            blocks = torch.index_select(self.view[row], 0, block_ids, out=out)
        elif self.view is not None:  # one flat index: a contiguous block copy per id, not a 2-D advanced index
            blocks = torch.index_select(self.view.flatten(0, 1), 0, self._slots(rows) + block_ids, out=out)
        else:
            offset = row * self.storage.shape[1] if row is not None else self._slots(rows)
            blocks = self._copy_in(block_ids + offset, out)
        return blocks, blocks.numel() * blocks.element_size()

    def get_into(self, row: int, block_ids: torch.Tensor, out: torch.Tensor) -> int:
        """`get_blocks` for blocks of one `row`, written straight into `out` ([n, 2, H, block, d], a view such as a
        row's staging pages): one gather, no intermediate copy. Returns bytes copied H2D."""
        if self.view is not None:
            torch.index_select(self.view[row], 0, block_ids, out=out)
        else:
            self._copy_in(block_ids + row * self.storage.shape[1], out)
        return block_ids.shape[0] * self.block_bytes()

    def get_pages_into(self, rows: torch.Tensor, block_ids: torch.Tensor, pages: list[torch.Tensor]) -> int:
        """`rows`' blocks `block_ids` [m, width] (the j-th of each row into `pages[j]`, a [m, 2, H, block, d] view
        such as every row's j-th staging page): one gather per page, straight into it, no intermediate buffer
        (an intermediate buffer costs one more pass over the recalled bytes and clears the caches a decode step
        is about to use; tests/bench/tiered_step_cost.py times the recall path). Returns bytes copied H2D."""
        slots = block_ids.t() + self._slots(rows)  # [width, m]: each page's flat slots, one kernel
        if self.view is not None:
            flat = self.view.flatten(0, 1)
            for j, page in enumerate(pages):
                torch.index_select(flat, 0, slots[j], out=page)
        else:
            blocks = self._copy_in(slots.reshape(-1)).view(len(pages), -1, 2, *self.shape)
            for page, page_blocks in zip(pages, blocks, strict=True):
                page.copy_(page_blocks)
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


class MoveTimer:
    """The time of each recall (a block store's gather to the device) and offload (its scatter to the host), per
    store, while active (`with MoveTimer(device) as timer:` wraps `PinnedBlockStore`'s methods; nothing when
    not). CUDA: a pair of timing events on the compute stream around each call, read by `us` after the run's
    last synchronisation (the kernel path's moves are kernels there; the copy engine's recall is waited for
    there; its offload's side-stream copy is not in it, by design: it overlaps). A CPU: the call's wall time."""

    METHODS = {"recall": ("get_blocks", "get_into", "get_pages_into"), "offload": ("put_blocks",)}

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.calls: dict[int, dict[str, list]] = {}  # id(store) -> direction -> [(start, end)]
        self._saved: list[tuple[str, object]] = []
        self._depth = 0  # (a call inside a timed one is that one's: get -> get_blocks)

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _timed(self, direction: str, method):
        timer = self

        def timed(store, *args, **kwargs):
            if timer._depth:
                return method(store, *args, **kwargs)
            timer._depth += 1
            start = timer._mark()
            try:
                return method(store, *args, **kwargs)
            finally:
                timer._depth -= 1
                by_store = timer.calls.setdefault(id(store), {"recall": [], "offload": []})
                by_store[direction].append((start, timer._mark()))

        return timed

    def __enter__(self) -> MoveTimer:
        for direction, names in self.METHODS.items():
            for name in names:
                method = getattr(PinnedBlockStore, name)
                self._saved.append((name, method))
                setattr(PinnedBlockStore, name, self._timed(direction, method))
        return self

    def __exit__(self, *exc) -> None:
        for name, method in reversed(self._saved):
            setattr(PinnedBlockStore, name, method)
        self._saved.clear()

    def us(self, store) -> dict[str, list[float]]:
        """`store`'s calls so far, µs each, by direction (call after the device has synchronised)."""
        by_store = self.calls.get(id(store), {"recall": [], "offload": []})
        if self.cuda:
            return {d: [a.elapsed_time(b) * 1e3 for a, b in calls] for d, calls in by_store.items()}
        return {d: [(b - a) * 1e6 for a, b in calls] for d, calls in by_store.items()}
