"""tracer.transfer (the DDR tier's real data movement): blocks survive put -> get bit for bit at their (row,
block) address, bytes are the bytes of the tensors moved, the copy-engine path (also the unmapped fallback) moves
the same blocks as the kernel path, and a decode gives the same logits and traffic on either; the mapping probe
tells a mapped view from a copy. CPU here; the same code runs on CUDA through the mapped pinned pool
(tests/gpu/ runs this file there)."""

from __future__ import annotations

import pytest
import torch

HEADS, BLOCK, DIM = 2, 4, 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("copy_mode", ["kernel", "copy-engine"])
@pytest.mark.parametrize("device", DEVICES)
def test_pinned_store_behaves_like_the_tracer_store(device, copy_mode):
    """Differential: the same puts and gets on one plain reference store per row (below) and on the batched
    PinnedBlockStore, which addresses every row's blocks by (row, block id) in one call, either way of moving
    them (on CUDA the copy engine's offloads land on the host later, on a side stream)."""
    from tracer.transfer import PinnedBlockStore

    device = torch.device(device)
    n_rows = 3
    references = [HostBlockStore(HEADS, BLOCK, DIM, torch.float32, device) for _ in range(n_rows)]
    store = PinnedBlockStore(HEADS, BLOCK, DIM, torch.float32, device, copy_mode=copy_mode)
    assert store.asynchronous_offload == (device.type == "cuda" and copy_mode == "copy-engine")
    store.reserve(n_rows, 100)  # the bounds, as the cache names them
    g = torch.Generator().manual_seed(1)
    for round_ in range(6):
        ids = torch.randperm(100, generator=g)[: 3 + round_].sort().values  # grows past the initial capacity
        rows = torch.randint(0, n_rows, (len(ids),), generator=g)
        keys = torch.randn(len(ids), HEADS, BLOCK, DIM, generator=g).to(device)
        values = torch.randn(len(ids), HEADS, BLOCK, DIM, generator=g).to(device)
        moved = sum(references[r].put(ids[rows == r], keys[rows == r], values[rows == r])
                    for r in range(n_rows) if (rows == r).any())
        assert store.put(rows.to(device), ids.to(device), keys, values) == moved
        wanted = torch.randperm(len(ids), generator=g)[:2]
        k, v, n = store.get(rows[wanted].to(device), ids[wanted].to(device))
        for index, position in enumerate(wanted.tolist()):
            k_ref, v_ref, n_ref = references[int(rows[position])].get(ids[position : position + 1])
            assert torch.equal(k[index : index + 1], k_ref) and torch.equal(v[index : index + 1], v_ref)
            assert n == 2 * n_ref and k.device.type == device.type
        for r in range(n_rows):
            held = ids[rows == r]
            reference = references[r]
            assert torch.equal(store.key_min[r, held], reference.key_min[held])
            assert torch.equal(store.key_max[r, held], reference.key_max[held])
            assert torch.equal(store.keys[r, held], reference.keys[held])
            assert torch.equal(store.values[r, held], reference.values[held])
    assert store.block_bytes() == references[0].block_bytes()


# The v1 DDR tier, kept as the reference PinnedBlockStore is held to (the tracer no longer uses it): whole KV
# blocks in host tensors indexed by logical block id, per-block key bounds on the compute device.
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
        host_keys, host_values = keys.cpu(), values.cpu()  # (blocking: read on the host at once below)
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


@pytest.mark.parametrize("ddr_dtype", ["same", "int8"])
def test_the_unmapped_fallback_moves_the_same_blocks(ddr_dtype):
    """Where CUDA refuses to map the pinned pool (`mapped_view` is None) the stores read the ids back and copy
    through the host: the same puts and gets give the same blocks, bounds and bytes as the mapped path (on a
    CPU the "mapped view" is the host tensor itself)."""
    from tracer.quant import make_block_store

    def store(mapped: bool):
        made = make_block_store(ddr_dtype, HEADS, BLOCK, DIM, torch.float32, torch.device("cpu"))
        made.reserve(3, 40)
        if not mapped:
            if hasattr(made, "views"):
                made.views = dict.fromkeys(made.views)
            else:
                made.view = None
        return made

    mapped, unmapped = store(True), store(False)
    g = torch.Generator().manual_seed(3)
    rows, ids = torch.tensor([0, 2, 2, 1]), torch.tensor([5, 5, 39, 0])
    keys, values = torch.randn(4, HEADS, BLOCK, DIM, generator=g), torch.randn(4, HEADS, BLOCK, DIM, generator=g)
    assert mapped.put(rows, ids, keys, values) == unmapped.put(rows, ids, keys, values) > 0
    back_rows, back_ids = torch.tensor([2, 0, 1]), torch.tensor([39, 5, 0])
    for got, want in zip(unmapped.get(back_rows, back_ids), mapped.get(back_rows, back_ids), strict=True):
        assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want
    assert torch.equal(unmapped.key_min[rows, ids], mapped.key_min[rows, ids])
    if hasattr(mapped, "get_into"):  # one row's blocks written into a given (strided) view: as `get` gives them
        one_ids, (want_keys, want_values, want_bytes) = torch.tensor([5, 39]), mapped.get(None, torch.tensor([5, 39]), 2)
        for made in (mapped, unmapped):
            pages = torch.zeros(2, HEADS, 4, BLOCK, DIM)  # [K/V, heads, pages, block, d]: the blocks in pages 1, 2
            assert made.get_into(2, one_ids, pages[:, :, 1:3].permute(2, 0, 1, 3, 4)) == want_bytes
            assert torch.equal(pages[0, :, 1:3].transpose(0, 1), want_keys)
            assert torch.equal(pages[1, :, 1:3].transpose(0, 1), want_values)
            assert not pages[:, :, [0, 3]].any()
    if hasattr(mapped, "get_pages_into"):  # several rows' j-th blocks into their j-th pages (strided views)
        page_rows, page_ids = torch.tensor([2, 0]), torch.tensor([[39, 5], [5, 5]])  # (blocks put above)
        want_keys, want_values, want_bytes = mapped.get(page_rows.repeat_interleave(2), page_ids.reshape(-1))
        for made in (mapped, unmapped):
            pool = torch.zeros(2, 2, HEADS, 4, BLOCK, DIM)  # [K/V, rows, heads, pages, block, d]: pages 1, 2
            views = [pool[:, :, :, page].transpose(0, 1) for page in (1, 2)]
            assert made.get_pages_into(page_rows, page_ids, views) == want_bytes
            assert torch.equal(pool[0, :, :, 1:3].transpose(1, 2).reshape(4, HEADS, BLOCK, DIM), want_keys)
            assert torch.equal(pool[1, :, :, 1:3].transpose(1, 2).reshape(4, HEADS, BLOCK, DIM), want_values)
            assert not pool[:, :, :, [0, 3]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_recall_bound_is_quests_elementwise_bound(dtype):
    """`KeyBounds.logit_bounds` (one GEMM over [q+, q-, 1] and [kmax, kmin, mask], what recall ranks blocks by)
    equals Quest's bound written out, sum_d max(q_d * kmin_d, q_d * kmax_d), over the keys each block was stored
    with, for the blocks marked in DDR; every other block (stored but not marked, or never stored) ranks below
    every DDR block, at the dtype's lowest value, until a refilled row clears its marks."""
    from tracer.transfer import PinnedBlockStore

    g = torch.Generator().manual_seed(5)
    n_rows, n_blocks, group = 2, 9, 3
    store = PinnedBlockStore(HEADS, BLOCK, DIM, dtype, torch.device("cpu"))
    store.reserve(n_rows, n_blocks)
    rows = torch.arange(n_rows).repeat_interleave(n_blocks)
    ids = torch.arange(n_blocks).repeat(n_rows)
    keys = torch.randn(len(ids), HEADS, BLOCK, DIM, generator=g).to(dtype)
    store.put(rows, ids, keys, torch.randn(keys.shape, generator=g).to(dtype))
    in_ddr = torch.rand(n_rows, n_blocks, generator=g) < 0.6
    in_ddr[:, 0], in_ddr[:, 1] = True, False
    store.bounds.mark(torch.arange(n_rows), in_ddr[:, :-1])  # the last block: stored, never marked
    in_ddr[:, -1] = False
    query = torch.randn(n_rows, HEADS, group, DIM, generator=g).to(dtype)
    got = store.bounds.logit_bounds(query, slice(0, n_rows), n_blocks + 3).float()  # [rows, Hkv, group, blocks]
    stored = keys.float().view(n_rows, n_blocks, HEADS, BLOCK, DIM)
    kmin, kmax = stored.amin(3), stored.amax(3)  # [rows, blocks, Hkv, d]
    q = query.float()[:, None]  # [rows, 1, Hkv, group, d]
    want = torch.maximum(q * kmin[:, :, :, None], q * kmax[:, :, :, None]).sum(-1).permute(0, 2, 3, 1)
    tolerance = 1e-5 if dtype == torch.float32 else 0.1  # bf16 rounds the products the GEMM accumulates
    marked = in_ddr[:, None, None, :].expand_as(want)
    torch.testing.assert_close(got[..., :n_blocks][marked], want[marked], rtol=tolerance, atol=tolerance)
    outside = torch.cat([~marked, torch.ones(*marked.shape[:3], 3, dtype=torch.bool)], -1)  # + 3 never stored
    assert got[outside].max() < got[..., :n_blocks][marked].min()
    assert torch.equal(store.bounds.in_ddr(slice(0, n_rows), n_blocks + 3), torch.cat(
        [in_ddr, torch.zeros(n_rows, 3, dtype=torch.bool)], 1))
    store.bounds.clear(1)
    assert not store.bounds.in_ddr(slice(1, 2), n_blocks).any() and store.bounds.in_ddr(0, n_blocks).any()
    assert torch.equal(store.key_min[rows, ids], keys.amin(2)) and torch.equal(store.key_max[rows, ids], keys.amax(2))


@pytest.mark.parametrize("ddr_dtype", ["same", "int8"])
def test_a_get_told_its_one_row_returns_what_the_general_get_does(ddr_dtype):
    """The cache names the row when one row recalls (no row offsets to add on the device): the same blocks,
    bytes and order as the general (row, id) gather."""
    from tracer.quant import make_block_store

    store = make_block_store(ddr_dtype, HEADS, BLOCK, DIM, torch.float32, torch.device("cpu"))
    store.reserve(3, 40)
    g = torch.Generator().manual_seed(4)
    rows, ids = torch.tensor([0, 2, 2, 2, 1]), torch.tensor([5, 5, 39, 7, 0])
    store.put(rows, ids, torch.randn(5, HEADS, BLOCK, DIM, generator=g), torch.randn(5, HEADS, BLOCK, DIM, generator=g))
    wanted = torch.tensor([39, 5, 7])
    general = store.get(torch.full((3,), 2), wanted)
    told = store.get(torch.full((3,), 2), wanted, 2)
    assert torch.equal(general[0], told[0]) and torch.equal(general[1], told[1]) and general[2] == told[2]


def moves(store, g: torch.Generator) -> list:
    """A fixed sequence of puts and every kind of get (growth past the first capacity included) on `store`:
    what each returned, and the blocks put as the host holds them at the end."""
    out, put = [], []
    store.reserve(3, 20)
    for round_ in range(5):
        n = 4 + 3 * round_
        rows, ids = torch.randint(0, 3, (n,), generator=g), torch.randperm(40 + 30 * round_, generator=g)[:n]
        store.reserve(3, int(ids.max()) + 1)
        out.append(store.put_blocks(rows, ids, torch.randn(n, 2, HEADS, BLOCK, DIM, generator=g)))
        put.append((rows, ids))
        wanted = torch.randperm(n, generator=g)[:3]
        out.append(store.get_blocks(rows[wanted], ids[wanted]))
        one = ids[rows == rows[0]][:2]
        out.append(store.get_blocks(None, one, int(rows[0])))
        pages = torch.zeros(2, HEADS, 4, BLOCK, DIM)  # [K/V, heads, pages, block, d]: one row's blocks in pages 1-2
        out += [store.get_into(int(rows[0]), one, pages[:, :, 1 : 1 + len(one)].permute(2, 0, 1, 3, 4)), pages]
        pool = torch.zeros(2, 2, HEADS, 3, BLOCK, DIM)  # two rows' blocks into their pages, page by page
        page_rows, page_ids = rows[:2], torch.stack([ids[:2], ids[:2]], 1)  # (each row's own blocks)
        views = [pool[:, :, :, page].transpose(0, 1) for page in (0, 1)]
        out += [store.get_pages_into(page_rows, page_ids, views), pool]
    rows, ids = (torch.cat(parts) for parts in zip(*put, strict=True))
    return out + [store.keys[rows, ids], store.values[rows, ids]]


def test_the_copy_engine_path_moves_what_the_kernel_path_moves():
    """`THOUGHTKV_DDR_COPY=copy-engine` (pinned staging, copies, offloads landing on the host later) against the
    default kernel path: every put and get returns the same blocks and bytes, and the pools end equal."""
    from tracer.transfer import PinnedBlockStore

    stores = {mode: PinnedBlockStore(HEADS, BLOCK, DIM, torch.float32, torch.device("cpu"), copy_mode=mode)
              for mode in ("kernel", "copy-engine")}
    assert stores["kernel"].view is not None and stores["copy-engine"].view is None  # the two paths, really
    got = {mode: moves(store, torch.Generator().manual_seed(11)) for mode, store in stores.items()}
    for want, have in zip(got["kernel"], got["copy-engine"], strict=True):
        pairs = zip(want, have, strict=True) if isinstance(want, tuple) else [(want, have)]
        for a, b in pairs:
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_the_copy_mode_comes_from_the_caller_or_the_environment(monkeypatch):
    from thoughtkv_base import UserError
    from tracer.transfer import DDR_COPY_ENV, PinnedBlockStore, ddr_copy_mode

    monkeypatch.delenv(DDR_COPY_ENV, raising=False)
    assert ddr_copy_mode() == "kernel"
    monkeypatch.setenv(DDR_COPY_ENV, "copy-engine")
    assert ddr_copy_mode() == "copy-engine" and ddr_copy_mode("kernel") == "kernel"
    assert PinnedBlockStore(HEADS, BLOCK, DIM, torch.float32, torch.device("cpu")).view is None
    monkeypatch.setenv(DDR_COPY_ENV, "dma")
    with pytest.raises(UserError, match=f"'dma'.*{DDR_COPY_ENV}"):
        ddr_copy_mode()


def test_a_decode_on_the_copy_engine_path_equals_the_kernel_paths(monkeypatch):
    """The flag end to end, through the cache as it builds its stores (`tracer.quant.make_block_store`): a batched
    hierarchy decode with recall gives the same tokens, logits and recorded traffic with either path, and blocks
    really moved through DDR."""
    from test_batched import settings, tiny_model

    from tracer.cache import TieredCache
    from tracer.decode import DecodeJob, decode_batch
    from tracer.recorder import Recorder
    from tracer.transfer import DDR_COPY_ENV

    model = tiny_model("qwen2")
    prompts = [torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (29, 12, 40)]
    runs = {}
    for mode in ("kernel", "copy-engine"):
        monkeypatch.setenv(DDR_COPY_ENV, mode)
        jobs = [DecodeJob(i, ids, settings("hierarchy"), Recorder()) for i, ids in enumerate(prompts)]
        cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
        runs[mode] = {job.key: (result.generated_ids, torch.stack(result.logits),
                                {k: job.recorder.columns[k] for k in ("recalled_block_ids", "bytes_h2d", "bytes_d2h")})
                      for job, result in decode_batch(model, jobs, cache, 2, 30, set(), keep_logits=True)}
        assert (cache.paged[0].ddr.view is None) == (mode == "copy-engine")
    for key in runs["kernel"]:
        (tokens, logits, traffic), (tokens_ce, logits_ce, traffic_ce) = runs["kernel"][key], runs["copy-engine"][key]
        assert tokens == tokens_ce and torch.equal(logits, logits_ce) and traffic == traffic_ce
        assert sum(traffic["bytes_h2d"]) > 0 and sum(traffic["bytes_d2h"]) > 0  # blocks really went both ways


def test_the_mapping_probe_tells_a_view_of_the_bytes_from_anything_else():
    """`kernels_use_mapping` (what `probe_mapping` runs on CUDA, once): a view of the same bytes passes; a copy
    (a kernel's writes never reach the host) and other bytes fail, each with its reason. Bytes, not values: a
    NaN-filled float buffer under the view reads equal."""
    from tracer.transfer import kernels_use_mapping, mapped_view, probe_mapping

    host = torch.full((1024,), float("nan")).view(torch.uint8)  # NaN bit patterns: torch.equal on floats says no
    copy = kernels_use_mapping(host.clone(), host)
    assert not copy.mapped and "write" in copy.reason
    other = kernels_use_mapping(torch.zeros_like(host), host)
    assert not other.mapped and "read" in other.reason
    assert kernels_use_mapping(host, host).mapped
    assert probe_mapping(torch.device("cpu")).mapped and mapped_view(host, torch.device("cpu")) is host


def test_the_move_timer_times_each_stores_recalls_and_offloads_once_per_call():
    from tracer.transfer import MoveTimer, PinnedBlockStore

    store = PinnedBlockStore(HEADS, BLOCK, DIM, torch.float32, torch.device("cpu"))
    original = PinnedBlockStore.get_blocks
    with MoveTimer("cpu") as timer:
        moves(store, torch.Generator().manual_seed(2))
    assert PinnedBlockStore.get_blocks is original  # unwrapped on exit
    times = timer.us(store)
    # per round: one put; get_blocks twice, get_into, get_pages_into (`get` inside none of them: once per call)
    assert len(times["offload"]) == 5 and len(times["recall"]) == 4 * 5
    assert all(us > 0 for calls in times.values() for us in calls)
    assert timer.us(object()) == {"recall": [], "offload": []}
