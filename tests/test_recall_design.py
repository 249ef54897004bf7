"""The recall design space: the prefetch contract (a rule known before the layer runs reads nothing of the current
query, and the simulator's layer prefetch accepts exactly those rules), the recall buffer (an LRU of recalled
blocks: its hits and misses against a reference LRU written here, the tracer's accounting against the
simulator's replay, and attention unchanged by it). The oracle's picks against a dense softmax are
tests/test_cache_registries.py's; batched = sequential for every rule and the buffer is tests/test_batched.py's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_cache_registries import BLOCK, GROUP, HEAD_DIM, N_BLOCKS, N_KV_HEADS, registry_layer

from simulator.errors import SimulationError
from simulator.options import SimOptions
from simulator.recall_buffer import replay_buffer
from simulator.simulate import simulate_run
from tracer.cache.recall_rules import RECALL_RULES, RecallRequest
from tracer.cache.speculation import LayerInputs
from tracer.transfer import KeyBounds
from traces.policy import PREFETCHABLE_RECALL_RULES, TRACER_RECALL_RULES, PolicySpec, recall_is_prefetchable
from traces.recall_buffer import RecallBuffer, replay_hits


def test_each_tracer_rule_declares_the_prefetch_contract_of_the_policy():
    assert PREFETCHABLE_RECALL_RULES  # at least one rule can be prefetched
    for name in TRACER_RECALL_RULES:
        assert RECALL_RULES[name].uses_query == (not recall_is_prefetchable(name)), name


def speculation_inputs(rows: int, layer_idx: int = 1) -> LayerInputs:
    """What a speculative rule reads at layer `layer_idx` of a forward: a real Qwen2 decoder layer of the test's
    head shapes (its input norm, q_proj with bias, RoPE) and the hidden state that entered the layer before it."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    torch.manual_seed(4)
    config = Qwen2Config(hidden_size=24, intermediate_size=32, num_attention_heads=N_KV_HEADS * GROUP,
                         num_key_value_heads=N_KV_HEADS, head_dim=HEAD_DIM, num_hidden_layers=layer_idx + 1)
    inputs = LayerInputs()
    hidden = torch.randn(rows, 1, config.hidden_size, generator=torch.Generator().manual_seed(9))
    position_embeddings = Qwen2RotaryEmbedding(config)(hidden, torch.tensor([[37]] * rows))
    for index in range(layer_idx + 1):
        inputs.enter(index, Qwen2DecoderLayer(config, index).eval(), hidden if index == layer_idx - 1 else None,
                     position_embeddings)
    return inputs


def _choices(name: str, query: torch.Tensor) -> list[set[int]]:
    generator = torch.Generator().manual_seed(11)
    rows = 2
    keys = torch.randn(rows, N_BLOCKS, N_KV_HEADS, BLOCK, HEAD_DIM, generator=generator)
    in_ddr = [[1, 2, 4, 5, 7, 9, 10], [0, 3, 6, 8, 11]]
    bounds = KeyBounds(N_KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    bounds.reserve(rows, N_BLOCKS)
    bounds.put(torch.arange(rows).repeat_interleave(N_BLOCKS), torch.arange(N_BLOCKS).repeat(rows), keys.flatten(0, 1))
    mask = torch.zeros(rows, N_BLOCKS, dtype=torch.bool)
    for row, blocks in enumerate(in_ddr):
        mask[row, blocks] = True
    bounds.mark(torch.arange(rows), mask)
    layer = registry_layer(keys, in_ddr, bounds, torch.rand(rows, N_BLOCKS * BLOCK, generator=generator))
    # layer 1 of a forward (prev-layer speculates from layer 0's input), with its queries of the previous step
    layer.layer_idx, layer.shared = 1, SimpleNamespace(layer_inputs=speculation_inputs(rows))
    with torch.no_grad():
        choice = RECALL_RULES[name].select(RecallRequest(query, slice(0, rows), (3, 2), N_BLOCKS, layer, scaling=0.5))
    return [set(choice.ids[row, : choice.per_row[row]].tolist()) for row in range(rows)]


@pytest.mark.parametrize("name", TRACER_RECALL_RULES)
def test_a_prefetchable_rule_chooses_the_same_whatever_the_current_query(name):
    """Perturbing the current query leaves a prefetchable rule's choice as it was; the rules that read the query
    (the check can fail: it sees them change) choose otherwise for at least one of the perturbed queries."""
    generator = torch.Generator().manual_seed(5)
    queries = [torch.randn(2, N_KV_HEADS, GROUP, HEAD_DIM, generator=generator) * 3 for _ in range(6)]
    choices = [_choices(name, q) for q in queries]
    if recall_is_prefetchable(name):
        assert all(c == choices[0] for c in choices)
    else:
        assert any(c != choices[0] for c in choices)


def reference_lru(steps: list[list[int]], capacity: int) -> list[int]:
    """Hits per step of an LRU over block ids, as a plain list (most recent last): a step's ids, in ascending
    order, each a hit when held as the step began; all become the most recent; the oldest leave past capacity."""
    held: list[int] = []
    hits = []
    for ids in steps:
        before = set(held)
        hits.append(sum(1 for i in ids if i in before))
        for i in sorted(ids):
            if i in held:
                held.remove(i)
            held.append(i)
        held = held[-capacity:] if capacity else []
    return hits


def test_the_buffer_counts_what_a_reference_lru_counts():
    generator = torch.Generator().manual_seed(2)
    for capacity in (1, 3, 8, 20):
        steps = [sorted(set(torch.randint(0, 24, (int(torch.randint(0, 9, (1,), generator=generator)),),
                                          generator=generator).tolist())) for _ in range(60)]
        assert replay_hits(steps, capacity) == reference_lru(steps, capacity)
        assert 0 < sum(replay_hits(steps, capacity)) <= sum(map(len, steps))
    buffer = RecallBuffer(2)
    assert buffer.admit([5, 1]) == 0 and buffer.admit([1, 7]) == 1 and 5 not in buffer and len(buffer) == 2


def test_the_buffers_slots_hold_what_they_are_read_for():
    """`admit_slots` against a device buffer written out as a list of slots: every hit reads its own id back (the
    hits read before the misses write), every miss that stays is written to a free slot below the capacity."""
    generator = torch.Generator().manual_seed(8)
    for capacity in (1, 3, 8):
        buffer, slots = RecallBuffer(capacity), [None] * capacity
        for _ in range(80):
            ids = sorted(set(torch.randint(0, 20, (int(torch.randint(0, 11, (1,), generator=generator)),),
                                           generator=generator).tolist()))
            hits, misses = buffer.admit_slots(ids)
            assert sorted([i for i, _ in hits] + [i for i, _ in misses]) == ids
            assert all(slots[slot] == i for i, slot in hits)
            for i, slot in misses:
                if slot is not None:
                    slots[slot] = i
            held = [i for i in ids if i in buffer]
            assert len(held) == min(len(ids), capacity) and len(buffer) <= capacity
            assert all(i in slots for i in held)  # (and read back as a hit next time: checked above)


@pytest.fixture(scope="module")
def buffered_runs(tmp_path_factory):
    """The bundled micro model on chains: a hierarchy recalling by quest, without and with a buffer of 6 blocks."""
    from tracer.run import TraceConfig, run_trace
    from traces import open_run

    root = tmp_path_factory.mktemp("buffer")

    def trace(name: str, **extra):
        config = TraceConfig(model="micro", task="chains", out=str(root / name), n_samples=4, max_new_tokens=40,
                             block_size=4, window_tokens=8, device="cpu", access=False, policy="hierarchy",
                             hbm_budget=0.3, recall_k=4, batch_size=2, **extra)
        return open_run(run_trace(config, progress=False))

    return trace("plain"), trace("buffered", recall_buffer_blocks=6)


def test_a_buffer_changes_what_is_copied_not_what_is_attended(buffered_runs):
    plain, buffered = buffered_runs
    a, b = plain.samples().set_index("sample_id"), buffered.samples().set_index("sample_id")
    assert (a["generated_text"] == b.loc[a.index, "generated_text"]).all()
    key = ["sample_id", "step", "layer"]
    first, second = (run.steps().sort_values(key).reset_index(drop=True) for run in buffered_runs)
    assert first["recalled_block_ids"].map(list).equals(second["recalled_block_ids"].map(list))
    assert first["recall_hits"].isna().all() and second["recall_hits"].notna().all()
    hits = second["recall_hits"].sum()
    assert 0 < hits and second["bytes_h2d"].sum() < first["bytes_h2d"].sum()
    recalled = second["recalled_tokens"] // 4
    assert (second["recall_hits"] + second["recall_misses"] == recalled).all()
    block_bytes = (first["bytes_h2d"].sum() // (first["recalled_tokens"].sum() // 4))
    assert (second["bytes_h2d"] == second["recall_misses"] * block_bytes).all()  # misses only
    assert (second["hbm_kv_bytes"] >= first["hbm_kv_bytes"]).all()
    assert (second["hbm_kv_bytes"] > first["hbm_kv_bytes"]).any()  # the buffer's HBM counts


def test_the_simulators_replay_of_the_traced_buffer_is_the_tracers_accounting(buffered_runs):
    _, buffered = buffered_runs
    steps = buffered.steps()
    token_bytes = buffered.manifest["model"]["kv_bytes_per_token"] // buffered.manifest["model"]["n_layers"]
    block_bytes = int((steps["bytes_h2d"] / steps["recall_misses"]).dropna().iloc[0])
    for _, sample in steps.groupby("sample_id"):
        frame = sample.sort_values(["step", "layer"])
        # the reference LRU over each layer's recorded ids gives the recorded hits
        for _, rows in frame.groupby("layer"):
            assert reference_lru([list(v) for v in rows["recalled_block_ids"]], 6) == rows["recall_hits"].tolist()
        played = replay_buffer(sample, 6, block_bytes, 4 * token_bytes)
        traced = frame.set_index(["step", "layer"])
        for name, array in (("recall_hits", played.hits), ("recall_misses", played.misses),
                            ("bytes_h2d", played.bytes_h2d)):
            assert array.T.reshape(-1).tolist() == traced[name].unstack("layer").T.to_numpy().reshape(-1).tolist(), name
        held = traced["hbm_kv_bytes"] - traced["hbm_tokens"] * token_bytes
        assert played.recall_hbm_bytes.T.reshape(-1).tolist() == held.unstack("layer").T.to_numpy().reshape(-1).tolist()


def test_layer_prefetch_runs_a_rule_known_before_the_layer_and_refuses_one_that_reads_the_query(tmp_path):
    from tracer.run import TraceConfig, run_trace

    def trace(rule: str):
        config = TraceConfig(model="micro", task="chains", out=str(tmp_path / rule), n_samples=1, max_new_tokens=24,
                             block_size=4, window_tokens=8, device="cpu", access=False, policy="hierarchy",
                             hbm_budget=0.3, recall_k=2, recall_rule=rule)
        return run_trace(config, progress=False)

    prefetched = simulate_run(trace("score"), "h100-pcie", SimOptions(overlap="layer-prefetch"))
    plain = simulate_run(trace("score"), "h100-pcie", SimOptions())
    assert prefetched.samples["ms_per_token"].iloc[0] <= plain.samples["ms_per_token"].iloc[0]
    with pytest.raises(SimulationError, match="layer-prefetch"):
        simulate_run(trace("oracle"), "h100-pcie", SimOptions(overlap="layer-prefetch"))


def test_the_buffer_is_a_hierarchy_setting_recorded_in_the_manifest_only_when_set():
    spec = PolicySpec(policy="hierarchy", recall_buffer_blocks=16)
    assert PolicySpec.from_manifest(spec.to_manifest()) == spec
    assert "recall_buffer_blocks" not in PolicySpec(policy="hierarchy").to_manifest()["params"]
    assert PolicySpec(policy="evict", hbm_budget=0.5).effective().recall_buffer_blocks == 0


def test_a_buffer_outside_the_hierarchy_or_below_zero_is_refused_in_one_line():
    from traces.policy import PolicyError, check_given

    with pytest.raises(PolicyError, match="--recall-buffer-blocks applies to the hierarchy policy only"):
        check_given({"policy": "evict", "recall_buffer_blocks": 4})
    with pytest.raises(PolicyError, match="--recall-buffer-blocks"):
        PolicySpec(policy="hierarchy", recall_buffer_blocks=-1)


def test_the_recall_design_table_has_every_rule_at_every_budget_and_refuses_a_bad_count(tmp_path, capsys):
    from thoughtkv.cli import main
    from thoughtkv.experiments.recall_design import HBM_BUDGETS, RECALL_BUDGETS, RULES, cells

    names = [cell.name for cell in cells()]
    assert len(names) == len(set(names)) == 1 + len(HBM_BUDGETS) * len(RECALL_BUDGETS) * len(RULES)
    assert {"oracle", "score"} <= set(RULES)
    assert main(["experiment", "recall-design", "--out", str(tmp_path), "--n-samples", "0"]) == 2
    assert "--n-samples" in capsys.readouterr().err


# -- the speculative rules in a decode --------------------------------------------------------------------------
def _tiny(arch: str):
    from _helpers import TINY_CONFIGS
    from transformers import AutoModelForCausalLM

    import tracer.attention  # noqa: F401  (registers the "thoughtkv" attention function)

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), attn_implementation="thoughtkv",
                                            dtype=torch.float32).eval()


def _decode(model, rule: str, n_new: int = 24, prompts=(41, 29, 35)):
    """A hierarchy decode of three prompts at batch 2 (a row is refilled): each job's recorder."""
    from tracer.cache import TieredCache, TierSettings
    from tracer.decode import DecodeJob, decode_batch
    from tracer.recorder import Recorder
    from tracer.scorers import build_scorer

    spec = PolicySpec(policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule=rule, block_size=4, sink_tokens=4,
                      window_tokens=8)
    generator = torch.Generator().manual_seed(3)
    jobs = [DecodeJob(i, torch.randint(3, 320, (n,), generator=generator).tolist(),
                      TierSettings(spec=spec, scorer=build_scorer("h2o")), Recorder()) for i, n in enumerate(prompts)]
    list(decode_batch(model, jobs, TieredCache(model.config.num_hidden_layers, jobs[0].settings), 2, n_new, set()))
    return [job.recorder for job in jobs]


def _rope_reference(query: torch.Tensor, positions: torch.Tensor, config) -> torch.Tensor:
    """RoPE written out (rotate-half, HF's llama/qwen2 layout) at `positions` [m] for queries [m, Hq, d]."""
    d = query.shape[-1]
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = positions.double()[:, None] * inv_freq[None]  # [m, d / 2]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    q = query.double()
    rotated = torch.cat([-q[..., d // 2:], q[..., : d // 2]], -1)
    return q * cos + rotated * sin


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_prev_layer_is_layer_i_query_made_from_the_hidden_state_entering_layer_i_minus_1(arch, monkeypatch):
    """Every query prev-layer ranks by, against one computed here from the hidden state that entered layer i - 1
    (caught by this test's own hook) and layer i's weights (its RMS norm, q_proj with its bias, RoPE at the
    step's position, all written out); at layer 0, the query layer 0 attended with at the previous forward. GQA:
    4 query heads on 2 KV heads."""
    from tracer.cache.layer import PagedLayer
    from tracer.cache.recall_rules import PrevLayer

    model = _tiny(arch)
    config = model.config
    forwards: list[dict] = []  # per forward: position ids, each layer's input, each layer's attended query
    model.register_forward_pre_hook(lambda _m, _a, kwargs: forwards.append(
        {"positions": kwargs["position_ids"], "inputs": {}, "attended": {}}), with_kwargs=True)
    for index, decoder in enumerate(model.model.layers):
        decoder.register_forward_pre_hook(lambda _m, args, kwargs, index=index: forwards[-1]["inputs"].__setitem__(
            index, (args[0] if args else kwargs["hidden_states"]).clone()), with_kwargs=True)
    speculated = []  # (forward, layer, entries, query [m, Hq, d])
    original_query_of, original_attend = PrevLayer.query_of, PagedLayer.attend

    def query_of(self, request):
        query = original_query_of(self, request)
        speculated.append((len(forwards) - 1, request.layer.layer_idx, request.entries, query.flatten(1, 2).clone()))
        return query

    def attend(self, rows, query, scaling):
        forwards[-1]["attended"][self.layer_idx] = (list(rows), query[:, :, -1].clone())
        return original_attend(self, rows, query, scaling)

    monkeypatch.setattr(PrevLayer, "query_of", query_of)
    monkeypatch.setattr(PagedLayer, "attend", attend)
    _decode(model, "prev-layer")
    checked = {0: 0, 1: 0}
    for forward, layer, entries, query in speculated:
        step = forwards[forward]
        entries = list(range(query.shape[0])) if entries is None else entries.tolist()
        if layer == 0:  # the layer's own query at the previous forward each row took part in
            rows = step["attended"][0][0]
            for position, entry in enumerate(entries):
                earlier = next(f for f in reversed(forwards[:forward]) if rows[entry] in f["attended"][0][0])
                row_at = earlier["attended"][0][0].index(rows[entry])
                torch.testing.assert_close(query[position], earlier["attended"][0][1][row_at])
        else:
            decoder = model.model.layers[layer]
            hidden = step["inputs"][layer - 1][entries, -1].double()  # [m, hidden]
            norm = decoder.input_layernorm
            normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            projection = decoder.self_attn.q_proj
            q = (normed * norm.weight.double()) @ projection.weight.double().T
            if projection.bias is not None:
                q = q + projection.bias.double()
            expected = _rope_reference(q.view(len(entries), config.num_attention_heads, -1),
                                       step["positions"][entries, -1], config)
            torch.testing.assert_close(query.double(), expected, rtol=1e-4, atol=1e-5)
        checked[min(layer, 1)] += 1
    assert checked[0] > 20 and checked[1] > 20, checked  # both kinds, at many decode steps


@pytest.mark.parametrize("rule", ["prev-layer", "prev-layer-per-head", "prev-step", "prev-step-per-head", "quest"])
def test_a_speculative_rule_recalls_the_same_blocks_when_the_current_query_is_perturbed(rule, monkeypatch):
    """In a decode, the query each recall request carries (the current one, which attention still uses) gets
    noise: a speculative rule recalls exactly the blocks it recalled without it; quest (which reads it) does not."""
    from tracer.cache import recall

    model = _tiny("qwen2")
    plain = _decode(model, rule)
    made = recall.RecallRequest

    def perturbed(query, *args, **kwargs):
        noise = torch.randn(query.shape, generator=torch.Generator().manual_seed(query.numel())) * 3
        return made(query + noise * query.abs().mean(), *args, **kwargs)

    monkeypatch.setattr(recall, "RecallRequest", perturbed)
    noisy = _decode(model, rule)
    recalled = [[list(ids) for ids in r.steps_table()["recalled_block_ids"]] for r in plain]
    assert sum(len(ids) for sample in recalled for ids in sample) > 50  # blocks were recalled
    same = recalled == [[list(ids) for ids in r.steps_table()["recalled_block_ids"]] for r in noisy]
    assert same == recall_is_prefetchable(rule)


# -- the buffer and prefetch in the latency model ---------------------------------------------------------------
def test_the_simulators_copies_under_a_buffer_are_the_tracers_misses(buffered_runs):
    """`simulate --recall-buffer-blocks 6` on the unbuffered run copies exactly the bytes the tracer copied with a
    buffer of 6 (its misses), sample by sample, and holds the same HBM; 0 on the buffered run copies every recalled
    block again (the unbuffered run's bytes). serve-sim's per-request work copies and reserves the same."""
    from hwprofiles import load_profile
    from simulator.serving import load_run_work

    plain, buffered = buffered_runs
    misses = buffered.steps().groupby("sample_id")["bytes_h2d"].sum()
    everything = plain.steps().groupby("sample_id")["bytes_h2d"].sum()
    assert (misses < everything).all()  # the buffer served some recalls
    replayed = simulate_run(plain, "h100-pcie", SimOptions(recall_buffer_blocks=6)).samples.set_index("sample_id")
    traced = simulate_run(buffered, "h100-pcie", SimOptions()).samples.set_index("sample_id")
    unbuffered = simulate_run(buffered, "h100-pcie", SimOptions(recall_buffer_blocks=0)).samples.set_index("sample_id")
    assert replayed["bytes_h2d"].to_dict() == misses.to_dict() == traced["bytes_h2d"].to_dict()
    assert unbuffered["bytes_h2d"].to_dict() == everything.to_dict()
    for column in ("kv_hbm_bytes_per_seq", "peak_hbm_bytes", "ms_per_token"):
        assert replayed[column].to_dict() == pytest.approx(traced[column].to_dict(), rel=1e-12), column
    assert (replayed["kv_hbm_bytes_per_seq"] >= unbuffered["kv_hbm_bytes_per_seq"]).all()  # its HBM counts
    assert (replayed["ms_per_token"] <= unbuffered["ms_per_token"]).all()  # hits copy nothing
    profile = load_profile("h100-pcie")
    served = {w.sample_id: w for w in load_run_work(plain.path, profile, recall_buffer_blocks=6)[2]}
    served_traced = {w.sample_id: w for w in load_run_work(buffered.path, profile)[2]}
    for sample_id, n_bytes in misses.items():
        assert served[sample_id].recall_bytes.sum() == n_bytes
        assert served[sample_id].peak_hbm_kv_bytes == served_traced[sample_id].peak_hbm_kv_bytes


@pytest.fixture(scope="module")
def prefetchable_run(tmp_path_factory):
    from tracer.run import TraceConfig, run_trace

    config = TraceConfig(model="micro", task="chains", out=str(tmp_path_factory.mktemp("prefetch") / "run"),
                         n_samples=3, max_new_tokens=40, block_size=4, window_tokens=8, device="cpu", access=False,
                         policy="hierarchy", hbm_budget=0.3, recall_k=4, recall_rule="prev-layer", batch_size=3)
    return run_trace(config, progress=False)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("buffer", [None, 0, 6])
@pytest.mark.parametrize("projection", [None, "qwen2-7b"])
def test_fast_path_equals_des_with_a_buffer_and_layer_prefetch(prefetchable_run, batch, buffer, projection):
    """A prefetchable rule's run under layer prefetch, with and without a buffer, one sequence or a lockstep
    batch, on its own shapes and projected: the closed form is the DES to 1e-9; prefetch never slows it."""
    from simulator.options import Projection

    def run(engine: str, overlap: str = "layer-prefetch"):
        options = SimOptions(engine=engine, overlap=overlap, batch=batch, recall_buffer_blocks=buffer,
                             transfer="dma-batched")
        return simulate_run(prefetchable_run, "h100-pcie", options, projection=Projection(as_model=projection))

    from traces.manifest import load_manifest

    assert load_manifest(prefetchable_run)["tracer"]["recall"] == {"rule": "prev-layer", "prefetchable": True}
    fast, des = run("fast").samples, run("des").samples
    assert (fast["engine"] == "fast").all() and (des["engine"] == "des").all()
    for column in ("total_s", "ms_per_token", "link_stall_s", "link_util_h2d", "d2h_backlog_s", "peak_hbm_bytes"):
        np.testing.assert_allclose(fast[column], des[column], rtol=1e-9, atol=1e-15, err_msg=column)
    assert (fast["bytes_h2d"] == des["bytes_h2d"]).all() and fast["bytes_h2d"].sum() > 0
    assert (fast["ms_per_token"] <= run("fast", "none").samples["ms_per_token"] * (1 + 1e-12)).all()


@pytest.mark.parametrize("buffer", [None, 6])
def test_serving_fast_path_equals_its_des_with_a_buffer_and_layer_prefetch(prefetchable_run, buffer):
    """serve-sim of the prefetchable run, prefetching, with its recalls replayed through a buffer: the serving fast
    path is its DES to 1e-9; the buffer copies less and reserves more HBM per request."""
    import pandas as pd
    from _helpers import assert_same

    from simulator.options import ServingConfig
    from simulator.serving import simulate_serving

    def serve(engine: str, blocks=buffer):
        options = SimOptions(engine=engine, overlap="layer-prefetch", recall_buffer_blocks=blocks)
        return simulate_serving(prefetchable_run, "h100-pcie", ServingConfig(rate_per_s=400, duration_s=0.05,
                                                                             max_batch=8, seed=3, options=options))

    des, fast = serve("des"), serve("fast")
    assert des.summary["n_requests"] > 3 and des.summary["bytes_h2d"] > 0
    assert_same(des.summary, fast.summary, "summary")
    pd.testing.assert_frame_equal(des.requests, fast.requests, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(des.tbt_s, fast.tbt_s, rtol=1e-9, atol=1e-12)
    if buffer:
        unbuffered = serve("fast", 0).summary
        assert fast.summary["bytes_h2d"] < unbuffered["bytes_h2d"]
        assert fast.summary["kv_reserved_bytes_per_request"] > unbuffered["kv_reserved_bytes_per_request"]
    assert fast.summary["recall_buffer_blocks"] == buffer  # (a result column: an option)



def test_the_headline_compares_the_best_prefetchable_rule_at_equal_traffic_and_says_if_the_goal_is_missed(tmp_path):
    """The sentence from cell results: the most accurate prefetchable rule at 30% HBM against quest-per-head and the
    oracle at its recall budget, its ms/token with the buffer and prefetch against quest's; the goal's gap in points.
    The served batches come from capacity_served.csv, and its absence is one line naming the fix."""
    from thoughtkv.experiments.recall_design import (
        LATENCY_BUFFER,
        PROFILES,
        headline,
        latency_key,
        served_batches,
    )
    from thoughtkv_base import UserError

    def cell(rule, accuracy, ms_none, ms_prefetch=None, recall=0.2):
        ms = {latency_key(p, b, n, o): None for p in PROFILES for b in ("1", "served") for n in (0, LATENCY_BUFFER)
              for o in ("none", "layer-prefetch")}
        ms[latency_key("h100-pcie", "1", LATENCY_BUFFER, "none")] = ms_none
        ms[latency_key("h100-pcie", "1", LATENCY_BUFFER, "layer-prefetch")] = ms_prefetch
        return {"policy": "hierarchy", "hbm_budget": 0.3, "recall_budget": recall, "recall_rule": rule, "n": 200,
                "accuracy": accuracy, "ci_low": accuracy - 0.05, "ci_high": accuracy + 0.05, "cell": rule,
                "buffers": {"0": {"h2d_bytes_per_token_ref": 1e6}}, "ms_per_token": ms}

    results = [cell("quest", 0.30, 11.1), cell("quest-per-head", 0.685, 11.2), cell("oracle", 1.0, 11.1),
               cell("prev-layer-per-head", 0.08, 11.1, 10.9), cell("prev-step", 0.05, 11.0, 10.9),
               cell("prev-layer-per-head", 0.02, 11.0, 10.9, recall=0.1)]
    text = headline(results)
    assert "prev-layer-per-head, keeps 8.0 [3.0, 13.0]%" in text and "quest-per-head's 68.5 [63.5, 73.5]%" in text
    assert "10.90 ms/token on h100-pcie" in text and "quest's 11.10" in text
    assert "not reached" in text and "60.5 points below" in text and "50.5 points short" in text
    with pytest.raises(UserError, match="capacity-served"):
        served_batches(tmp_path)


def test_the_served_point_is_set_beside_capacity_serveds_row_at_the_same_budgets(tmp_path):
    from thoughtkv.experiments.recall_design_served import served_point_lines

    (tmp_path / "capacity_served.csv").write_text("run_dir,profile,label,max_rate_per_s,limit,accuracy\n"
                                                  "runs/hier-e0-r20-b30,h100-pcie,\"hierarchy, evict 0%, recall ≤ 20% @ 30%\","
                                                  "8.724,link bandwidth,0.295\n"
                                                  "runs/hier-e0-r10-b30,h100-pcie,\"hierarchy, evict 0%, recall ≤ 10% @ 30%\","
                                                  "12.9,link bandwidth,0.035\n")
    served = {"buffer": 32, "profile": "h100-pcie", "recall_rule": "prev-step", "recall_budget": 0.2, "n": 200,
              "accuracy": 0.105, "ci_low": 0.07, "ci_high": 0.15, "max_rate_per_s": 12.5, "limit": "HBM capacity",
              "h2d_bytes_per_token_served": 2.0e6, "knee_link_util_h2d": 0.4, "knee_mean_concurrency": 400.0}
    [text] = served_point_lines(served, tmp_path / "capacity_served.csv")
    assert "sustains 12.5 req/s on h100-pcie (HBM capacity beyond it" in text
    assert "quest at the same HBM and recall budget, without buffer or prefetch, sustains 8.72 req/s" in text
    assert served_point_lines(None) == []


def test_the_goal_is_not_met_by_two_rules_that_both_keep_nothing():
    """Within 10 points of quest-per-head where quest-per-head itself keeps 3% is no answer: the goal is judged
    at quest-per-head's best recall budget."""
    from thoughtkv.experiments.recall_design import LATENCY_BUFFER, PROFILES, headline, latency_key

    def cell(rule, accuracy, recall, ms_prefetch=None):
        ms = {latency_key(p, b, n, o): None for p in PROFILES for b in ("1", "served") for n in (0, LATENCY_BUFFER)
              for o in ("none", "layer-prefetch")}
        ms[latency_key("h100-pcie", "1", LATENCY_BUFFER, "none")] = 11.0
        ms[latency_key("h100-pcie", "1", LATENCY_BUFFER, "layer-prefetch")] = ms_prefetch
        return {"policy": "hierarchy", "hbm_budget": 0.3, "recall_budget": recall, "recall_rule": rule, "n": 200,
                "accuracy": accuracy, "ci_low": accuracy - 0.02, "ci_high": accuracy + 0.02, "cell": rule,
                "buffers": {"0": {"h2d_bytes_per_token_ref": 1e6}}, "ms_per_token": ms}

    results = [cell(rule, accuracy, recall, 10.9 if rule.startswith("prev") else None)
               for rule, accuracy, recall in (("quest", 0.01, 0.05), ("quest-per-head", 0.03, 0.05),
                                              ("oracle", 0.9, 0.05), ("prev-layer", 0.06, 0.05),
                                              ("quest", 0.3, 0.2), ("quest-per-head", 0.685, 0.2),
                                              ("oracle", 1.0, 0.2), ("prev-step", 0.105, 0.2))]
    text = headline(results)
    assert "not reached" in text and "judged at quest-per-head's best recall budget, ≤ 20%" in text
    assert "prev-step at recall ≤ 20%, is 58.0 points below" in text


def test_the_real_lm_rows_come_from_real_model_csv_at_30_percent_and_10_percent_recall(tmp_path):
    import csv

    from thoughtkv.experiments.recall_design import real_model_lines

    assert real_model_lines(tmp_path / "real_model.csv") == []
    keys = ("policy", "hbm_budget", "recall_budget", "recall_rule", "n", "kl", "kl_low", "kl_high", "top1",
            "top1_low", "top1_high", "attended_frac", "recalled_frac", "h2d_bytes_per_token_ref")
    rows = [("hierarchy", 0.3, 0.1, "prev-layer", 100, 0.078, 0.073, 0.083, 0.913, 0.907, 0.919, 0.399, 0.094, 1.16e6),
            ("hierarchy", 0.3, 0.1, "quest", 100, 0.067, 0.063, 0.071, 0.919, 0.913, 0.924, 0.399, 0.094, 1.16e6),
            ("hierarchy", 0.3, 0.2, "quest", 100, 0.025, 0.02, 0.03, 0.95, 0.94, 0.96, 0.5, 0.19, 2.4e6),
            ("evict", 0.3, "", "", 100, 0.4, 0.38, 0.43, 0.82, 0.81, 0.83, 0.3, 0.0, 0.0)]
    with (tmp_path / "real_model.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(keys)
        writer.writerows(rows)
    table = [line for line in real_model_lines(tmp_path / "real_model.csv") if line.startswith("| ") and "KL" not in line]
    assert len(table) == 2  # the 10% recall rows only, quest first (the rule order), prev-layer marked
    assert table[0].startswith("| quest | 100 | 0.067 [0.063, 0.071] | 91.9")
    assert table[1].startswith("| prev-layer (prefetchable) | 100 | 0.078")
