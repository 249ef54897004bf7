"""`thoughtkv analyze correlation`: per-sample Spearman between scorers, mean with a bootstrap CI."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from analysis.correlation import bootstrap_mean_ci, correlation_table, scorer_importances
from thoughtkv.cli import main
from traces import TraceWriter, open_run
from traces.example import example_manifest, example_sample

N_SAMPLES, PROMPT, GENERATED, LAYERS = 12, 30, 40, 2


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks by argsort (the test data have no ties): an independent route from pandas' average ranks."""
    ranks = np.empty(len(x))
    ranks[np.argsort(x)] = np.arange(len(x))
    return ranks


def write_run(path, make_scores, also: bool = True):
    """A synthetic run whose tokens carry importance_by_scorer = make_scores(attention, rng) per sample."""
    ids = [f"synthetic/{i}" for i in range(N_SAMPLES)]
    writer = TraceWriter(path, example_manifest(sample_ids=ids))
    expected = {}
    for index, sample_id in enumerate(ids):
        parts = example_sample(sample_id, prompt_tokens=PROMPT, generated_tokens=GENERATED, n_layers=LAYERS, seed=index)
        rng = np.random.default_rng(index)
        attention = parts["tokens"]["importance"].astype(np.float64)
        attention += rng.uniform(0, 1e-2, attention.shape) * attention.mean()  # the access model repeats values within a block
        parts["tokens"]["importance"] = attention.astype(np.float32)
        scores = make_scores(parts["tokens"]["importance"].astype(np.float64), rng)
        if also:
            parts["tokens"]["importance_by_scorer"] = [
                {name: float(values[i]) for name, values in scores.items()} for i in range(len(attention))
            ]
        writer.write_sample(parts["sample"], parts["steps"], parts["tokens"], parts["access"])
        cached = slice(0, len(attention) - 1)  # the last token is never cached: left out
        expected[sample_id] = {name: values[cached].astype(np.float32) for name, values in scores.items()}  # as stored
        expected[sample_id]["attention"] = parts["tokens"]["importance"][cached].astype(np.float64)
    return expected


def _scores(attention, rng):
    n = len(attention)
    return {
        "mirror": -attention * 3.0 + 1.0,  # perfectly anti-monotone: -1
        "same_order": np.sqrt(attention + 1e-3),  # monotone: +1
        "noisy": attention + rng.normal(0, np.std(attention) * 0.7, n),  # positive, below 1
        "unrelated": rng.normal(0, 1, n),  # ~0
    }


def test_spearman_per_sample_and_mean_match_an_independent_computation(tmp_path):
    expected = write_run(tmp_path / "run", _scores)
    importances = scorer_importances(open_run(tmp_path / "run").tokens())
    assert len(importances) == N_SAMPLES * (PROMPT + GENERATED - 1)
    table = correlation_table(importances, ["attention", "mirror", "same_order", "noisy", "unrelated"]).set_index(["scorer_a", "scorer_b"])
    for (a, b), row in table.iterrows():
        assert all(len(np.unique(e[a])) == len(e[a]) for e in expected.values())  # no ties: argsort ranks are exact
        per_sample = [np.corrcoef(_ranks(e[a]), _ranks(e[b]))[0, 1] for e in expected.values()]
        assert row.n_samples == N_SAMPLES
        assert row.mean_spearman == pytest.approx(np.mean(per_sample), abs=1e-5)
        assert row.ci_low <= row.mean_spearman <= row.ci_high
    assert table.loc[("attention", "mirror"), "mean_spearman"] == pytest.approx(-1.0, abs=1e-6)
    assert table.loc[("attention", "same_order"), "mean_spearman"] == pytest.approx(1.0, abs=1e-6)
    assert 0.3 < table.loc[("attention", "noisy"), "mean_spearman"] < 0.95
    unrelated = table.loc[("attention", "unrelated")]
    assert unrelated.ci_low < 0 < unrelated.ci_high  # the interval covers the true 0


def test_bootstrap_interval_has_the_normal_width_for_many_samples():
    values = np.random.default_rng(0).normal(0.2, 0.5, 400)
    mean, low, high = bootstrap_mean_ci(values, seed=1)
    assert mean == pytest.approx(values.mean())
    half_width = 1.96 * values.std(ddof=1) / np.sqrt(len(values))  # the t/normal interval it must approach
    assert (high - low) / 2 == pytest.approx(half_width, rel=0.1)
    assert np.isnan(bootstrap_mean_ci(np.array([0.3]))[1])


def test_cli_writes_table_and_figure(tmp_path, capsys):
    write_run(tmp_path / "run", _scores)
    out = tmp_path / "report"
    assert main(["analyze", "correlation", str(tmp_path / "run"), "--scorers", "attention,mirror,noisy", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "attention vs mirror" in printed and "-1.000" in printed
    csv = (out / "correlation.csv").read_text().splitlines()
    assert csv[0].startswith("scorer_a,scorer_b,n_samples,mean_spearman") and len(csv) == 4
    assert (out / "correlation.png").stat().st_size > 1000 and (out / "correlation.pdf").exists()


def test_cli_errors_are_one_line(tmp_path, capsys):
    write_run(tmp_path / "plain", _scores, also=False)
    write_run(tmp_path / "run", _scores)
    cases = [
        (["analyze", "correlation", str(tmp_path / "plain")], "--also-score"),
        (["analyze", "correlation", str(tmp_path / "run"), "--scorers", "attention,gradient"], "no importances for gradient"),
        (["analyze", "correlation", str(tmp_path / "nowhere")], "nowhere"),
        (["analyze"], "correlation"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


def test_analysis_never_imports_torch():
    code = "import sys, analysis.correlation, analysis.analyze_cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
