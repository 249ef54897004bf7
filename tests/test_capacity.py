"""Capacity as served (`thoughtkv capacity`, analysis/serving.py): the rate search brackets and refines the knee,
the max sustainable rate is sustainable and the next swept rate is not, a link-bound policy's max rate stays
under what its link can carry, cached cells are reused, and the report section names what was priced."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.serving import bracket, capacity_table, limit, sustainable
from hwprofiles import load_profile
from thoughtkv.capacity import REFINE_POINTS, next_rates

SAMPLES = Path(__file__).resolve().parents[1] / "traces" / "samples"


@pytest.mark.parametrize("rates,ok,expected", [
    ([1, 2, 4, 8], [True, True, False, False], (2.0, 4.0)),
    ([8, 1, 4, 2], [False, True, False, True], (2.0, 4.0)),  # any order
    ([1, 2, 4], [True, True, True], (4.0, None)),
    ([1, 2, 4], [False, True, True], (None, 1.0)),  # a failure below a success: the lowest failure decides
    ([1, 2, 4, 8], [True, False, True, True], (1.0, 2.0)),
])
def test_bracket(rates, ok, expected):
    assert bracket(rates, ok) == expected


@pytest.mark.parametrize("threshold", [0.013, 3.7, 50.0, 333.0])
def test_rate_search_brackets_then_refines_to_the_threshold(threshold):
    """With sustainable(r) = r <= threshold, the search (doubling / halving, then REFINE_POINTS per round) ends
    with a bracket around the threshold whose width shrinks by (REFINE_POINTS + 1) in log per refine round."""
    rates, refine, done = [1.0, 2.0, 4.0, 8.0], 2, {"refine": 0, "extend": 0}
    for _ in range(refine + 9):
        more, kind = next_rates(rates, [r <= threshold for r in rates], done["refine"], done["extend"], refine)
        if kind is None:
            break
        done[kind] += 1
        rates = sorted(set(rates) | set(more))
    assert done["refine"] == refine
    low, high = bracket(rates, [r <= threshold for r in rates])
    assert low <= threshold < high
    assert math.log(high / low) <= math.log(2) / (REFINE_POINTS + 1) ** refine * 1.01 + 1e-3  # rounding to 4 digits


def row(**values):
    base = dict(link_util_h2d=0.1, link_util_d2h=0.05, hbm_occupancy_peak=0.3, gpu_busy_frac=0.4, tbt_p99_s=0.02,
                n_rejected=0, max_concurrency=10, max_batch=64)
    return pd.Series({**base, **values})


@pytest.mark.parametrize("values,expected", [
    (dict(link_util_h2d=0.8, gpu_busy_frac=0.6, tbt_p99_s=0.3), "link bandwidth"),
    (dict(link_util_d2h=0.9), "link bandwidth"),
    (dict(hbm_occupancy_peak=0.97, gpu_busy_frac=0.8), "HBM capacity"),
    (dict(hbm_occupancy_peak=0.985, gpu_busy_frac=0.999), "HBM capacity"),  # a full HBM beside a busy GPU
    (dict(hbm_occupancy_peak=0.5, gpu_busy_frac=0.95, tbt_p99_s=0.3), "GPU compute"),  # HBM half full: not it
    (dict(max_concurrency=64, gpu_busy_frac=0.99), "batch limit"),
    (dict(n_rejected=3, gpu_busy_frac=0.99), "requests larger than HBM"),
    (dict(gpu_busy_frac=float("nan"), link_util_h2d=float("nan"), link_util_d2h=float("nan")), "HBM capacity"),
])
def test_limit_names_the_resource_nearest_saturation_at_the_first_failing_rate(values, expected):
    assert limit(row(**values), 0.1, 10.0, never_failed=False) == expected
    assert limit(row(**values), 0.1, 10.0, never_failed=True) == "none reached"


def test_sustainable_needs_tbt_ttft_and_no_rejection():
    table = pd.DataFrame({"tbt_p99_s": [0.05, 0.2, 0.05, 0.05, np.nan, 0.09],
                          "tbt_p99_late_s": [0.05, 0.2, 0.05, 0.05, 0.05, 0.12],  # the last third's TBT counts too
                          "ttft_p99_s": [1.0, 1.0, 30.0, 1.0, 1.0, 1.0], "n_rejected": [0, 0, 0, 2, 0, 0]})
    assert sustainable(table, 0.1, 10.0).tolist() == [True, False, False, False, False, False]
    assert sustainable(table, 0.1, None).tolist() == [True, False, True, False, False, False]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """`thoughtkv capacity` on the bundled micro full-cache and hierarchy traces at qwen2-7b's shapes on h100-pcie
    (traced lengths: ~130 tokens, so a 40 s window is several request lifetimes); the CLI's own flags."""
    from thoughtkv.cli import main

    out = tmp_path_factory.mktemp("capacity") / "out"
    argv = ["capacity", str(SAMPLES / "micro-full"), str(SAMPLES / "micro-hierarchy-b30-e0"), "--profile", "h100-pcie",
            "--as-model", "qwen2-7b", "--overhead-mode", "cuda-graphs", "--transfer", "dma-batched", "--max-batch",
            "4096", "--duration-s", "40", "--rates", "8,32,128", "--refine", "1", "--workers", "1", "--out", str(out)]
    assert main(argv) == 0
    return out, argv


def test_max_rate_is_sustainable_and_the_next_swept_rate_is_not(swept):
    out, _ = swept
    table = pd.read_csv(out / "report" / "tables" / "serving.csv")
    capacity = pd.read_csv(out / "report" / "tables" / "capacity_served.csv")
    assert len(capacity) == 2
    recomputed = capacity_table(table.drop(columns="sustainable", errors="ignore"), 0.1, 10.0)
    for _, c in capacity.iterrows():
        rows = table[table["run_dir"] == c["run_dir"]].set_index("rate_per_s")
        tbt = rows[["tbt_p99_s", "tbt_p99_late_s"]].max(axis=1)  # over all tokens and the window's last third
        assert tbt[c["max_rate_per_s"]] <= 0.1 and rows.loc[c["max_rate_per_s"], "ttft_p99_s"] <= 10
        assert tbt[c["first_failing_rate_per_s"]] > 0.1 or rows.loc[c["first_failing_rate_per_s"], "ttft_p99_s"] > 10
        below = rows.index < c["max_rate_per_s"]
        assert ((tbt[below] <= 0.1) & (rows.loc[below, "ttft_p99_s"] <= 10)).all()
        assert (rows["tbt_p99_late_s"] >= 0).all()
        assert recomputed.set_index("run_dir").loc[c["run_dir"], "max_rate_per_s"] == c["max_rate_per_s"]
    # the refine round put REFINE_POINTS rates inside each bracket of the first round
    assert (table.groupby("run_dir")["rate_per_s"].nunique() >= 2 + REFINE_POINTS).all()


def test_the_link_carries_no_more_than_its_bandwidth_at_the_knee(swept):
    """The hierarchy recalls over PCIe: at its max sustainable rate the offered H2D load (rate x bytes each
    request recalls) is at most the link's H2D bandwidth, at the first failing rate it is above half of it, and
    the link is what stops it."""
    out, _ = swept
    table = pd.read_csv(out / "report" / "tables" / "serving.csv")
    capacity = pd.read_csv(out / "report" / "tables" / "capacity_served.csv").set_index("policy")
    hierarchy = capacity.loc["hierarchy"]
    rows = table[table["policy"] == "hierarchy"].set_index("rate_per_s")
    link = load_profile("h100-pcie").link

    def offered_bytes_per_s(rate: float) -> float:
        return rate * rows.loc[rate, "bytes_h2d"] / rows.loc[rate, "n_requests"]

    # Poisson: a finite window's arrivals vary around the rate, and a window barely over capacity still drains
    assert offered_bytes_per_s(hierarchy["max_rate_per_s"]) <= 1.1 * link.h2d_bytes_per_s
    assert offered_bytes_per_s(hierarchy["first_failing_rate_per_s"]) > 0.5 * link.h2d_bytes_per_s
    assert hierarchy["limit"] == "link bandwidth"
    assert capacity.loc["full", "max_rate_per_s"] > hierarchy["max_rate_per_s"]  # no link, same HBM reads or fewer


def test_rerun_recomputes_nothing_and_names_what_was_priced(swept, capsys):
    from thoughtkv.cli import main

    out, argv = swept
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "computed" in err and all("(0 computed)" in line for line in err.splitlines() if "cells (" in line)
    section = (out / "report" / "serving.md").read_text()
    assert "projected to qwen2-7b" in section and "traced request lengths" in section
    assert "overheads cuda-graphs (host term cited)" in section
    assert all((out / "report" / "figures" / f"{stem}.png").is_file()
               for stem in ("serving_frontier", "serving_goodput", "serving_tbt", "serving_knee"))


@pytest.mark.parametrize("extra,message", [
    (["--profile", "h100-pcie", "--rates", "1,-2"], "--rates"),
    (["--profile", "h100-pcie", "--rates", "x"], "--rates"),
    ([], "--profile"),
    (["--profile", "h100-pcie", "--lengths", "r1-7b/gsm8k", "--as-model", "qwen2-7b", "--context-scale", "2"],
     "context-scale"),
    (["--profile", "h100-pcie", "--refine", "-1"], "--refine"),
])
def test_capacity_refuses_bad_input_in_one_line(tmp_path, capsys, extra, message):
    from thoughtkv.cli import main

    assert main(["capacity", str(SAMPLES / "micro-full"), "--out", str(tmp_path / "o"), *extra]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], lines


def test_the_served_table_puts_peak_reservation_beside_paged_and_the_limits_figures():
    """capacity-served's rows: paged admission's max rate, the peak-reservation sweep's beside it, and the limit
    with the shares it was read from."""
    from analysis.serving import capacity_markdown
    from thoughtkv.experiments.capacity_served import one_sentence, with_peak_column

    def capacity(rates, limits):
        return pd.DataFrame([{
            "run_dir": f"/r/{label}", "profile": "gh200-96gb", "label": label, "policy": policy,
            "max_rate_per_s": rate, "first_failing_rate_per_s": rate * 1.1, "limit": lim, "fail_link": 0.2,
            "fail_hbm": 0.55, "fail_gpu": 0.97, "accuracy": acc, "ci_low": acc - 0.05, "ci_high": min(1, acc + 0.05),
            "n_scored": 200, "attended_frac": 0.5, "h2d_bytes_per_token_served": 0.0, "knee_link_util_h2d": 0.1,
            "knee_hbm_occupancy": 0.4, "knee_tbt_p99_s": 0.05}
            for (label, policy, acc), rate, lim in zip(
                (("full cache", "full", 1.0), ("hierarchy 30%, recall ≤ 20%", "hierarchy", 0.3)), rates, limits)])

    paged = capacity([60.0, 40.0], ["GPU compute", "GPU compute"])
    merged = with_peak_column(paged, capacity([50.0, 30.0], ["HBM capacity", "HBM capacity"]))
    table = capacity_markdown(merged)
    assert "peak reservation (req/s)" in table.splitlines()[0]
    assert "| gh200-96gb | full cache | 60 | 50 | GPU compute | link 20% · HBM 55% · GPU 97% |" in table
    sentence = one_sentence(merged, "p99 TBT ≤ 100 ms")
    assert "sustains 60 req/s on gh200-96gb (GPU compute on gh200-96gb; 50 reserving each request's peak KV)" in sentence
    assert "(30 with peak reservation)" in sentence


def test_the_real_models_served_rows_name_their_hbm_budget_and_carry_their_cells_fidelity(tmp_path):
    """One rule at two HBM budgets is two rows (and two figure series): each names its budget and carries the
    fidelity of its own cell, profiles in the document's order."""
    from simulator.options import ServingConfig
    from thoughtkv.experiments import real_model_served

    cells = {"hier-quest-r10-b30": (0.3, 0.9), "hier-quest-r10-b50": (0.5, 0.95), "full": (1.0, 1.0)}
    capacity = pd.DataFrame([{
        "run_dir": f"/r/{cell}", "profile": profile, "hbm_budget": budget, "max_rate_per_s": 10.0 * budget,
        "first_failing_rate_per_s": 11.0 * budget, "limit": "GPU compute", "attended_frac": budget,
        "h2d_bytes_per_token_served": 0.0, "knee_link_util_h2d": 0.1, "knee_hbm_occupancy": 0.4}
        for profile in reversed(real_model_served.PROFILES) for cell, (budget, _) in cells.items()])
    fidelity = {cell: {"hbm_budget": budget, "kl": 1 - top1, "kl_low": 0.0, "kl_high": 1.0, "top1": top1,
                       "top1_low": top1 - 0.01, "top1_high": top1, "n": 100}
                for cell, (budget, top1) in cells.items() if cell != "full"}
    labels = {cell: "hierarchy quest, recall ≤ 10%" for cell in cells}
    path = real_model_served.write(tmp_path, capacity, ServingConfig(), fidelity, labels)
    rows = [line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("| h")
            or line.startswith("| g")]
    assert [row.split(" | ")[0].strip("| ") for row in rows] == [p for p in real_model_served.PROFILES for _ in cells]
    assert f"| {real_model_served.PROFILES[0]} | hierarchy quest, recall ≤ 10% at 30% HBM | 3 |" in rows[0]
    assert "| hierarchy quest, recall ≤ 10% at 50% HBM | 5 |" in rows[1] and "| 95.0 [94.0, 95.0] |" in rows[1]
    assert "| full cache | 10 |" in rows[2] and "| 100.0 [100.0, 100.0] | 0.000 |" in rows[2]
    assert (tmp_path / "figures" / f"{real_model_served.FIGURE_STEM}.png").stat().st_size > 0
