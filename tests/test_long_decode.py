"""Long generations: 4,096 new tokens through the tiered cache (hierarchy, 30% HBM) on a tiny random model,
and the accounting every run reports (share stopped by the token limit, accuracy over all / finished)."""

from __future__ import annotations

import math
import time

import pandas as pd
import pytest
import torch

from traces.stats import completion_lines, completion_summary, wilson_interval

NEW_TOKENS = 4096
BUDGET, BLOCK, RECALL_K, SINK, WINDOW = 0.3, 16, 4, 4, 32


def _tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=8192, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def test_4096_new_tokens_with_the_tiered_cache_stay_linear_per_step():
    from tracer.cache import TieredCache
    from tracer.decode import greedy_decode, use_tiered_attention
    from tracer.recorder import Recorder
    from tracer.run import TraceConfig, make_settings

    model = _tiny_model()
    use_tiered_attention(model)
    config = TraceConfig(model="tiny", task="gsm8k", out="unused", policy="hierarchy", hbm_budget=BUDGET,
                         evict_ratio=0.0, block_size=BLOCK, recall_k=RECALL_K, sink_tokens=SINK, window_tokens=WINDOW)
    recorder = Recorder(record_access=False)
    cache = TieredCache(model.config.num_hidden_layers, make_settings(config), recorder)
    prompt = list(range(3, 35))
    started = time.perf_counter()
    result = greedy_decode(model, prompt, cache, NEW_TOKENS, eos_ids=set(), recorder=recorder)
    wall_s = time.perf_counter() - started
    print(f"4,096 tokens decoded in {wall_s:.1f} s ({NEW_TOKENS / wall_s:.0f} tokens/s)")
    assert len(result.generated_ids) == NEW_TOKENS and result.stop_reason == "max_new_tokens"
    assert wall_s < 180  # ~25 s on one contended CPU core; a quadratic decode path would take many minutes

    table = recorder.steps_table()
    steps = pd.DataFrame({k: table[k] for k in ("step", "layer", "logical_len", "hbm_tokens", "ddr_tokens",
                                                   "evicted_tokens", "recalled_tokens")})
    assert steps["step"].max() == NEW_TOKENS - 1
    decode = steps[steps["step"] >= 1]
    # Every entry has one home and nothing is evicted at evict_ratio 0.
    assert (decode["hbm_tokens"] + decode["ddr_tokens"] == decode["logical_len"]).all()
    assert (decode["evicted_tokens"] == 0).all()
    # What one step attends is linear in the context: the HBM budget (30%, plus the protected sink and window
    # and the block being filled) and at most recall_k recalled blocks -- never the whole context.
    assert (decode["hbm_tokens"] <= BUDGET * decode["logical_len"] + SINK + WINDOW + BLOCK).all()
    assert (decode["recalled_tokens"] <= RECALL_K * BLOCK).all()
    last = decode[decode["step"] == NEW_TOKENS - 1]
    assert (last["logical_len"] == len(prompt) + NEW_TOKENS - 1).all()
    assert math.isclose(last["hbm_tokens"].mean() / last["logical_len"].mean(), BUDGET, abs_tol=0.02)


# --- accounting ---------------------------------------------------------------------------------------------


def _samples(rows: list[tuple[str, bool | None]]) -> pd.DataFrame:
    return pd.DataFrame({"stop_reason": [r for r, _ in rows], "correct": pd.array([c for _, c in rows], dtype="boolean")})


def test_completion_accounting_counts_token_limit_and_finished_samples():
    # 11 samples: 3 cut by the limit (1 of them "correct": a number seen mid-thought), 6 scored that ended
    # (4 correct), 1 stopped by NaN logits (scored, neither finished nor cut), 1 unscored that ended.
    rows = ([("max_new_tokens", True), ("max_new_tokens", False), ("max_new_tokens", False)]
            + [("eos", True)] * 4 + [("eos", False)] * 2 + [("nonfinite", False), ("eos", None)])
    summary = completion_summary(_samples(rows))
    assert summary == {"n_samples": 11, "n_token_limit": 3, "n_scored": 10, "n_correct": 5,
                       "n_finished_scored": 6, "n_finished_correct": 4}
    lines = dict(completion_lines(_samples(rows)))
    low, high = wilson_interval(3, 11)
    assert lines["token limit"].startswith(f"3/11 = 27.3% [{low:.1%}, {high:.1%}] (95% Wilson CI, n=11)")
    assert lines["accuracy"].startswith("5/10 = 50.0%") and "n=10" in lines["accuracy"]
    assert lines["finished"].startswith("4/6 = 66.7%") and "n=6" in lines["finished"]


def test_completion_accounting_without_scores_or_finished_samples():
    assert completion_lines(_samples([])) == []
    only_limit = dict(completion_lines(_samples([("max_new_tokens", False)] * 2)))
    assert only_limit["token limit"].startswith("2/2 = 100.0%") and "no scored sample ended" in only_limit["finished"]
    unscored = dict(completion_lines(_samples([("eos", None)])))
    assert set(unscored) == {"token limit"}


@pytest.mark.parametrize("where", ["traces info", "report table"])
def test_the_accounting_reaches_traces_info_and_the_report(where, tmp_path):
    from traces import TraceWriter, open_run
    from traces.example import example_manifest, example_sample

    manifest = example_manifest(sample_ids=[f"s/{i}" for i in range(4)], kind="traced")
    manifest["model"]["random_weights"] = False
    run_dir = tmp_path / "run"
    with TraceWriter(run_dir, manifest) as writer:
        for i, (stop, correct) in enumerate([("max_new_tokens", False), ("eos", True), ("eos", False), ("eos", True)]):
            parts = example_sample(f"s/{i}", prompt_tokens=4, generated_tokens=2, n_layers=manifest["model"]["n_layers"])
            writer.write_sample({**parts["sample"], "stop_reason": stop, "correct": correct, "gold": "1"},
                                parts["steps"], parts["tokens"], parts["access"])
    if where == "traces info":
        from traces.cli import info_lines

        lines = info_lines(open_run(run_dir))
        assert any(line.startswith("token limit 1/4 = 25.0%") for line in lines)
        assert any(line.startswith("accuracy    2/4 = 50.0%") for line in lines)
        assert any(line.startswith("finished    2/3 = 66.7%") for line in lines)
    else:
        from analysis.load import run_table
        from analysis.tables import display_completion

        table = display_completion(run_table([open_run(run_dir)]))
        row = table.iloc[0].to_dict()
        assert row["stopped by token limit"].endswith("(1/4)") and row["accuracy, finished"].startswith("67% [")
        assert row["accuracy, all"].endswith("(2/4)")


def test_a_frozen_heap_is_frozen_inside_and_released_after_also_when_nested():
    """`thoughtkv trace` decodes in `frozen_heap` (the collector then skips the model's objects): frozen inside,
    nothing left frozen after (else every later cycle of the process would leak), an inner use keeps the
    outer freeze, and an error inside still releases it."""
    import gc

    from tracer.decode import frozen_heap

    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # torch's and transformers' objects at least
        with frozen_heap():
            pass
        # (not ==: a frozen object may die meanwhile, e.g. one another thread held last; an inner unfreeze would
        # leave none: a full suite once read 579,415 against 579,417)
        assert gc.get_freeze_count() > 0.99 * frozen
    assert gc.get_freeze_count() == 0
    try:
        with frozen_heap():
            raise KeyError("inside")
    except KeyError:
        pass
    assert gc.get_freeze_count() == 0
