"""Paged admission, preemption and chunked prefill in serve-sim (simulator/admission.py), and an iteration priced
as its kernels run (costs.kernel_times), against references computed by hand in the tests: which request a
scenario built to run out of blocks preempts, the tokens it recomputes, the bytes it swaps, what a chunked
prefill and a mixed iteration cost; with one request or n identical ones, paged = peak = the engine's replay;
nothing is lost or counted twice."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from _helpers import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwprofiles import load_profile
from simulator import costs, simulate_run
from simulator.options import OptionError, ServingConfig, SimOptions
from simulator.serving import simulate_serving
from simulator.synth import synth_run
from traces import open_run
from traces.architectures import dtype_bytes, get_architecture

PROMPT, STEPS = 40, 61  # the tiny full-cache trace: a 40-token prompt, then 60 decode steps


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    return synth_run(tmp_path_factory.mktemp("paged") / "full", model="tiny", prompt_tokens=PROMPT,
                     decode_steps=STEPS - 1, policy="full", samples=1, access=False)


@pytest.fixture(scope="module")
def hier_run(tmp_path_factory) -> Path:
    return synth_run(tmp_path_factory.mktemp("paged") / "hier", model="tiny", prompt_tokens=48, decode_steps=24,
                     policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="score", samples=3, access=False)


def arrivals_csv(path: Path, times: list[float], output_tokens: int, prompt_tokens: int = PROMPT) -> str:
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(
        f"{t!r},{prompt_tokens},{output_tokens}\n" for t in times))
    return str(path)


def kernel_only(name: str, kv_room_bytes: float | None = None, run: Path | None = None):
    """A shipped profile in kernel-only mode (no host), with HBM for the weights + `kv_room_bytes` of KV."""
    from hwprofiles.overhead_modes import apply_mode

    profile = apply_mode(load_profile(name), "kernel-only")
    if kv_room_bytes is not None:
        weights = costs.ModelShape.from_manifest(open_run(run).manifest["model"]).weight_bytes
        profile = dataclasses.replace(profile, gpu=dataclasses.replace(
            profile.gpu, hbm_capacity_bytes=int(weights + kv_room_bytes)))
    return profile


def token_times(result, rid: int) -> np.ndarray:
    row = result.requests.set_index("request").loc[rid]
    start = int(result.requests.loc[result.requests["request"] < rid, "tokens"].sub(1).sum())
    tbt = result.tbt_s[start:start + int(row["tokens"]) - 1]
    return row["first_token_s"] + np.concatenate([[0.0], np.cumsum(tbt)])


# ---------------------------------------------------------------- a hand-written kernel reference -----------


def layer_kernels_s(arch, profile, tokens, attention: list[tuple[float, float]], dtype="bfloat16") -> float:
    """One layer operation, written out: the GEMMs over `tokens` (2 P_layer T FLOPs against the layer's weight
    bytes), each attention kernel (FLOPs, bytes) at its own roofline, the small kernels' activation traffic."""
    b = dtype_bytes(dtype)
    flops_per_s, bytes_per_s = profile.gpu.matmul_flops_per_s, profile.gpu.hbm_bytes_per_s
    head_params = arch.vocab_size * arch.hidden_size
    layer_params = (arch.n_params() - head_params) / arch.n_layers
    total = max(2 * layer_params * tokens / flops_per_s, layer_params * b / bytes_per_s)
    for flops, n_bytes in attention:
        total += max(flops / flops_per_s, n_bytes / bytes_per_s)
    elements = 7 * arch.hidden_size + 2 * (arch.n_heads + arch.n_kv_heads) * arch.head_dim + 3 * arch.intermediate_size
    return total + tokens * elements * b / (bytes_per_s * costs.SMALL_KERNEL_HBM_FRACTION)


def head_s(arch, profile, batch: int, dtype="bfloat16") -> float:
    head_params = arch.vocab_size * arch.hidden_size
    return max(2 * head_params * batch / profile.gpu.matmul_flops_per_s,
               head_params * dtype_bytes(dtype) / profile.gpu.hbm_bytes_per_s)


def attention(arch, q: float, a: float, dtype="bfloat16") -> tuple[float, float]:
    """(FLOPs, bytes) of one sequence's attention: q new queries over a tokens (new ones included), causal."""
    pairs = q * (a - q) + q * (q + 1) / 2
    kv_layer = 2 * arch.n_kv_heads * arch.head_dim * dtype_bytes(dtype)
    return 4 * arch.n_heads * arch.head_dim * pairs, (a + q) * kv_layer


def prefill_s(arch, profile, q: int, a: int, batch_heads: int = 1) -> float:
    """A prefill chunk of q tokens attending a (alone in its iteration): every layer, then the LM head."""
    return arch.n_layers * layer_kernels_s(arch, profile, q, [attention(arch, q, a)]) + head_s(arch, profile,
                                                                                             batch_heads)


# ---------------------------------------------------------------- options ------------------------------------


def test_the_options_are_defined_and_checked_once():
    config = ServingConfig()
    assert (config.admission, config.preempt, config.max_batched_tokens) == ("paged", "recompute", None)
    # vLLM's defaults (OpenAI server): 8192 on >= 70 GiB that is not an A100, else 2048; never below max_batch
    assert config.batched_tokens(80e9, "NVIDIA H100 PCIe h100-pcie") == 8192
    assert config.batched_tokens(80e9, "NVIDIA A100-SXM4-80GB a100-80gb-sxm") == 2048
    assert config.batched_tokens(24e9, "rtx-4090") == 2048
    assert ServingConfig(max_batch=4096).batched_tokens(24e9, "rtx-4090") == 4096
    assert ServingConfig(max_batched_tokens=100, max_batch=8).batched_tokens(80e9, "h100") == 100
    for bad, match in ((dict(admission="lazy"), "admission"), (dict(preempt="kill"), "preempt"),
                       (dict(max_batched_tokens=0), "max_batched_tokens"),
                       (dict(max_batched_tokens=8, max_batch=16), "below max_batch")):
        with pytest.raises(OptionError, match=match):
            ServingConfig(**bad)


def test_serve_cells_tell_admission_modes_apart(full_run):
    from simulator.sweep import ServeCell, cell_key

    keys = {cell_key(ServeCell(str(full_run), "h100-pcie", ServingConfig(**kw)))
            for kw in ({}, dict(admission="peak"), dict(preempt="swap"), dict(max_batched_tokens=128))}
    assert len(keys) == 4


# ---------------------------------------------------------------- paged = peak = the replay ------------------


@pytest.mark.parametrize("admission", ["paged", "peak"])
@pytest.mark.parametrize("n_requests", [1, 3])
@pytest.mark.parametrize("overlap", ["none", "layer-prefetch"])
def test_one_or_n_identical_requests_are_the_engines_replay_under_both_admissions(tmp_path, hier_run, admission,
                                                                                 n_requests, overlap):
    """With room for them all, paged and peak admit the same and the iteration is the lockstep batch's step."""
    csv = arrivals_csv(tmp_path / "a.csv", [0.0] * n_requests, output_tokens=25, prompt_tokens=48)
    options = SimOptions(overlap=overlap)
    served = simulate_serving(hier_run, "h100-pcie", ServingConfig(arrivals_csv=csv, admission=admission,
                                                                   options=options))
    replay = simulate_run(hier_run, "h100-pcie", dataclasses.replace(options, batch=n_requests, engine="des"))
    for _, request in served.requests.iterrows():
        steps = replay.steps[replay.steps["sample_id"] == request["sample_id"]].sort_values("step")
        np.testing.assert_allclose(token_times(served, request["request"]), np.cumsum(steps["latency_s"]), rtol=1e-9)
    assert served.summary["n_preemptions"] == 0


def test_chunked_prefill_with_a_budget_of_the_prompt_is_the_whole_prefill(tmp_path, full_run):
    csv = arrivals_csv(tmp_path / "a.csv", [0.0, 0.5], output_tokens=STEPS)
    base = ServingConfig(arrivals_csv=csv, max_batch=4)
    whole = simulate_serving(full_run, "h100-sxm", base)
    assert whole.summary["max_batched_tokens"] == 8192
    budgeted = simulate_serving(full_run, "h100-sxm", dataclasses.replace(base, max_batched_tokens=PROMPT))
    for key in ("end_s", "ttft_p50_s", "tbt_p99_s", "tokens", "gpu_busy_s"):
        assert budgeted.summary[key] == whole.summary[key]


def test_a_chunked_prefill_runs_its_chunks_in_order_and_costs_each(tmp_path, full_run):
    """A 40-token prompt under a 16-token budget: chunks of 16, 16 and 8 tokens in three iterations, the last
    emitting the first token; chunk j attends the j chunks before it and itself (a hand-written reference)."""
    profile = kernel_only("h100-sxm")
    arch = get_architecture("tiny")
    csv = arrivals_csv(tmp_path / "a.csv", [0.0], output_tokens=STEPS)
    served = simulate_serving(full_run, profile, ServingConfig(arrivals_csv=csv, max_batch=4, max_batched_tokens=16))
    expected = prefill_s(arch, profile, 16, 16) + prefill_s(arch, profile, 16, 32) + prefill_s(arch, profile, 8, 40)
    assert served.requests["first_token_s"].iloc[0] == pytest.approx(expected, rel=1e-9)
    whole = simulate_serving(full_run, profile, ServingConfig(arrivals_csv=csv, max_batch=4))
    assert whole.requests["first_token_s"].iloc[0] == pytest.approx(prefill_s(arch, profile, 40, 40), rel=1e-9)
    # after the prefill, the same decode steps
    np.testing.assert_allclose(np.diff(token_times(served, 0)), np.diff(token_times(whole, 0)), rtol=1e-9)


# ---------------------------------------------------------------- running out of blocks ----------------------


# Three identical full-cache requests at t = 0 hold (40 + s) K bytes each at step s (K bytes of KV per token).
# HBM has room for two at their last step, 2 (40 + 60) K = 200 K. The three fit up to step 26 (3 x 66 K); at step
# s* = 27 the first two fit (199 K, 200 K) and the third, the last admitted, does not (201 K): it is preempted.
# Its blocks of step 27 (67 K) fit beside the other two only once they end (2 (40 + s) K + 67 K > 200 K after).
S_STAR = 2 * (PROMPT + STEPS - 1) // 3 - PROMPT + 1


def out_of_blocks(tmp_path, full_run, preempt: str):
    shape = costs.ModelShape.from_manifest(open_run(full_run).manifest["model"])
    per_token = shape.kv_bytes_per_token
    room = 2 * (PROMPT + STEPS - 1) * per_token
    assert S_STAR == 27 and 3 * (PROMPT + S_STAR) * per_token > room >= 3 * (PROMPT + S_STAR - 1) * per_token
    profile = kernel_only("h100-pcie", room, full_run)
    csv = arrivals_csv(tmp_path / "a.csv", [0.0] * 3, output_tokens=STEPS)
    config = ServingConfig(arrivals_csv=csv, max_batch=8, preempt=preempt)
    des = simulate_serving(full_run, profile, dataclasses.replace(config, options=SimOptions(engine="des")))
    fast = simulate_serving(full_run, profile, dataclasses.replace(config, options=SimOptions(engine="fast")))
    return des, fast, profile, per_token, room


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_running_out_of_blocks_preempts_the_last_admitted_exactly(tmp_path, full_run, preempt):
    des, fast, profile, per_token, room = out_of_blocks(tmp_path, full_run, preempt)
    arch = get_architecture("tiny")
    for result in (des, fast):
        requests = result.requests.set_index("request")
        assert requests["preemptions"].tolist() == [0, 0, 1]  # request 2, once
        assert result.summary["n_preemptions"] == 1 and (requests["tokens"] == STEPS).all()
        assert (result.timeline["hbm_reserved_bytes"] <= profile.gpu.hbm_capacity_bytes).all()
        ends = token_times(result, 0)
        victim = token_times(result, 2)
        # request 2 emitted tokens 0..s*-1 with the others, then waited: its resumed blocks fit only once both end
        np.testing.assert_allclose(victim[:S_STAR], ends[:S_STAR], rtol=1e-12)
        assert victim[S_STAR] > requests.loc[0, "finish_s"] and victim[S_STAR] > requests.loc[1, "finish_s"]
        resumed_s = victim[S_STAR] - max(requests.loc[0, "finish_s"], requests.loc[1, "finish_s"])
        decode = lambda s: arch.n_layers * layer_kernels_s(arch, profile, 1, [attention(arch, 1, PROMPT + s)]) \
            + head_s(arch, profile, 1)  # noqa: E731
        tier = costs.offload_tier(profile)
        if preempt == "recompute":
            # it dropped the KV of prompt + tokens 0..s*-2 and prefills prompt + s* tokens again, emitting token s*
            assert requests.loc[2, "recomputed_tokens"] == PROMPT + S_STAR - 1 == result.summary["recomputed_tokens"]
            assert result.summary["swapped_bytes"] == 0 and result.summary["bytes_h2d"] == 0
            assert resumed_s == pytest.approx(prefill_s(arch, profile, PROMPT + S_STAR, PROMPT + S_STAR), rel=1e-9)
        else:
            # its blocks of step s* - 1 went to DDR and came back, one copy each way on the shared link
            moved = (PROMPT + S_STAR - 1) * per_token
            assert result.summary["swapped_bytes"] == requests.loc[2, "swapped_bytes"] == moved
            assert result.summary["bytes_d2h"] == result.summary["bytes_h2d"] == moved
            assert result.summary["recomputed_tokens"] == 0
            copy_s = tier.transfer_overhead_s + moved / tier.h2d_bytes_per_s
            assert resumed_s == pytest.approx(copy_s + decode(S_STAR), rel=1e-9)
        np.testing.assert_allclose(np.diff(victim[S_STAR:]), [decode(s) for s in range(S_STAR + 1, STEPS)], rtol=1e-9)
    assert_same(des.summary, fast.summary, "out of blocks")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(room=st.floats(1.2, 4.0), rate_per_s=st.floats(50.0, 400.0), max_batch=st.integers(2, 16),
       preempt=st.sampled_from(["recompute", "swap"]), budget=st.sampled_from([None, 16, 24]), seed=st.integers(0, 9))
def test_nothing_is_lost_or_counted_twice(hier_run, room, rate_per_s, max_batch, preempt, budget, seed):
    """Under HBM pressure, preemption and chunking: every admitted request finishes once with all its tokens, each
    token once; the summary's tokens are the requests' tokens; held blocks never exceed HBM."""
    from simulator.serving import load_run_work

    peak = max(w.peak_hbm_kv_bytes for w in load_run_work(hier_run, load_profile("h100-pcie"))[2])
    profile = kernel_only("h100-pcie", room * peak, hier_run)
    config = ServingConfig(rate_per_s=rate_per_s, duration_s=0.4, max_batch=max_batch, seed=seed, preempt=preempt,
                           max_batched_tokens=None if budget is None else max(budget, max_batch))
    result = simulate_serving(hier_run, profile, config)
    requests = result.requests
    served = requests[~requests["rejected"]]
    assert len(served) == len(requests) and served["finish_s"].notna().all()
    assert (served["first_token_s"] <= served["finish_s"]).all()
    assert len(result.tbt_s) == int((served["tokens"] - 1).sum()) and (result.tbt_s > 0).all()
    assert result.summary["tokens"] == int(served["tokens"].sum()) and result.summary["n_completed"] == len(served)
    for rid in served["request"]:
        times = token_times(result, rid)
        assert len(times) == served.set_index("request").loc[rid, "tokens"] and (np.diff(times) > 0).all()
    capacity = profile.gpu.hbm_capacity_bytes
    assert (result.timeline["hbm_reserved_bytes"] <= capacity * (1 + 1e-12)).all()
    assert (result.timeline["hbm_bytes"] <= result.timeline["hbm_reserved_bytes"] * (1 + 1e-12)).all()
    assert result.summary["n_preemptions"] == int(requests["preemptions"].sum())
    assert 0 < result.summary["gpu_util"] <= result.summary["gpu_busy_frac"] <= 1 + 1e-12


# ---------------------------------------------------------------- a mixed iteration ----------------------------


def test_a_mixed_iteration_costs_its_kernels_one_after_another(tmp_path_factory):
    """127 decodes and a 512-token prefill in one iteration (qwen2-7b on h100-sxm, kernel-only): per layer the
    GEMMs over all 639 tokens (weights once), the decodes' attention and the prefill's attention each at its own
    roofline, the small kernels over 639 tokens; then the LM head for 128 sequences. Not one roofline over the
    sum: that would hide the prefill's GEMM compute under the decodes' KV reads."""
    run = synth_run(tmp_path_factory.mktemp("mixed") / "q7", model="qwen2-7b", prompt_tokens=512, decode_steps=4,
                    policy="full", samples=1, access=False)
    profile = kernel_only("h100-sxm")
    arch = get_architecture("qwen2-7b")
    csv = arrivals_csv(tmp_path_factory.mktemp("csv") / "a.csv", [0.0] * 127 + [1e-9], output_tokens=5,
                       prompt_tokens=512)
    served = simulate_serving(run, profile, ServingConfig(arrivals_csv=csv, max_batch=128, max_batched_tokens=1 << 17))
    ends = token_times(served, 0)  # request 0 emits at every iteration's end
    late = served.requests.set_index("request").loc[127]
    assert late["first_token_s"] == pytest.approx(ends[1], rel=1e-12)  # its prefill ran in iteration 1
    steps = open_run(run).steps()
    attended = float((steps.loc[steps["step"] == 1, "hbm_tokens"] + steps.loc[steps["step"] == 1,
                                                                              "recalled_tokens"]).iloc[0])
    decodes = attention(arch, 1, attended)
    layer = layer_kernels_s(arch, profile, 127 + 512, [(127 * decodes[0], 127 * decodes[1]),
                                                       attention(arch, 512, 512)])
    expected = arch.n_layers * layer + head_s(arch, profile, 128)
    assert ends[1] - ends[0] == pytest.approx(expected, rel=1e-9)
    # one roofline over the iteration's summed FLOPs and bytes is faster: the difference is real
    flops_per_s, bytes_per_s = profile.gpu.matmul_flops_per_s, profile.gpu.hbm_bytes_per_s
    head_params = arch.vocab_size * arch.hidden_size
    layer_params = (arch.n_params() - head_params) / arch.n_layers
    flops = 2 * layer_params * 639 + 127 * decodes[0] + attention(arch, 512, 512)[0]
    one_roofline = max(flops / flops_per_s, (2 * layer_params + 127 * decodes[1] + attention(arch, 512, 512)[1])
                       / bytes_per_s)
    assert layer > 1.15 * one_roofline
