"""Batched decoding equals sequential decoding: every sample of a batch (B in {2, 5, 8}, prompts of different
lengths, samples stopping at different steps, continuous refill of freed rows) gets the logits, tokens and
recorded placement rows of its batch-1 run, for full, evict and hierarchy (recall, per-head recall, promote,
an int8 DDR tier with its per-row quantization error, a recall buffer, the speculative rules)."""

from __future__ import annotations

import pytest
import torch
from _helpers import (
    TINY_CONFIGS,
    TINY_SHAPES,
    has_committed_part,
    kill_if_running,
    start_thoughtkv,
    wait_while_running,
)
from transformers import AutoModelForCausalLM

import tracer.attention  # noqa: F401  (registers the "thoughtkv" attention function)
from tracer.cache import TieredCache, TierSettings
from tracer.decode import DecodeJob, decode_batch, greedy_decode
from tracer.recorder import Recorder
from tracer.scorers import build_scorer
from traces.policy import PolicySpec

SHAPES, CONFIGS = TINY_SHAPES, TINY_CONFIGS
PROMPT_LENGTHS = [7, 31, 12, 45, 20, 9, 38, 16, 26]
MAX_NEW = 40
POLICIES = {
    "full": dict(policy="full"),
    "evict": dict(policy="evict", hbm_budget=0.4, scorer="h2o"),
    "hierarchy": dict(policy="hierarchy", hbm_budget=0.3, evict_ratio=0.1, recall_k=2),
    "per-head-promote": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="quest-per-head", promote=True),
    "hierarchy-int8": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2, ddr_dtype="int8"),
    "oracle": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="oracle"),
    "score": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="score"),
    "buffer": dict(policy="hierarchy", hbm_budget=0.3, recall_k=3, recall_buffer_blocks=4),
    # speculative: from the previous layer's input (each row's own hidden state) and the previous step's query
    "prev-layer": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="prev-layer"),
    "prev-layer-per-head": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="prev-layer-per-head"),
    "prev-step": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="prev-step"),
}
RECORDED = ("step", "layer", "logical_len", "hbm_tokens", "ddr_tokens", "recalled_block_ids", "offloaded_block_ids",
            "evicted_block_ids", "promoted_block_ids", "bytes_h2d", "bytes_d2h")
# A recall buffer's hits and misses, and the HBM its capacity adds (null without one).
BUFFER = ("recall_hits", "recall_misses", "hbm_kv_bytes")
# The quantization error of the int8 tier: present on the same rows, equal to rounding (the K/V it measures come
# out of batched matrix products, which sum in another order).
QUANT = ("quant_max_rel_err", "quant_rms_rel_err")


def tiny_model(arch: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[arch](), attn_implementation="thoughtkv", dtype=torch.float32).eval()


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def settings(policy: str) -> TierSettings:
    spec = PolicySpec(**POLICIES[policy], block_size=4, sink_tokens=4, window_tokens=8)
    return TierSettings(spec=spec, scorer=build_scorer(spec.scorer), track_importance=True)


def run(model, policy: str, batch_size: int, eos_ids: set[int]) -> dict[int, tuple]:
    """sample index -> (tokens, stop reason, stacked logits, recorded rows, final tiers of layer 1)."""
    jobs = [DecodeJob(i, ids, settings(policy), Recorder()) for i, ids in enumerate(prompts())]
    cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
    out = {}
    for job, result in decode_batch(model, jobs, cache, batch_size, MAX_NEW, eos_ids, keep_logits=True):
        rows = {name: job.recorder.columns.get(name) for name in RECORDED + QUANT + BUFFER}
        out[job.key] = (result.generated_ids, result.stop_reason, torch.stack(result.logits), rows,
                        result.cache.layers[1].final_tiers().tolist())
    return out


def stopping_tokens(model) -> set[int]:
    """Two tokens the samples produce mid-run (chosen from an unstopped run): several samples stop early."""
    generated = [greedy_decode(model, ids, TieredCache(2, settings("full")), MAX_NEW, set()).generated_ids
                 for ids in prompts()[:2]]
    return {generated[0][5], generated[1][17]}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_batched_equals_sequential(arch, policy):
    model = tiny_model(arch)
    eos_ids = stopping_tokens(model)
    sequential = run(model, policy, 1, eos_ids)
    assert len(sequential) == len(PROMPT_LENGTHS)
    stops = {len(tokens) for tokens, *_ in sequential.values()}
    assert len(stops) >= 2  # samples stop at different steps: rows are refilled mid-batch
    if policy != "full":  # blocks really moved: the rows compared are not all empty
        moved = sum(len(ids) for *_, rows, _ in sequential.values() for ids in rows["offloaded_block_ids"] + rows["evicted_block_ids"])
        assert moved > 20
    if "int8" in policy:
        assert sum(v is not None for *_, rows, _ in sequential.values() for v in rows["quant_max_rel_err"]) > 20
    if policy == "buffer":  # the buffer served recalls and copied others: the counts compared are not all zero
        assert 0 < sum(sum(rows["recall_hits"]) for *_, rows, _ in sequential.values()) \
            < sum(sum(rows["recall_misses"]) for *_, rows, _ in sequential.values()) * 10
    for batch_size in (2, 5, 8):
        batched = run(model, policy, batch_size, eos_ids)
        for index, (tokens, stop, logits, rows, tiers) in sequential.items():
            got_tokens, got_stop, got_logits, got_rows, got_tiers = batched[index]
            assert got_tokens == tokens and got_stop == stop, (batch_size, index)
            assert (got_logits - logits).abs().max().item() <= 1e-4
            assert all(got_rows[name] == rows[name] for name in RECORDED + BUFFER) and got_tiers == tiers
            for name in QUANT:
                assert [v is None for v in got_rows[name]] == [v is None for v in rows[name]]
                present = [(got, want) for got, want in zip(got_rows[name], rows[name], strict=True) if want is not None]
                assert all(got == pytest.approx(want, rel=1e-3) for got, want in present)


def test_decode_batch_at_one_equals_greedy_decode():
    model = tiny_model("llama")
    ids = prompts()[3]
    recorder = Recorder()
    reference = greedy_decode(model, ids, TieredCache(2, settings("hierarchy"), recorder), MAX_NEW, set(), recorder)
    job = DecodeJob(0, ids, settings("hierarchy"), Recorder())
    [(_, result)] = list(decode_batch(model, [job], TieredCache(2, job.settings), 1, MAX_NEW, set()))
    assert result.generated_ids == reference.generated_ids
    assert job.recorder.columns["recalled_block_ids"] == recorder.columns["recalled_block_ids"]


def test_layer_times_are_recorded_per_step_and_layer():
    model = tiny_model("qwen2")
    job = DecodeJob(0, prompts()[1], settings("hierarchy"), Recorder())
    list(decode_batch(model, [job], TieredCache(2, job.settings), 1, 6, set()))
    table = job.recorder.steps_table()
    assert len(table["measured_layer_us"]) == 12  # 6 steps x 2 layers
    for step_us, layer_us in zip(table["measured_step_us"], table["measured_layer_us"], strict=True):
        assert 0 < layer_us < step_us  # each layer is part of its step
    # The timer wraps each layer's forward for the decode only: the model is left as it was.
    assert all("forward" not in vars(layer) for layer in model.model.layers)


@pytest.mark.parametrize("rule", ["quest", "quest-per-head"])
def test_the_deferred_work_of_layers_placed_together_is_timed_apart(rule):
    """A decode step whose layers are scored, recorded and placed together (quest, H2O) runs that work inside its
    last layer's forward: `measured_deferred_us` holds it on that layer's row (part of its layer time) and 0 on
    the others. Under the per-head rule each layer places after its own attention: nothing is deferred."""
    model = tiny_model("qwen2")
    spec = PolicySpec(policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule=rule, block_size=4, sink_tokens=4,
                      window_tokens=8)
    job = DecodeJob(0, prompts()[3], TierSettings(spec=spec, scorer=build_scorer("h2o")), Recorder())
    list(decode_batch(model, [job], TieredCache(2, job.settings), 1, 8, set()))
    table = job.recorder.steps_table()
    rows = list(zip(table["step"], table["layer"], table["measured_layer_us"], table["measured_deferred_us"],
                    strict=True))
    assert len(rows) == 16  # 8 steps x 2 layers
    for step, layer, layer_us, deferred_us in rows:
        if rule == "quest" and step > 0 and layer == 1:  # a decode step's last layer ran every layer's work
            assert 0 < deferred_us < layer_us
        else:
            assert deferred_us == 0.0


def test_nested_layer_timers_time_each_layer_and_leave_the_model_as_it_was():
    from tracer.decode import LayerTimer

    model = tiny_model("qwen2")
    first, second = LayerTimer(model), LayerTimer(model)  # the second wraps the first
    with torch.inference_mode():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    inner_us, outer_us = first.read_us(), second.read_us()
    assert all(0 < a <= b for a, b in zip(inner_us, outer_us, strict=True)) and len(inner_us) == 2
    first.close()  # beneath the second: it passes through until the second is closed, then goes with it
    assert all("forward" in vars(layer) for layer in model.model.layers)
    second.close()
    assert all("forward" not in vars(layer) for layer in model.model.layers)
    assert first.read_us() is None and second.read_us() is None


def test_kv_buffers_are_sized_from_the_policy_and_a_batch_that_cannot_fit_is_refused(tmp_path):
    from thoughtkv_base import UserError
    from tracer.models import load_model
    from tracer.run import GROWTH_SLACK, TraceConfig, check_kv_fits, kv_buffer_bytes

    full = PolicySpec(policy="full", block_size=16)
    need = kv_buffer_bytes(full, 1000, 4, 100, 60)  # full: every token of the longest sample, per sample
    assert need["hbm"] == 4 * GROWTH_SLACK * 160 * 1000 and need["ddr"] == 0
    hierarchy = PolicySpec(policy="hierarchy", hbm_budget=0.25, block_size=16, sink_tokens=16, window_tokens=32, recall_k=2)
    # A 1,000-token prompt sits in HBM whole at prefill: more than the decode peak (at 2,000 tokens: 125 blocks,
    # 122 movable, room for 28 of them -> 31 kept + 1 opening = 512 tokens); plus 2 staging blocks.
    need = kv_buffer_bytes(hierarchy, 1000, 1, 1000, 1000)
    assert need["hbm"] == GROWTH_SLACK * (1000 + 2 * 16) * 1000
    assert need["ddr"] == GROWTH_SLACK * 125 * 16 * 1000
    # A 100-token prompt decoded to 4,000: the peak is at 3,990 tokens (250 blocks, 246 movable, 54 protected
    # tokens, room (998 - 54) // 16 = 59 -> 63 kept + 1 opening = 1,024 tokens), plus the staging blocks.
    assert kv_buffer_bytes(hierarchy, 1000, 1, 100, 3900)["hbm"] == GROWTH_SLACK * (1024 + 2 * 16) * 1000
    loaded = load_model("random:tiny", "cpu", "float32")
    config = TraceConfig(model="random:tiny", task="chains", out=str(tmp_path / "run"), batch_size=10**7,
                         max_new_tokens=4096)
    with pytest.raises(UserError, match="--batch-size 10000000: the KV buffers need"):
        check_kv_fits(config, loaded, [300])
    config.batch_size = 2
    assert check_kv_fits(config, loaded, [300])["hbm"] > 0


def test_a_killed_batched_run_resumes_with_nothing_lost_or_doubled(tmp_path):
    """`trace --batch-size 4` killed after its first committed sample, resumed at --batch-size 3: every sample
    once, the committed ones untouched, and every sample's text and trace rows equal to a batch-1 run's."""
    from pathlib import Path

    from thoughtkv.cli import main
    from traces import open_run

    repo = Path(__file__).resolve().parents[1]
    common = ["--model", "micro", "--task", "chains", "--n-samples", "8", "--policy", "hierarchy", "--hbm-budget",
              "0.3", "--block-size", "4", "--window-tokens", "16", "--recall-k", "6", "--max-new-tokens", "60", "--quiet"]
    out = tmp_path / "batched"
    process = start_thoughtkv(["trace", *common, "--batch-size", "4", "--out", str(out)], repo)
    parts = out / "samples.parquet"
    wait_while_running(process, lambda: has_committed_part(parts), timeout_s=300, poll_s=0.02)
    killed = kill_if_running(process)
    before = {p.name: p.read_bytes() for p in parts.iterdir() if p.suffix == ".parquet"}
    assert before, process.stderr.read().decode()[-2000:]
    assert killed and len(before) < 8  # it really died mid-run

    assert main(["trace", *common, "--batch-size", "3", "--out", str(out)]) == 0
    assert main(["trace", *common, "--batch-size", "1", "--out", str(tmp_path / "sequential")]) == 0
    for name, data in before.items():  # committed samples were skipped, not rewritten
        assert (parts / name).read_bytes() == data
    batched, sequential = open_run(out), open_run(tmp_path / "sequential")
    batched.validate()
    got, want = (run.samples().set_index("sample_id").sort_index() for run in (batched, sequential))
    assert list(got.index) == list(want.index) and len(got) == 8
    assert got.generated_text.tolist() == want.generated_text.tolist()
    columns = ["sample_id", "step", "layer", "hbm_tokens", "ddr_tokens", "bytes_h2d", "bytes_d2h", "mass_ddr"]
    got_steps, want_steps = (run.steps()[columns].sort_values(columns[:3]).reset_index(drop=True)
                             for run in (batched, sequential))
    assert not got_steps.duplicated(columns[:3]).any()
    assert got_steps[columns[:-1]].equals(want_steps[columns[:-1]])
    # Masses are floats of a batched GEMM (another summation order than batch 1's): equal to rounding.
    assert (got_steps.mass_ddr - want_steps.mass_ddr).abs().max() < 1e-5


@pytest.mark.parametrize("policy", [dict(policy="full"), dict(policy="evict", hbm_budget=0.3),
                                    dict(policy="hierarchy", hbm_budget=0.3)], ids=["full", "evict", "hierarchy"])
def test_micro_chains_at_batch_eight_are_token_identical_to_batch_one(tmp_path, policy):
    """The bundled micro model through `run_trace` (the 200-sample, B = 16 version is
    tests/bench/batched_micro.py): the same texts, the same accuracy, the same recorded traffic."""
    from tracer.run import TraceConfig, run_trace
    from traces import open_run

    def trace(batch_size: int):
        config = TraceConfig(model="micro", task="chains", out=str(tmp_path / f"b{batch_size}"), n_samples=12,
                             batch_size=batch_size, max_new_tokens=48, block_size=4, window_tokens=8, device="cpu",
                             access=False, **policy)
        return open_run(run_trace(config, progress=False))

    one, eight = trace(1), trace(8)
    a, b = one.samples().set_index("sample_id"), eight.samples().set_index("sample_id")
    assert a.index.equals(b.index) and (a["generated_text"] == b.loc[a.index, "generated_text"]).all()
    assert a["correct"].sum() == b["correct"].sum()
    columns = ["sample_id", "step", "layer", "hbm_tokens", "recalled_block_ids", "offloaded_block_ids", "bytes_h2d"]
    key = ["sample_id", "step", "layer"]
    first = one.steps(columns=columns).sort_values(key).reset_index(drop=True)
    second = eight.steps(columns=columns).sort_values(key).reset_index(drop=True)
    assert first.equals(second)
    if policy["policy"] == "hierarchy":
        assert first["bytes_h2d"].sum() > 0  # it recalled: the traffic compared is not all zero


@pytest.mark.parametrize("scorer", ["snapkv", "h2o"])
def test_a_left_padded_prefill_scores_each_row_as_it_would_alone(scorer):
    """Fresh rows are prefilled in one left-padded forward: each row's scores after it (what placement ranks)
    equal its own prefill's, so the pads' queries reach no scorer (snapkv averages the last 32 queries, which
    for these prompts would include pads)."""
    model = tiny_model("qwen2")
    spec = PolicySpec(policy="hierarchy", hbm_budget=0.3, recall_k=2, block_size=4, sink_tokens=4, window_tokens=8,
                      scorer=scorer)

    def scores(batch_size: int) -> dict[int, list[torch.Tensor]]:
        jobs = [DecodeJob(i, ids, TierSettings(spec=spec, scorer=build_scorer(scorer)), Recorder())
                for i, ids in enumerate(prompts()[:4])]
        cache, out = TieredCache(model.config.num_hidden_layers, jobs[0].settings), {}
        for job, result in decode_batch(model, jobs, cache, batch_size, 1, set()):
            n = len(job.prompt_ids)
            out[job.key] = [layer.token_scores[:n].clone() for layer in result.cache.layers]
        return out

    alone, together = scores(1), scores(4)
    for key, layers in alone.items():
        for want, got in zip(layers, together[key], strict=True):
            assert want.abs().sum() > 0
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_decode_runs_under_inference_mode_unless_its_scorer_runs_autograd():
    """tracer.decode.decode_grad_mode: inference_mode (cheaper eager ops) for attention scorers; no_grad for the
    gradient scorer, whose backward pass cannot save inference tensors; a batch mixing the two is refused."""
    import dataclasses

    from tracer.cache import UnsupportedBatch

    model = tiny_model("qwen2")
    plain = settings("hierarchy")
    gradient = dataclasses.replace(plain, scorer=build_scorer("gradient"))
    for tier_settings, inference in ((plain, True), (gradient, False)):
        job = DecodeJob(0, prompts()[0], tier_settings, Recorder())
        cache = TieredCache(2, job.settings)
        [(_, result)] = list(decode_batch(model, [job], cache, 1, 4, set()))
        assert len(result.generated_ids) == 4
        assert cache.paged[0].keys.is_inference() is inference
    mixed = [DecodeJob(i, prompts()[i], s, Recorder()) for i, s in enumerate((plain, gradient))]
    with pytest.raises(UnsupportedBatch, match="runs autograd"):
        list(decode_batch(model, mixed, TieredCache(2, plain), 2, 4, set()))


def test_calibration_decoders_on_one_model_share_one_layer_timer():
    """`token_cost_sweep` makes a decoder per prompt on one model: their layer timers must not stack (each later
    prompt would pay the earlier ones' wrappers, biasing the per-token slope)."""
    from tracer.calibrate.tiered import tiered_decoder_factory

    model = tiny_model("qwen2")
    make_decoder = tiered_decoder_factory("hierarchy")
    for prompt in (8, 12):
        step = make_decoder(model, torch.arange(prompt)[None] % 320)
        step()
    wrappers = [vars(layer)["forward"] for layer in model.model.layers]
    assert all(getattr(w, "timer", None) is not None for w in wrappers)  # timed...
    assert all(getattr(w.unwrapped, "timer", None) is None for w in wrappers)  # ...by one timer


@pytest.mark.parametrize("policy", ["hierarchy", "per-head-promote", "hierarchy-int8"])
def test_steps_resolved_together_record_what_each_step_alone_records(policy, monkeypatch):
    """The recorder resolves a sample's ended steps together (tracer.recorder.build_steps: steps of the same rows,
    layers, recall count and width as arrays with a step axis); resolving every step by itself with the general
    path (`StepRows._build_alone`) must record exactly the same columns and block masses."""
    import tracer.recorder as recorder_module

    model = tiny_model("qwen2")
    alone = []
    build_alone = recorder_module.StepRows._build_alone

    def counted(self):
        alone.append(self)
        build_alone(self)

    def tables(batch_size: int) -> dict:
        jobs = [DecodeJob(i, ids, settings(policy), Recorder()) for i, ids in enumerate(prompts())]
        cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
        out = {}
        for job, _ in decode_batch(model, jobs, cache, batch_size, MAX_NEW, set()):
            table = {name: column for name, column in job.recorder.steps_table().items()
                     if not name.startswith("measured_")}  # (timings: not the same twice)
            out[job.key] = (table, [m.tolist() for m in job.recorder.block_mass])
        return out

    monkeypatch.setattr(recorder_module.StepRows, "_build_alone", counted)
    together = tables(5)
    steps = sum(len(set(table["step"])) for table, _ in together.values())
    if policy != "per-head-promote":  # (its recall counts differ by row and layer: those steps go alone)
        assert len(alone) < steps / 5, "the usual steps were not resolved together"

    def each_alone(steps):
        for step in dict.fromkeys(steps):
            if not step.resolved:
                build_alone(step)

    monkeypatch.setattr(recorder_module, "build_steps", each_alone)
    assert tables(5) == together


@pytest.mark.parametrize("policy", ["evict", "hierarchy-exact", "per-head-exact"])
def test_layers_sharing_a_forwards_host_plans_decode_as_layers_making_their_own(policy, monkeypatch):
    """Under a policy whose counts follow from the lengths, a decode step's first layer makes the host plans
    (append, recall, placement, recording: tracer.cache.PagedLayer.plan) and the other layers reuse them, and
    (H2O, the quest rule) every layer is scored, recorded and placed together after the last one has attended
    (tracer.cache.step.after_attention_of_layers). Each layer making its own plans, and each layer scoring and
    placing after its own attention, must give the same logits, tokens, recorded rows and tiers, at B = 5 with
    refill."""
    import tracer.cache.layer as cache_module
    import tracer.cache.step as step_module

    specs = {"evict": POLICIES["evict"], "hierarchy-exact": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2),
             "per-head-exact": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="quest-per-head")}
    monkeypatch.setitem(POLICIES, policy, specs[policy])
    model = tiny_model("qwen2")
    made, together = [], []
    shared_plan, of_layers = cache_module.PagedLayer.plan, step_module.after_attention_of_layers

    def counting(self, name, n_new, make, reads_recall=False):
        return shared_plan(self, name, n_new, lambda: made.append(name) or make(), reads_recall)

    monkeypatch.setattr(cache_module.PagedLayer, "plan", counting)
    monkeypatch.setattr(step_module, "after_attention_of_layers", lambda entries: together.append(1) or of_layers(entries))
    shared = decoded_in_full(model, policy)
    layers = model.config.num_hidden_layers
    decode_steps = sum(len(out[0]) - 1 for out in shared.values()) / 5  # about: rows share steps
    assert made.count("recall") < 0.75 * layers * decode_steps, "the layers did not share the recall plan"
    if policy != "per-head-exact":  # (its recall counts differ by layer: each layer places after its attention)
        assert len(together) > 0.5 * decode_steps, "the layers were not scored and placed together"
    assert_decoded_as_layers_alone(model, policy, shared, monkeypatch)


@pytest.mark.parametrize("policy", ["hierarchy", "promote", "per-head-promote"])
def test_layers_share_plans_on_the_steps_their_data_dependent_counts_leave_alike(policy, monkeypatch):
    """Eviction into a DDR tier (a victim may be an HBM or a DDR block) and promotion leave each layer's tier
    counts data-dependent: the layers share a decode step's host plans, and are scored and placed together,
    only on a step that begins with every layer's counts alike (tracer.cache.layer.counts_alike), and each
    layer's placement reads back its own. Under eviction both kinds of step occur here; either way the decode
    must equal each layer making its own plans after its own attention: logits, tokens, recorded rows, masses,
    scores and tiers."""
    import tracer.cache.hf as hf_module

    specs = {"hierarchy": POLICIES["hierarchy"], "per-head-promote": POLICIES["per-head-promote"],
             "promote": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2, promote=True)}
    monkeypatch.setitem(POLICIES, policy, specs[policy])
    model = tiny_model("qwen2")
    checked, check = [], hf_module.counts_alike
    monkeypatch.setattr(hf_module, "counts_alike", lambda layers, rows: checked.append(check(layers, rows)) or checked[-1])
    shared = decoded_in_full(model, policy)
    assert checked.count(True) > checked.count(False), "the layers' counts were unlike at most steps"
    if policy == "hierarchy":  # (promotion keeps HBM at its room, and so the counts alike, while it has candidates)
        assert checked.count(False) > 0, "the layers' counts were never unlike: the test checks one kind of step"
    assert_decoded_as_layers_alone(model, policy, shared, monkeypatch)


def decoded_in_full(model, policy: str) -> dict:
    """sample key -> (tokens, stop reason, stacked logits, recorded rows, block masses, every layer's token scores /
    importance / max importance, final tiers of layer 1), at B = 5 with refill."""
    jobs = [DecodeJob(i, ids, settings(policy), Recorder()) for i, ids in enumerate(prompts())]
    cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
    out = {}
    for job, result in decode_batch(model, jobs, cache, 5, MAX_NEW, set(), keep_logits=True):
        table = {name: column for name, column in job.recorder.steps_table().items()
                 if not name.startswith("measured_")}  # (timings: not the same twice)
        scores = [[getattr(layer, name)[: layer.logical_len + 1].tolist() for name in ("token_scores", "importance",
                   "importance_max")] for layer in result.cache.layers]  # (read before the row is refilled)
        out[job.key] = (result.generated_ids, result.stop_reason, torch.stack(result.logits), table,
                        [m.tolist() for m in job.recorder.block_mass], scores,
                        result.cache.layers[1].final_tiers().tolist())
    return out


def assert_decoded_as_layers_alone(model, policy: str, shared: dict, monkeypatch) -> None:
    """`shared` (`decoded_in_full`) equals the decode in which each layer makes its own plans and scores and places
    after its own attention."""
    import tracer.cache.layer as cache_module

    monkeypatch.setattr(cache_module.PagedLayer, "plan", lambda self, name, n_new, make, reads_recall=False: make())
    monkeypatch.setattr(cache_module.PagedLayer, "layers_alike", lambda self, rows, states: False)
    alone = decoded_in_full(model, policy)
    assert shared.keys() == alone.keys()
    for key, (tokens, stop, logits, *recorded) in shared.items():
        assert [tokens, stop, *recorded] == [*alone[key][:2], *alone[key][3:]]  # rows, block masses, scores, tiers
        torch.testing.assert_close(logits, alone[key][2], rtol=0, atol=0)


def test_a_batch_of_recorded_and_unrecorded_samples_decodes_each_as_it_would_alone():
    """Samples without a recorder (or importance tracking) share a batch with recorded ones: each gets its batch-1
    tokens and logits, and the recorded ones their batch-1 rows (every batch entry's attention is scattered into
    the step's block masses, so their width covers the unrecorded rows too)."""
    model = tiny_model("qwen2")
    spec = PolicySpec(**POLICIES["hierarchy"], block_size=4, sink_tokens=4, window_tokens=8)

    def decoded(batch_size: int) -> dict:
        jobs = [DecodeJob(i, ids, TierSettings(spec=spec, scorer=build_scorer(spec.scorer), track_importance=i % 2 == 0),
                          Recorder() if i % 3 else None) for i, ids in enumerate(prompts())]
        cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
        out = {}
        for job, result in decode_batch(model, jobs, cache, batch_size, MAX_NEW, set(), keep_logits=True):
            rows = None if job.recorder is None else {name: job.recorder.columns[name] for name in RECORDED + ("mass_hbm",)}
            out[job.key] = (result.generated_ids, torch.stack(result.logits), rows)
        return out

    alone, together = decoded(1), decoded(4)
    assert sum(rows is None for *_, rows in alone.values()) == 3
    for key, (tokens, logits, rows) in alone.items():
        got_tokens, got_logits, got_rows = together[key]
        assert got_tokens == tokens and (got_logits - logits).abs().max().item() <= 1e-4
        if rows is None:
            assert got_rows is None
            continue
        assert all(got_rows[name] == rows[name] for name in RECORDED)
        # (the masses come out of batched matrix products, which sum in another order)
        assert got_rows["mass_hbm"] == pytest.approx(rows["mass_hbm"], rel=1e-5)


@pytest.mark.parametrize("policy", ["full", "hierarchy", "per-head-promote"])
def test_pools_are_sized_once_at_the_policys_peak(policy, monkeypatch):
    """`decode_batch` names each admitted sample's prompt and longest length (`TieredCache.reserve_length`): the
    page pools are allocated once, at `traces.policy.peak_hbm_tokens` and `max_recall_blocks`, and never grow
    or shift during the run (each growth copied the pool), while the most pages a row actually held in it
    (resident blocks, plus the block a token opens, before placement) come within a block of that peak: it is
    not oversized."""
    from tracer.cache import PagedLayer
    from traces.policy import max_recall_blocks, peak_hbm_tokens

    model = tiny_model("qwen2")
    sizes, held = [], []
    resize, update = PagedLayer.resize_pages, PagedLayer.update

    def recording_resize(layer, *args, **kwargs):
        before = (layer.n_pages, layer.n_staging_pages)
        resize(layer, *args, **kwargs)
        if (layer.n_pages, layer.n_staging_pages) != before:
            sizes.append((layer.n_pages, layer.n_staging_pages))

    def recording_update(layer, rows, key_states, *args, **kwargs):
        update(layer, rows, key_states, *args, **kwargs)
        held.append(max(layer.rows[r].hbm_blocks() for r in rows))

    monkeypatch.setattr(PagedLayer, "resize_pages", recording_resize)
    monkeypatch.setattr(PagedLayer, "update", recording_update)
    sample_prompts = prompts()
    jobs = [DecodeJob(i, p, settings(policy), Recorder()) for i, p in enumerate(sample_prompts)]
    cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
    for _ in decode_batch(model, jobs, cache, 4, MAX_NEW, set()):
        pass
    spec, longest = jobs[0].settings.spec, max(map(len, sample_prompts))
    pages = -(-peak_hbm_tokens(spec, longest, longest + MAX_NEW) // spec.block_size)
    staging = max_recall_blocks(spec, longest + MAX_NEW, model.config.num_key_value_heads)
    assert set(sizes) == {(pages, staging)}  # each layer sized once, so
    assert len(sizes) == model.config.num_hidden_layers
    # (within a block: the sequence's last token is generated, never appended, and the peak rule counts it)
    assert pages - 1 <= max(held) <= pages


@pytest.mark.parametrize("scorer", ["h2o", "snapkv"])
def test_prompts_of_one_length_are_prefilled_and_scored_together_as_each_alone(scorer, monkeypatch):
    """Fresh rows whose prompts have one length are prefilled unpadded: one query start, and one scorer call
    per layer for all of them (snapkv reads each row's last queries), giving each sample the logits, tokens and
    recorded rows of its batch-1 run."""
    model = tiny_model("mistral")
    generator = torch.Generator().manual_seed(11)
    same_length = [torch.randint(3, 320, (24,), generator=generator).tolist() for _ in range(4)]

    def run_at(batch_size: int) -> dict:
        spec = PolicySpec(**{**POLICIES["hierarchy"], "scorer": scorer}, block_size=4, sink_tokens=4, window_tokens=8)
        jobs = [DecodeJob(i, ids, TierSettings(spec=spec, scorer=build_scorer(scorer)), Recorder())
                for i, ids in enumerate(same_length)]
        cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
        return {job.key: (result.generated_ids, torch.stack(result.logits),
                          {name: job.recorder.columns[name] for name in RECORDED})
                for job, result in decode_batch(model, jobs, cache, batch_size, 12, set(), keep_logits=True)}

    sequential = run_at(1)
    calls = []
    score = type(build_scorer(scorer)).score
    monkeypatch.setattr(type(build_scorer(scorer)), "score",
                        lambda self, obs, previous: calls.append(obs.weights_mean.shape[:2]) or score(self, obs, previous))
    together = run_at(4)
    assert calls[: model.config.num_hidden_layers] == [(4, 24)] * model.config.num_hidden_layers  # the prefill
    for key, (tokens, logits, rows) in sequential.items():
        assert together[key][0] == tokens and together[key][2] == rows
        assert (together[key][1] - logits).abs().max().item() <= 1e-4
