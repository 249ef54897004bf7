"""Every command-line flag of every command, defined once: its value kind, its check, its help and default.

Lives at the bottom layer (`thoughtkv_base`, which imports nothing of the project) so that every package's
command may use it without breaking the import contracts. Three pieces:

- **Kinds** (`POSITIVE_INT`, `FRACTION`, `SEED`, `SHARD`, `OUTPUT_PATH`, ...): a value's syntax (argparse's
  `type=`, so a non-number is argparse's one-line refusal) and its range check, run as the flag is parsed. A value
  out of range raises `OptionValueError`, a `UserError`: `thoughtkv` prints one line naming the flag and exits 2
  before the command runs, so nothing is written.
- **Flags** (`Flag`): one row per setting. `SHARED` is the table of the settings several commands take (output,
  sampling, model, execution); a command's own settings are rows in its own module, and an options dataclass's
  fields become rows through `dataclass_flags` (the simulator's `SimOptions`, the policy contract's
  `PolicySpec`). A command that takes a shared setting with its own default, help or arity says so with
  `Flag.use(...)`: the kind, the check and the name stay the row's.
- **`add_flags(parser, ...)`**: the one place that calls argparse's `add_argument`. Each action it makes carries
  its row (`action.definition`), so a test walks the whole parser tree and checks that every flag name has one
  definition (tests/test_options.py).

    from thoughtkv_base.options import SHARED, Flag, POSITIVE_INT, add_flags

    OWN = (Flag("--steps", "decode steps timed per run", POSITIVE_INT, default=64),)
    add_flags(parser, SHARED["out"].use(help="where the runs go", required=True), "n_samples", *OWN)
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

from thoughtkv_base import UserError, check_seed


class OptionValueError(UserError):
    """A flag's value outside its kind's range (one line naming the flag and the fix; exit 2)."""


# ---------------------------------------------------------------- kinds ---------------------------------------


@dataclass(frozen=True)
class Kind:
    """A value's syntax (`parse`, argparse's type) and its check (`check(value, flag) -> value`, raising
    OptionValueError), run as the flag is parsed; `metavar` names it in the help."""

    parse: Callable[[str], Any]
    check: Callable[[Any, str], Any] | None = None
    metavar: str | None = None

    def __call__(self, text: str, flag: str = "value"):
        """Parse and check one value as the command line would (for callers outside argparse)."""
        value = self.parse(text)
        return self.check(value, flag) if self.check else value


def _at_least_one(value: int, flag: str) -> int:
    if value < 1:
        raise OptionValueError(f"{flag} {value}: give at least 1 ({flag} must be >= 1)")
    return value


def _at_least_zero(value: int, flag: str) -> int:
    if value < 0:
        raise OptionValueError(f"{flag} {value}: give a whole number >= 0")
    return value


def _positive_number(value: float, flag: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise OptionValueError(f"{flag} {value}: give a finite number > 0")
    return value


def _fraction(value: float, flag: str) -> float:
    if not (math.isfinite(value) and 0 < value <= 1):
        raise OptionValueError(f"{flag} {value}: give a fraction in (0, 1]")
    return value


def _seed(value: int, flag: str) -> int:
    try:
        return check_seed(value, flag)
    except UserError as exc:
        raise OptionValueError(str(exc)) from None


class Shard(NamedTuple):
    """`--shard I/N`: every N-th unit of work from the I-th, for N processes side by side."""

    index: int
    count: int


def _shard(text: str, flag: str) -> Shard:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise OptionValueError(f"{flag} {text!r}: give I/N with 0 <= I < N, e.g. 0/2")
    return Shard(int(index), int(count))


def _path(text: str, flag: str) -> Path:
    # What no filesystem call should be handed: caught here, before a command creates anything.
    if not text.strip():
        raise OptionValueError(f"{flag} is empty; give a path")
    if any(c in text for c in "\n\r\0"):
        raise OptionValueError(f"{flag} {text!r} has a line break or NUL in it; give a plain path")
    return Path(text)


def _output_path(text: str, flag: str) -> Path:
    """A path to write: also refused when something on the way to it is a file (`notes.txt/run`), which no
    command could create; whether the path itself may exist is the command's to say (resume, --force)."""
    path = _path(text, flag)
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OptionValueError(f"{flag} {text}: {parent} is a file, not a directory; give a path under "
                                       "a directory")
            break
    return path


POSITIVE_INT = Kind(int, _at_least_one, "N")
NONNEGATIVE_INT = Kind(int, _at_least_zero, "N")
POSITIVE_FLOAT = Kind(float, _positive_number, "X")
FRACTION = Kind(float, _fraction, "F")
SEED = Kind(int, _seed, "SEED")
SHARD = Kind(str, _shard, "I/N")
PATH = Kind(str, _path, "PATH")  # read or written: checked for what no filesystem call should be handed
OUTPUT_PATH = Kind(str, _output_path, "OUT")
TEXT = Kind(str)
INT = Kind(int)  # a whole number the command checks itself (its range depends on other flags)
FLOAT = Kind(float)


# ---------------------------------------------------------------- flags ---------------------------------------

# What `Flag.use` may change for one command: never the name, the kind or the check.
USE_FIELDS = frozenset({"help", "default", "default_text", "required", "nargs", "action", "metavar", "choices"})


@dataclass(frozen=True)
class Flag:
    """One setting on the command line. `name` is a long flag (`--out`) or a positional's name (`run_dir`);
    `kind` parses and checks its value (None for a switch); `default_text` is what the help says when the
    default is decided elsewhere (a model's trace_defaults.json, the profile)."""

    name: str
    help: str
    kind: Kind | None = TEXT
    default: Any = None
    choices: tuple | None = None
    action: str | type | None = None  # "store_true", "append", argparse.BooleanOptionalAction, ...
    nargs: str | int | None = None
    metavar: str | None = None
    dest: str | None = None
    default_text: str | None = None
    required: bool = False
    group: str | None = None  # the help section (GROUPS)
    aliases: tuple[str, ...] = ()
    origin: Flag | None = field(default=None, compare=False, repr=False)

    @property
    def definition(self) -> Flag:
        """The row this flag was defined by (itself, or the row a `use` adapted)."""
        return self.origin or self

    @property
    def key(self) -> str:
        return self.dest or self.name.lstrip("-").replace("-", "_")

    def use(self, **changes) -> Flag:
        """This setting as one command takes it: its own help, default, arity (`nargs="+"`, `action="append"`)
        or a narrower set of choices; the name, kind and check stay this row's."""
        unknown = set(changes) - USE_FIELDS
        if unknown:
            raise TypeError(f"Flag.use cannot change {', '.join(sorted(unknown))} of {self.name}: define another flag")
        if "default" in changes:  # the row's words for its own default no longer describe this one
            changes.setdefault("default_text", None)
        return replace(self, **changes, origin=self.definition)


# The help sections of shared settings, in the order the help prints them.
GROUPS = {
    "output": "output",
    "sampling": "what is run (model, task, samples, decoding, seed)",
    "policy": "KV policy (traces/policy.py)",
    "projection": "simulation and projection (simulator/options.py)",
    "serving": "serving (simulator/options.py ServingConfig)",
    "execution": "execution (devices, threads, workers, shards)",
}


def _rows(*flags: Flag) -> dict[str, Flag]:
    return {flag.key: flag for flag in flags}


SHARED: dict[str, Flag] = _rows(
    # output
    Flag("--out", "where this command writes", OUTPUT_PATH, group="output"),
    Flag("--runs", "one trace run per cell, resumed", OUTPUT_PATH, metavar="DIR", group="output"),
    Flag("--work", "each cell's cached results", OUTPUT_PATH, metavar="DIR", group="output"),
    Flag("--quiet", "no progress bars", None, action="store_true", default=False, group="output"),
    Flag("--dry-run", "report what would run; write nothing", None, action="store_true", default=False,
         group="output"),
    Flag("--allow-large", "run even when the size estimate says it will not fit in this machine's memory or disk "
         "(default: refuse)", None, action="store_true", default=False, group="output"),
    Flag("--figure-only", "table and figure from the runs there are; trace nothing", None, action="store_true",
         default=False, group="output"),
    Flag("--timeline", "Chrome-trace JSON (open in ui.perfetto.dev)", OUTPUT_PATH, metavar="JSON", group="output"),
    # sampling: what is traced
    Flag("--model", "HF id or local path, a bundled or packaged model (`thoughtkv models`), or `random:NAME` "
         "(traces.architectures)", TEXT, metavar="MODEL", group="sampling"),
    Flag("--task", "task name (gsm8k, math500, chains, chains_long, ...)", TEXT, metavar="TASK", group="sampling"),
    Flag("--data-file", "local dataset file for the task (no downloads at run time)", PATH, metavar="FILE",
         group="sampling"),
    Flag("--n-samples", "samples (problems) of the task", POSITIVE_INT, default=1, group="sampling"),
    Flag("--samples", "sequences per run", POSITIVE_INT, default=1, group="sampling"),
    Flag("--max-new-tokens", "decode limit per sample", POSITIVE_INT, group="sampling"),
    Flag("--batch-size", "samples decoded per step (the same per-sample results, faster)", POSITIVE_INT, default=1,
         group="sampling"),
    Flag("--seed", "seed of everything random in the command", SEED, default=0, group="sampling"),
    Flag("--dtype", "weight and KV dtype: float32 | bfloat16 | float16", TEXT, metavar="DTYPE", group="sampling"),
    Flag("--no-access", "do not record per-block attention masses (access.parquet: smaller, no what-if)", None,
         action="store_true", default=False, group="sampling"),
    Flag("--recall-buffer-blocks", "a per-(sequence, layer) LRU of N recalled blocks kept in HBM: a recalled block "
         "still in it is not copied again, and its HBM counts against capacity", NONNEGATIVE_INT, group="policy"),
    # hardware
    Flag("--profile", "hardware profile name or YAML path", TEXT, metavar="PROFILE", group="projection"),
    # execution
    Flag("--device", "cpu | cuda | cuda:N", TEXT, metavar="DEVICE", default_text="cuda when torch sees a GPU, else cpu",
         group="execution"),
    Flag("--threads", "torch intra-op threads; recorded", POSITIVE_INT,
         default_text="1 on cpu, as calibrate measures; torch's default on cuda", group="execution"),
    Flag("--workers", "parallel cells", POSITIVE_INT, default_text="the CPU count", group="execution"),
    Flag("--executor", "local process pool or Ray (a local Ray, or a cluster with --address)", TEXT,
         choices=("local", "ray"), default="local", group="execution"),
    Flag("--address", "Ray cluster to join: `auto` on a cluster node, or ray://HEAD:10001 (Ray only)", TEXT,
         metavar="ADDR", group="execution"),
    Flag("--shard", "I/N: every N-th cell from the I-th, for N processes side by side", SHARD,
         default=Shard(0, 1), default_text="0/1", group="execution"),
    Flag("--cells", "which cells: all, or key (the key budget's column only)", TEXT, default="all",
         group="execution"),
)


def shared(*keys: str) -> list[Flag]:
    return [SHARED[key] for key in keys]


# ---------------------------------------------------------------- flags from an options dataclass ------------


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@functools.cache
def field_flag(cls: type, name: str) -> Flag:
    """The flag of one field of an options dataclass, made once (so every command that takes it shares one
    definition): `metadata["help"]` its help, `["choices"]`, `["type"]` (the parser when the default does not
    say), `["metavar"]`, `["default_text"]`; the class's `flag_group` is its help section. It defaults to None, "not given": the dataclass's own default
    applies (`from_args`), which the help shows. A field named like a shared setting is that setting."""
    f = next(f for f in fields(cls) if f.name == name)
    meta = f.metadata
    default = f.default if f.default is not MISSING else f.default_factory()
    text = meta.get("default_text", _shown(default))
    if f.name in SHARED:
        return SHARED[f.name].use(help=meta["help"], default=None, default_text=text)
    group = getattr(cls, "flag_group", None)
    if isinstance(default, bool):
        return Flag(flag_name(f.name), meta["help"], None, action=argparse.BooleanOptionalAction, dest=f.name,
                    default_text=text, group=group)
    parse = meta.get("type") or type(default)
    kind = meta.get("kind") or Kind(parse, metavar=meta.get("metavar", f.name.upper()))
    return Flag(flag_name(f.name), meta["help"], kind, choices=meta.get("choices"), dest=f.name, default_text=text,
                metavar=meta.get("metavar"), group=group)


def dataclass_flags(cls: type, only: tuple[str, ...] | None = None, exclude: tuple[str, ...] = ()) -> list[Flag]:
    """The flags of the fields of `cls` that have help (those in `only`, less `exclude`), in field order."""
    return [field_flag(cls, f.name) for f in fields(cls)
            if "help" in f.metadata and (only is None or f.name in only) and f.name not in exclude]


def _shown(default) -> str:
    """A default as the help shows it: on / off for switches, unset for None."""
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


# ---------------------------------------------------------------- the parser ----------------------------------


class _Checked(argparse.Action):
    """Store (or append) a value after its kind's check: the check's OptionValueError leaves parse_args as a
    UserError (one line, exit 2 from `thoughtkv`), not as argparse's usage error."""

    def __init__(self, option_strings, dest, kind: Kind, append: bool = False, **kwargs):
        self.kind, self.append = kind, append
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        name = option_string or self.metavar or self.dest
        value = [self.kind.check(v, name) for v in values] if isinstance(values, list) else \
            self.kind.check(values, name)
        if self.append:
            value = [*(getattr(namespace, self.dest, None) or []), value]
        setattr(namespace, self.dest, value)


def help_text(flag: Flag) -> str:
    """The help with its default, as every command prints it."""
    unset = flag.default is None or flag.default is False or (isinstance(flag.default, (list, tuple))
                                                                and not flag.default)
    default = flag.default_text if flag.default_text is not None else (None if unset else _shown(flag.default))
    if default is None or "default" in flag.help or flag.required:
        return flag.help
    return f"{flag.help} (default: {default})"


def add_flags(parser: argparse.ArgumentParser, *flags: Flag | str) -> None:
    """Add each flag (a Flag, or the key of a SHARED row) to `parser`, shared ones under their help section."""
    for flag in flags:
        flag = SHARED[flag] if isinstance(flag, str) else flag
        names = (flag.name, *flag.aliases)
        positional = not flag.name.startswith("-")
        kwargs: dict[str, Any] = {"help": help_text(flag)}
        if not positional:
            kwargs["dest"] = flag.key
            kwargs["default"] = list(flag.default) if isinstance(flag.default, list) else flag.default
            if flag.required:
                kwargs["required"] = True
        elif flag.default is not None:
            kwargs["default"] = flag.default
        if flag.kind is None:  # a switch
            kwargs["action"] = flag.action or "store_true"
        else:
            if flag.kind.check is None and flag.action in (None, "append"):
                kwargs["action"] = flag.action or "store"
            elif flag.action in (None, "append"):
                kwargs.update(action=_Checked, kind=flag.kind, append=flag.action == "append")
            else:
                kwargs["action"] = flag.action
            kwargs["type"] = flag.kind.parse
            if flag.choices is not None:
                kwargs["choices"] = flag.choices
            else:
                kwargs["metavar"] = flag.metavar or flag.kind.metavar or flag.key.upper()
            if flag.nargs is not None:
                kwargs["nargs"] = flag.nargs
        target = parser
        if flag.group is not None and not positional:
            sections = parser.__dict__.setdefault("_thoughtkv_sections", {})
            if flag.group not in sections:
                sections[flag.group] = parser.add_argument_group(GROUPS[flag.group])
            target = sections[flag.group]
        action = target.add_argument(*names, **kwargs)
        action.definition = flag.definition
