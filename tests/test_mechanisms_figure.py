"""The transfer-mechanism figure (analysis/mechanisms.py): its table is simulate_run's projected numbers, and
the figure draws one bar per (profile, mechanism)."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.mechanisms import mechanism_figure, mechanism_table, write_mechanism_figure
from simulator import simulate_run
from simulator.options import Projection, SimOptions
from traces.reader import open_run

MICRO = Path(__file__).resolve().parents[1] / "traces" / "samples" / "micro-hierarchy-b30-e0"


def test_table_is_the_projected_simulation_at_the_asked_context():
    table = mechanism_table(MICRO, profiles=("gh200-96gb",), contexts=(8192,), transfers=("dma-per-block", "zero-copy"))
    assert list(table["transfer"]) == ["dma-per-block", "zero-copy"]
    samples = open_run(MICRO).samples()
    mean_final = float((samples["prompt_tokens"] + samples["generated_tokens"]).mean())
    for _, row in table.iterrows():
        summary = simulate_run(MICRO, "gh200-96gb", SimOptions(transfer=row["transfer"]),
                               projection=Projection("qwen2-7b", context_scale=8192 / mean_final)).summary
        assert row["ms_per_token"] == pytest.approx(summary["ms_per_token"], rel=1e-12)
        assert row["max_concurrency_policy"] == summary["max_concurrency_policy"]
    # zero-copy stages nothing in HBM: more sequences fit than with staged DMA recalls
    by = table.set_index("transfer")
    assert by.loc["zero-copy", "max_concurrency_policy"] > by.loc["dma-per-block", "max_concurrency_policy"]


def test_figure_has_a_bar_per_profile_and_mechanism(tmp_path):
    table = mechanism_table(MICRO, profiles=("h100-pcie", "gh200-96gb"), contexts=(8192, 32768),
                            transfers=("dma-per-block", "sm-copy", "cpu-attention"))
    figure = mechanism_figure(table)
    axes = figure.get_axes()
    assert len(axes) == 4
    assert all(len(ax.patches) == 2 * 3 for ax in axes)
    paths = write_mechanism_figure(MICRO, tmp_path, profiles=("h100-pcie",), contexts=(8192,),
                                   transfers=("dma-per-block",))
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
