"""Traffic as a first-class result: `traces.stats.traffic_summary` against what the steps
table of a real traced run of the bundled micro model implies, recomputed here row by row."""

from __future__ import annotations

import math

import pytest

from traces.stats import reference_kv_bytes_per_token, run_traffic, traffic_line, traffic_summary

pytest.importorskip("torch")


def _trace(tmp_path_factory, name: str, **policy):
    from tracer.run import TraceConfig, run_trace
    from traces.reader import open_run

    out = tmp_path_factory.mktemp(name) / "run"
    config = TraceConfig(model="micro", task="chains", out=str(out), n_samples=2, max_new_tokens=80,
                         access=False, **policy)
    return open_run(run_trace(config, progress=False))


@pytest.fixture(scope="module")
def recalling(tmp_path_factory):
    return _trace(tmp_path_factory, "recall", policy="hierarchy", hbm_budget=0.3, recall_k=4, block_size=4,
                  window_tokens=8)


@pytest.fixture(scope="module")
def recalling_other(tmp_path_factory):
    """The same method as `recalling` on other problems (seed 1): pooled with it into one table row."""
    return _trace(tmp_path_factory, "recall1", policy="hierarchy", hbm_budget=0.3, recall_k=4, block_size=4,
                  window_tokens=8, seed=1)


@pytest.fixture(scope="module")
def no_recall(tmp_path_factory):
    return _trace(tmp_path_factory, "norecall", policy="hierarchy", hbm_budget=0.3, recall_k=0, block_size=4,
                  window_tokens=8)


def _expected(trace):
    """The figures recomputed from the rows with plain Python, and H2D bytes from the recalled token counts."""
    steps = trace.steps()
    model = trace.manifest["model"]
    rows = [r for r in steps.itertuples(index=False) if r.step >= 1]
    decode_steps = {(r.sample_id, r.step) for r in rows}
    per_layer_token_bytes = model["kv_bytes_per_token"] // model["n_layers"]
    return {
        "rows": rows,
        "decode_steps": len(decode_steps),
        "attended": sum((r.hbm_tokens + r.recalled_tokens) / r.logical_len for r in rows) / len(rows),
        "hbm": sum(r.hbm_tokens / r.logical_len for r in rows) / len(rows),
        "recalled": sum(r.recalled_tokens for r in rows) / len(rows),
        "recalled_frac": sum(r.recalled_tokens / r.logical_len for r in rows) / len(rows),
        # DDR stores the KV as it is (ddr_dtype same): every recalled token costs one token's K+V of one layer.
        "h2d_from_tokens": sum(r.recalled_tokens for r in rows) * per_layer_token_bytes / len(decode_steps),
        "d2h": sum(r.bytes_d2h for r in rows) / len(decode_steps),
    }


def test_traffic_equals_what_the_steps_table_implies(recalling):
    traffic = run_traffic(recalling)
    expected = _expected(recalling)
    assert sum(r.recalled_tokens for r in expected["rows"]) > 0, "the run must recall something to test anything"
    assert traffic["decode_steps"] == expected["decode_steps"]
    assert traffic["decode_layer_steps"] == len(expected["rows"])
    assert traffic["attended_frac"] == pytest.approx(expected["attended"], rel=1e-12)
    assert traffic["hbm_frac"] == pytest.approx(expected["hbm"], rel=1e-12)
    assert traffic["recalled_tokens_per_layer_step"] == pytest.approx(expected["recalled"], rel=1e-12)
    assert traffic["recalled_frac"] == pytest.approx(expected["recalled_frac"], rel=1e-12)
    assert traffic["h2d_bytes_per_token"] == pytest.approx(expected["h2d_from_tokens"], rel=1e-12)
    assert traffic["d2h_bytes_per_token"] == pytest.approx(expected["d2h"], rel=1e-12)
    assert traffic["attended_frac"] > traffic["hbm_frac"]
    # Priced at DeepSeek-R1-Distill-Qwen-7B (28 layers x 4 KV heads x 128 x 2 bytes x K,V = 57,344 bytes/token).
    assert reference_kv_bytes_per_token() == 57_344
    per_token_micro = recalling.manifest["model"]["kv_bytes_per_token"]
    assert traffic["h2d_bytes_per_token_ref"] == pytest.approx(
        expected["h2d_from_tokens"] / per_token_micro * 57_344, rel=1e-12)


def test_no_recall_moves_nothing_host_to_device_and_attends_only_hbm(no_recall):
    traffic = run_traffic(no_recall)
    expected = _expected(no_recall)
    assert traffic["h2d_bytes_per_token"] == 0.0 and traffic["h2d_bytes_per_token_ref"] == 0.0
    assert traffic["recalled_tokens_per_layer_step"] == 0.0
    assert traffic["attended_frac"] == traffic["hbm_frac"] == pytest.approx(expected["hbm"], rel=1e-12)
    assert traffic["hbm_frac"] < 1.0  # the budget bound: something was offloaded
    assert traffic["d2h_bytes_per_token"] > 0.0  # ... and offloading is traffic too
    assert "H2D 0 B/token" in traffic_line(traffic)


def test_prefill_and_empty_tables_are_not_counted(recalling):
    steps = recalling.steps()
    prefill_only = steps[steps["step"] == 0]
    traffic = traffic_summary(prefill_only, recalling.manifest["model"]["kv_bytes_per_token"])
    assert traffic["decode_steps"] == 0 and traffic["h2d_bytes_per_token"] == 0.0
    assert math.isnan(traffic["attended_frac"])
    assert traffic_line(traffic) == "no decode steps"
    with pytest.raises(ValueError):
        traffic_summary(steps, 0)


def test_accuracy_table_carries_the_traffic_pooled_like_one_steps_table(recalling, recalling_other, no_recall):
    import pandas as pd

    from analysis import frames, load, tables

    def partial_rows(runs):
        table = tables.capacity_accuracy_table(frames.accuracy_frame(load.run_table(runs)))
        return table, table[table["method"] != frames.FULL_LABEL].reset_index(drop=True)

    # Runs that recall differently are different methods (different traffic): two rows, each its own run's.
    _, apart = partial_rows([recalling, no_recall])
    assert len(apart) == 2 and apart["method"].nunique() == 2, apart["method"].tolist()
    for run in (recalling, no_recall):
        row = apart[apart["method"].str.endswith(f"recall {run.manifest['policy']['recall_k']} blocks")].iloc[0]
        own = traffic_summary(run.steps(), run.manifest["model"]["kv_bytes_per_token"])
        assert row["attended_frac"] == pytest.approx(own["attended_frac"], rel=1e-12)
    # The same method on other problems: pooled into one row, as if their steps were one table.
    runs = [recalling, recalling_other]
    table, pooled = partial_rows(runs)
    assert len(pooled) == 1
    row = pooled.iloc[0]
    together = pd.concat([r.steps().assign(sample_id=lambda f, i=i: f"{i}:" + f["sample_id"]) for i, r in enumerate(runs)])
    expected = traffic_summary(together, recalling.manifest["model"]["kv_bytes_per_token"])
    for column in tables.TRAFFIC_WEIGHTS:
        assert row[column] == pytest.approx(expected[column], rel=1e-12), column
    shown = tables.display_capacity_accuracy(table)
    assert shown.loc[0, "attended %"] == f"{100 * expected['attended_frac']:.1f}%"
    assert "H2D/token @qwen2-7b" in shown.columns
