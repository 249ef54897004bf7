"""The options layer (thoughtkv_base/options.py): every flag of every command has one definition, its kind's
check refuses what it should and keeps what it should, and flags are not written by hand."""

from __future__ import annotations

import argparse
import re

import pytest
from conftest import REPO
from hypothesis import given
from hypothesis import strategies as st

from thoughtkv.cli import build_parser, main
from thoughtkv_base import SEED_MAX
from thoughtkv_base.options import (
    FRACTION,
    POSITIVE_INT,
    SEED,
    SHARD,
    SHARED,
    Flag,
    OptionValueError,
    Shard,
    add_flags,
)

PACKAGES = ("thoughtkv", "tracer", "simulator", "analysis", "traces", "hwprofiles")
MAX_HAND_WRITTEN = 60  # add_argument( calls in the packages


def all_actions(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from all_actions(child, (*prefix, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield " ".join(prefix), action


def test_every_flag_of_every_command_has_one_definition():
    """Walk the whole parser tree: each option was made by the options layer from a row (`action.definition`),
    and a flag name that several commands take comes from the same row everywhere."""
    rows: dict[str, set[int]] = {}
    where: dict[str, list[str]] = {}
    hand_written = []
    for command, action in all_actions(build_parser()):
        definition = getattr(action, "definition", None)
        label = action.option_strings[-1] if action.option_strings else action.dest
        if definition is None:
            hand_written.append(f"{command} {label}")
            continue
        for name in action.option_strings:
            if name.startswith("--"):
                rows.setdefault(name, set()).add(id(definition))
                where.setdefault(name, []).append(command)
    assert not hand_written, f"options not made by thoughtkv_base.options.add_flags: {hand_written}"
    twice = {name: where[name] for name, ids in rows.items() if len(ids) > 1}
    assert not twice, f"flags defined in more than one place: {twice}"
    assert len(where["--out"]) > 10 and len(where["--seed"]) >= 4  # the walk reaches the shared settings


def test_flags_are_not_written_by_hand():
    calls = {path: len(re.findall(r"add_argument\(", path.read_text()))
             for package in PACKAGES for path in (REPO / package).rglob("*.py")}
    assert sum(calls.values()) <= MAX_HAND_WRITTEN, {str(p.relative_to(REPO)): n for p, n in calls.items() if n}


def test_a_use_keeps_the_rows_kind_and_name():
    use = SHARED["n_samples"].use(default=100, help="problems per cell")
    assert use.definition is SHARED["n_samples"] and use.kind is POSITIVE_INT and use.name == "--n-samples"
    with pytest.raises(TypeError, match="cannot change kind"):
        SHARED["n_samples"].use(kind=SEED)


def parse(flag: Flag, *argv: str):
    parser = argparse.ArgumentParser()
    add_flags(parser, flag)
    return getattr(parser.parse_args(list(argv)), flag.key)


@given(st.integers(-10**6, 10**6))
def test_positive_int_keeps_exactly_the_whole_numbers_from_one(value):
    flag = SHARED["workers"]
    if value >= 1:
        assert parse(flag, "--workers", str(value)) == value
    else:
        with pytest.raises(OptionValueError, match=f"--workers {value}: give at least 1"):
            parse(flag, "--workers", str(value))


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_fraction_keeps_exactly_the_interval_zero_to_one(value):
    flag = Flag("--share", "a share", FRACTION)
    if 0 < value <= 1:
        assert parse(flag, f"--share={value!r}") == value
    else:
        with pytest.raises(OptionValueError, match="--share"):
            parse(flag, f"--share={value!r}")


@given(st.integers(-2, SEED_MAX + 2))
def test_seed_is_the_one_seed_rule(value):
    from thoughtkv_base import check_seed

    flag = SHARED["seed"]
    try:
        expected = check_seed(value)
    except Exception as exc:  # noqa: BLE001 - the reference's refusal, whatever its type
        with pytest.raises(OptionValueError) as refused:
            parse(flag, f"--seed={value}")
        assert str(refused.value) == str(exc)
    else:
        assert parse(flag, f"--seed={value}") == expected


@pytest.mark.parametrize("text, expected", [("0/1", Shard(0, 1)), ("1/3", Shard(1, 3)), ("3/3", None),
                                            ("-1/2", None), ("a/b", None), ("2", None), ("", None)])
def test_shard(text, expected):
    if expected is None:
        with pytest.raises(OptionValueError, match="give I/N"):
            SHARD(text, "--shard")
    else:
        assert SHARD(text, "--shard") == expected


def test_append_and_lists_check_every_value():
    flag = SHARED["workers"].use(nargs="+")
    assert parse(flag, "--workers", "1", "2") == [1, 2]
    with pytest.raises(OptionValueError, match="--workers 0"):
        parse(flag, "--workers", "1", "0")


def test_a_bad_value_is_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["trace", "--model", "micro", "--task", "chains", "--out", str(out), "--threads", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "thoughtkv trace: error: --threads 0: give at least 1 (--threads must be >= 1)"
    assert not out.exists()


def test_an_output_under_a_file_is_refused_before_anything_runs(tmp_path, capsys):
    junk = tmp_path / "notes.txt"
    junk.write_text("keep me\n")
    assert main(["simulate", str(REPO / "traces" / "samples" / "micro-hierarchy-b30-e0"), "--profile", "h100-pcie",
                 "--out", str(junk / "sim")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert junk.read_text() == "keep me\n"
    assert parse(SHARED["out"], "--out", str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper"
