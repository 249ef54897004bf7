"""The recall design space's settings and row lookups that its table, served point and agreement share (one home,
so the three modules import it and not each other)."""

from __future__ import annotations

from pathlib import Path

LATENCY_BUFFER = 32  # the recall buffer (blocks per layer and sequence) of the "with the buffer" latencies
AGREEMENT_CELL = (0.3, 0.2)  # (HBM, recall budget) the agreement is measured at
AGREEMENT_N = 32
SERVED_RECALL = 0.2  # the capacity_served.csv row whose knee batch the latencies use: the hierarchy at 30%, this recall


def served_run_name(recall_budget: float) -> str:
    """The trace run (its directory name, capacity_served.csv's run_dir) of capacity-served's hierarchy row at 30%
    HBM and this recall budget: rows are matched by run, not by their display label."""
    from tracer.micro.table_long import HIERARCHY_SCORER, KEY_BUDGET, Cell

    return Cell("hierarchy", KEY_BUDGET, HIERARCHY_SCORER, 0.0, recall_budget).name


def served_rows(path: Path, recall_budget: float) -> dict[str, dict]:
    """Per profile, capacity_served.csv's row for `served_run_name(recall_budget)`."""
    import csv

    name = served_run_name(recall_budget)
    return {r["profile"]: r for r in csv.DictReader(path.open()) if Path(r.get("run_dir") or "").name == name}


def best_row(rows: list[dict]) -> dict:
    """The most accurate row (ties: the fewer H2D bytes per token)."""
    return max(rows, key=lambda r: (r["accuracy"], -r["buffers"]["0"]["h2d_bytes_per_token_ref"]))
