"""`thoughtkv trace` with the policy contract's newer settings: --recall-budget, --recall-rule quest-per-head and
--batch-size reach run.json and the recorded rows; a simulator-only recall rule is refused in one line."""

from __future__ import annotations

import json
import math

import pytest

from thoughtkv.cli import main
from traces import open_run
from traces.policy import RECALL_RULES

COMMON = ["trace", "--model", "micro", "--task", "chains", "--n-samples", "3", "--policy", "hierarchy", "--hbm-budget",
          "0.3", "--block-size", "4", "--window-tokens", "8", "--max-new-tokens", "24", "--quiet"]


def test_recall_budget_rule_and_batch_size_are_recorded_and_applied(tmp_path):
    out = tmp_path / "run"
    args = [*COMMON, "--recall-budget", "0.2", "--recall-rule", "quest-per-head", "--batch-size", "2", "--out", str(out)]
    assert main(args) == 0
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["policy"]["recall_rule"] == RECALL_RULES["quest-per-head"]
    assert manifest["policy"]["params"]["recall_budget"] == 0.2
    assert manifest["tracer"]["batch_size"] == 2
    steps = open_run(out).steps()
    decode = steps[steps.query_tokens == 1]
    n_kv_heads = manifest["model"]["n_kv_heads"]
    per_head = decode.logical_len.map(lambda n: math.ceil(0.2 * n - 1e-9) // 4)  # each head's own picks
    recalled = decode.recalled_block_ids.map(len)
    # The union of the heads' picks: at least one head's count, at most all heads', never more than DDR holds.
    assert (recalled >= per_head.clip(upper=decode.ddr_blocks)).all()
    assert (recalled <= (per_head * n_kv_heads).clip(upper=decode.ddr_blocks)).all()
    assert (recalled > per_head).any()  # the heads disagreed: more blocks moved than one head picked


def test_a_simulator_only_recall_rule_is_refused_in_one_line(tmp_path, capsys):
    assert main([*COMMON, "--recall-rule", "query", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--recall-rule query is simulator-only" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag,value", [("--batch-size", "0"), ("--recall-budget", "1.5")])
def test_bad_batch_or_recall_budget_is_refused(flag, value, tmp_path, capsys):
    assert main([*COMMON, flag, value, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and len(err.splitlines()) == 1
