"""Host synchronisations per decode step (tracer.decode.HostSyncCounter): operations that make the host wait
for the device (item/int/bool of a tensor, nonzero, boolean-mask indexing, tolist/numpy, device->host copies, blocking
host->device copies).

The decode loop's cost is one per step: the next tokens and their finiteness, copied once together with every
layer's recorded rows, including which blocks moved. The tiered cache adds nothing in a hierarchy or evict
step (its paged pool is sized from host-known counts; the DDR gather and scatter take device-side ids), except
where a count is data-dependent: one read-back per layer that places (eviction into a DDR tier, promote) or
recalls (the per-head rule's union).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2Config

import tracer.attention  # noqa: F401  (registers the "thoughtkv" attention function)
from tracer.cache import TieredCache, TierSettings, indexing
from tracer.decode import DecodeJob, HostSyncCounter, decode_batch
from tracer.recorder import Recorder
from tracer.scorers import build_scorer
from tracer.transfer import host_to_device
from traces.policy import PolicySpec

SHAPES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


def syncs_per_step(spec: PolicySpec, batch_size: int, record: bool, steps: int = 24) -> tuple[float, dict]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES), attn_implementation="thoughtkv", dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(2)
    jobs = [DecodeJob(i, torch.randint(3, 320, (30 + 7 * i,), generator=generator).tolist(),
                      TierSettings(spec=spec, scorer=build_scorer("h2o")), Recorder() if record else None)
            for i in range(batch_size)]
    forwards = [0]
    handle = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        with HostSyncCounter() as counter:
            list(decode_batch(model, jobs, TieredCache(2, jobs[0].settings), batch_size, steps, set()))
    finally:
        handle.remove()
    if record and spec.policy != "full":  # the steps counted did move blocks (what makes them a test)
        columns = [job.recorder.steps_table() for job in jobs]
        moved = sum(len(ids) for table in columns for name in ("offloaded_block_ids", "evicted_block_ids")
                    for ids in table[name])
        recalled = sum(len(ids) for table in columns for ids in table["recalled_block_ids"])
        assert moved > 2 * batch_size and (recalled > 2 * batch_size or not spec.uses_ddr), (moved, recalled)
    return counter.count / forwards[0], counter.by_op


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_the_counter_sees_every_kind_of_host_wait(grad_mode):
    """Under both modes a decode may run in (tracer.decode.decode_grad_mode): inference_mode shows a dispatch mode
    composite ops (`item`, `is_nonzero`, `where(cond)`) undecomposed."""
    x = torch.arange(10)
    with grad_mode(), HostSyncCounter() as counter:
        int(x.sum()), (x > 3).nonzero(), x[x > 2], x.tolist(), x.numpy(), x + 1, x[torch.tensor([1, 2])]
        bool((x > 3).any()), x[0].item(), torch.where(x > 5)
        torch.arange(3).cpu().numpy()  # a fetch, then reading what it fetched: one wait
        # Uploads: blocking ones from pageable memory (on CUDA each waits for the stream), then the free ones.
        torch.tensor([1, 2], device="cpu"), torch.as_tensor([3], device=x.device), x.to(x.device)
        host_to_device([1, 2], x.device), x.to(torch.float64), x.to(x.device, non_blocking=True)
    assert counter.by_op == {"aten._local_scalar_dense": 3, "aten.nonzero": 2, "boolean-mask index": 1,
                             "Tensor.tolist": 1, "Tensor.numpy": 1, "Tensor.cpu": 1,
                             "blocking host->device copy": 3}


@pytest.mark.parametrize("record", [False, True])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_the_decode_loop_and_its_recording_cost_one_sync_per_step(batch_size, record):
    """Full policy: the cache moves nothing, so what is counted is the loop's next tokens and (recording on)
    every layer's and row's recorded rows, fetched in that same one copy."""
    per_step, by_op = syncs_per_step(PolicySpec(policy="full", block_size=4), batch_size, record=record)
    assert per_step == 1, by_op


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("spec", [
    PolicySpec(policy="hierarchy", hbm_budget=0.3, block_size=4, sink_tokens=4, window_tokens=8, recall_k=2),
    PolicySpec(policy="hierarchy", hbm_budget=0.3, block_size=4, sink_tokens=4, window_tokens=8, recall_k=2,
               ddr_dtype="int8"),
    PolicySpec(policy="evict", hbm_budget=0.3, block_size=4, sink_tokens=4, window_tokens=8),
    PolicySpec(policy="hierarchy", hbm_budget=0.3, block_size=4, sink_tokens=4, window_tokens=8, recall_k=2,
               recall_rule="score"),  # the prefetchable rule: decided on the device from earlier steps' scores
    # speculative: from the previous layer's input (caught by a pre-hook) and the previous step's query
    PolicySpec(policy="hierarchy", hbm_budget=0.3, block_size=4, sink_tokens=4, window_tokens=8, recall_k=2,
               recall_rule="prev-layer"),
    PolicySpec(policy="hierarchy", hbm_budget=0.3, block_size=4, sink_tokens=4, window_tokens=8, recall_k=2,
               recall_rule="prev-step"),
], ids=["hierarchy", "hierarchy-int8", "evict", "hierarchy-score", "hierarchy-prev-layer", "hierarchy-prev-step"])
def test_a_tiered_step_costs_one_sync(spec, batch_size):
    """Offloads, recalls and evictions every few steps (block 4, 30% HBM), recorded: still the one copy."""
    per_step, by_op = syncs_per_step(spec, batch_size, record=True)
    print(f"{spec.policy} B={batch_size}: {per_step:.2f} host syncs per step: {by_op}")
    assert per_step == 1, by_op


@pytest.mark.parametrize("extra, per_layer", [
    (dict(evict_ratio=0.2), "placement"),  # eviction may take a DDR or an HBM block: the counts are read back
    (dict(promote=True), "placement"),
    (dict(recall_rule="quest-per-head"), "recall"),  # the union's size
    (dict(recall_rule="prev-layer-per-head"), "recall"),
    (dict(recall_buffer_blocks=4), "recall"),  # the recalled ids, for the buffer's hits
])
def test_data_dependent_counts_cost_one_read_per_layer_and_no_more(extra, per_layer):
    """The documented exceptions (docs/design/tracer.md, "Sync-free steps"): one read-back per layer that places (or recalls), never
    more, so a step costs at most 1 + layers x (placing + recalling) syncs."""
    spec = PolicySpec(policy="hierarchy", hbm_budget=0.3, block_size=4, sink_tokens=4, window_tokens=8, recall_k=2,
                      **extra)
    per_step, by_op = syncs_per_step(spec, 1, record=True)
    bound = 1 + SHAPES["num_hidden_layers"]
    print(f"{extra}: {per_step:.2f} host syncs per step ({per_layer}): {by_op}")
    assert 1 < per_step <= bound, by_op


def test_a_buffer_read_from_hbm_costs_the_same_one_read_per_layer(monkeypatch):
    """The GPU's recall with a buffer (hits from its HBM region: `tracer.cache.recall.stage_from_buffer`), forced
    on the CPU: its read-back of the chosen ids is the one a buffer costs per layer, nothing more."""
    from tracer.cache import recall

    monkeypatch.setattr(recall, "hits_from_hbm", lambda layer: True)
    spec = PolicySpec(policy="hierarchy", hbm_budget=0.3, block_size=4, sink_tokens=4, window_tokens=8, recall_k=2,
                      recall_buffer_blocks=4)
    per_step, by_op = syncs_per_step(spec, 4, record=True)
    assert 1 < per_step <= 1 + SHAPES["num_hidden_layers"], by_op


class _Uploads(TorchDispatchMode):
    """Counts the tensors made from Python lists or arrays (`aten.lift_fresh` of one or more dimensions; a Python
    scalar written into a tensor is made a 0-dim one, filled on the device): an index built by
    `tracer.cache.indexing.device_index`, or a tensor indexed with a Python list (which, on CUDA, copies the list
    from pageable memory inside the op: a blocking upload)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default and args[0].dim() > 0:
            self.n += 1
        return func(*args, **(kwargs or {}))


def uploads_per_decode_step(model, n_layers: int) -> list[int]:
    """The index tensors built from host data in each decode step of a mixed-length batch (the prompts differ in
    length, so at a step some rows open a block and others not, some recall and others not, some recall fewer
    blocks, some add to their importance), under the default hierarchy."""
    spec = PolicySpec(policy="hierarchy", hbm_budget=0.3, block_size=4, sink_tokens=4, window_tokens=8, recall_k=2)
    generator = torch.Generator().manual_seed(2)
    jobs = [DecodeJob(i, torch.randint(3, 320, (13 + 7 * i,), generator=generator).tolist(),
                      TierSettings(spec=spec, scorer=build_scorer("h2o"), track_importance=i % 2 == 0), Recorder())
            for i in range(5)]
    for kept in (indexing.cached_device_index, indexing.flat_selection_index, indexing.staging_pages):
        kept.cache_clear()  # (the indices kept per distinct value: built anew for each run compared)
    counter, per_step = _Uploads(), []

    def begin(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:  # a decode step (the prefill's uploads are per layer: its prompts)
            per_step.append(counter.n)

    handle = model.register_forward_pre_hook(begin, with_kwargs=True)
    try:
        with counter:
            list(decode_batch(model, jobs, TieredCache(n_layers, jobs[0].settings), 5, 24, set()))
    finally:
        handle.remove()
    per_step.append(counter.n)
    assert all(len(job.recorder.steps_table()["step"]) == 24 * n_layers for job in jobs)  # no early stop
    return [b - a for a, b in zip(per_step, per_step[1:])]


def test_a_mixed_length_step_builds_its_index_tensors_once_not_per_layer():
    """Every index a decode step builds from host-known values goes through `device_index` once per step (in the
    plans the layers share, or kept per distinct value), never per layer: a model with two more layers, which
    attend but add nothing to the residual (so the tokens, lengths and counts are the same), builds exactly as
    many per step. Indexing a device tensor with a Python list would add one per layer (and on CUDA block)."""
    torch.manual_seed(0)
    deep = AutoModelForCausalLM.from_config(Qwen2Config(**{**SHAPES, "num_hidden_layers": 4}),
                                            attn_implementation="thoughtkv", dtype=torch.float32).eval()
    shallow = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES), attn_implementation="thoughtkv",
                                               dtype=torch.float32).eval()
    shallow.load_state_dict(deep.state_dict(), strict=False)  # (layers 0 and 1, embeddings, norm, head)
    with torch.no_grad():
        for layer in deep.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    two, four = uploads_per_decode_step(shallow, 2), uploads_per_decode_step(deep, 4)
    print(f"index tensors built per decode step, 2 layers: {two}; 4 layers: {four}")
    assert len(two) == 23 and two == four
