"""A model's trace defaults ship with its weights (tracer/model_defaults.py, `trace_defaults.json`): one home that
`trace`, the demo and the capacity tables read, explicit flags win, run.json records what came from the model.

The reference for "the model's defaults" is the JSON file itself, read here with `json` (not through the module).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from thoughtkv.cli import main
from tracer.model_defaults import BUNDLED_MODELS, FILE_NAME, KEYS, resolve, tool_defaults, trace_defaults
from tracer.run import TraceConfig
from traces import open_run
from traces.policy import PolicySpec


def shipped(model: str) -> dict:
    return json.loads((BUNDLED_MODELS[model] / FILE_NAME).read_text())


@pytest.mark.parametrize("model", sorted(BUNDLED_MODELS))
def test_every_bundled_model_ships_valid_trace_defaults(model):
    values = shipped(model)
    assert set(values) <= set(KEYS) and {"block_size", "sink_tokens", "window_tokens", "max_new_tokens"} <= set(values)
    PolicySpec(policy="hierarchy", **{k: v for k, v in values.items() if k != "max_new_tokens"})  # the contract accepts them
    assert trace_defaults(model) == values


@pytest.mark.parametrize("model", sorted(BUNDLED_MODELS))
def test_trace_config_takes_the_models_defaults_and_records_them(model, tmp_path):
    values = shipped(model)
    config = TraceConfig(model=model, task="chains", out=str(tmp_path / "run"), policy="hierarchy", hbm_budget=0.3)
    for key, value in values.items():
        assert getattr(config, key) == value
    assert config.from_model == values
    # Outside the hierarchy nothing is recalled: the model's recall setting is neither taken nor recorded.
    full = TraceConfig(model=model, task="chains", out=str(tmp_path / "run"))
    assert not set(full.from_model) & {"recall_k", "recall_budget"}
    assert full.spec.recall_budget is None


def test_explicit_values_win_and_are_not_recorded_as_the_models(tmp_path):
    config = TraceConfig(model="micro_long", task="chains_long", out=str(tmp_path / "r"), policy="hierarchy",
                         block_size=8, max_new_tokens=40, recall_k=3)
    assert (config.block_size, config.max_new_tokens, config.recall_k) == (8, 40, 3)
    assert config.recall_budget is None  # an explicit recall_k keeps the model's recall budget out
    assert set(config.from_model) == {"sink_tokens", "window_tokens"}


def test_a_model_without_defaults_gets_the_tools(tmp_path):
    config = TraceConfig(model="random:tiny", task="chains", out=str(tmp_path / "r"))
    spec = PolicySpec()
    assert (config.block_size, config.window_tokens, config.max_new_tokens) == (
        spec.block_size, spec.window_tokens, tool_defaults()["max_new_tokens"])
    assert config.from_model == {}


def test_reconstructing_a_config_keeps_it(tmp_path):
    """The demo ships configs to worker processes as dicts: rebuilt, a config is the same config."""
    import dataclasses

    config = TraceConfig(model="micro_long", task="chains_long", out=str(tmp_path / "r"), policy="hierarchy")
    assert TraceConfig(**dataclasses.asdict(config)) == config


def test_trace_at_the_defaults_records_what_came_from_the_model_and_recalls(tmp_path, capsys):
    """The issue's command: micro_long, a hierarchy with a recall budget, no geometry flags. It used to run at
    block 16 / window 32 and recall nothing; at the model's defaults it recalls."""
    out = tmp_path / "run"
    assert main(["trace", "--model", "micro_long", "--task", "chains_long", "--policy", "hierarchy", "--hbm-budget",
                 "0.3", "--recall-budget", "0.1", "--max-new-tokens", "120", "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "micro_long's trace_defaults.json sets --block-size 4 --sink-tokens 4 --window-tokens 16" in err
    run = open_run(out)
    values = shipped("micro_long")
    assert run.manifest["tracer"]["from_model"] == {k: values[k] for k in ("block_size", "sink_tokens", "window_tokens")}
    assert run.manifest["policy"]["block_size"] == values["block_size"]
    steps = run.steps()
    assert steps.loc[steps["step"] > 0, "recalled_tokens"].sum() > 0


def test_full_cache_at_the_defaults_finishes_every_sample(tmp_path):
    """At the model's defaults (its decode limit included) the full cache ends every sample at <eos> with the
    right answer: the documented full-cache accuracy (500/500; a 40-sample run measured 40/40), on 3 here."""
    out = tmp_path / "run"
    assert main(["trace", "--model", "micro_long", "--task", "chains_long", "--n-samples", "3", "--out", str(out),
                 "--quiet"]) == 0
    samples = open_run(out).samples()
    assert (samples["stop_reason"] == "eos").all() and samples["correct"].all()


def test_the_capacity_tables_read_the_same_file():
    from tracer.micro import table, table_long

    long_values, micro_values = shipped("micro_long"), shipped("micro")
    assert (table_long.BLOCK_SIZE, table_long.SINK_TOKENS, table_long.WINDOW_TOKENS, table_long.MAX_NEW_TOKENS) == \
        tuple(long_values[k] for k in ("block_size", "sink_tokens", "window_tokens", "max_new_tokens"))
    assert (table.BLOCK_SIZE, table.RECALL_K, table.MAX_NEW_TOKENS) == \
        tuple(micro_values[k] for k in ("block_size", "recall_k", "max_new_tokens"))


def test_the_demo_resolves_the_same_values():
    from thoughtkv.demo import resolve_model_defaults

    args = argparse.Namespace(model="micro_long", block_size=None, window_tokens=None, max_new_tokens=None,
                              recall_budget=None)
    resolve_model_defaults(args)
    values = shipped("micro_long")
    assert {k: getattr(args, k) for k in values} == values
    assert args.given_settings == {}  # the runs' TraceConfig takes them from the model itself (and records them)
    args = argparse.Namespace(model="micro_long", block_size=8, window_tokens=None, max_new_tokens=None,
                              recall_budget=None)
    resolve_model_defaults(args)
    assert args.block_size == 8 and args.given_settings == {"block_size": 8}


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not readable JSON"),
    ('{"block_size": 4, "speed": "fast"}', "unknown key(s) speed"),
    ('{"block_size": 0}', "--block-size 0 must be a whole number >= 1"),
    ('{"max_new_tokens": -5}', "max_new_tokens -5 must be a whole number >= 1"),
])
def test_a_broken_trace_defaults_file_is_refused_in_one_line(content, problem, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODELS["micro"], model)
    (model / FILE_NAME).write_text(content)
    out = tmp_path / "run"
    assert main(["trace", "--model", str(model), "--task", "chains", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and problem in err and FILE_NAME in err
    assert not out.exists()


def test_resolve_treats_the_recall_pair_as_one_setting():
    values, from_model = resolve("micro_long", {"recall_k": 6})
    assert values["recall_k"] == 6 and values["recall_budget"] is None and "recall_budget" not in from_model
    values, from_model = resolve("micro_long", {})
    assert values["recall_budget"] == shipped("micro_long")["recall_budget"] == from_model["recall_budget"]
    assert resolve("micro_long", {}, policy="evict")[0]["recall_budget"] is None


def test_a_local_model_directory_carries_its_own_defaults(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODELS["micro"], model)
    (model / FILE_NAME).write_text('{"block_size": 8, "max_new_tokens": 7}')
    config = TraceConfig(model=str(model), task="chains", out=str(tmp_path / "r"))
    assert (config.block_size, config.max_new_tokens) == (8, 7)
    assert config.from_model == {"block_size": 8, "max_new_tokens": 7}
    assert Path(model / FILE_NAME).is_file()
