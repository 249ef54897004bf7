"""A model's trace defaults, shipped with its weights: `trace_defaults.json` in the model's directory, as HF
models ship `generation_config.json`. It holds the cache geometry, decode limit and recall setting the model was
made for (the bundled `micro` and `micro_long`: blocks of 4, 4 sinks, a 16-token window, their chain-of-thought
length and the recall their docs use); every other model falls back to the tool's defaults (PolicySpec's, and
256 new tokens).

One home: `thoughtkv trace`, `capacity-long`, the demo and the docs' tables read these values through
`resolve` (tracer.run.TraceConfig calls it for every setting left unset), an explicit flag or argument always
wins, and run.json records which values came from the model (`tracer.from_model`). Torch-free: the CLI modules
import it before torch.

    {"block_size": 4, "sink_tokens": 4, "window_tokens": 16, "max_new_tokens": 600, "recall_budget": 0.2}
"""

from __future__ import annotations

import json
from pathlib import Path

from thoughtkv_base import UserError

FILE_NAME = "trace_defaults.json"
ASSETS_DIR = Path(__file__).parent / "assets"
# The models shipped in the package, by the name `--model` takes: `micro` (task chains) and `micro_long` (the
# same model fine-tuned on chains_long; tracer/micro/README.md).
BUNDLED_MODELS = {"micro": ASSETS_DIR / "micro", "micro_long": ASSETS_DIR / "micro_long"}
TOOL_MAX_NEW_TOKENS = 256  # the decode limit of a model without trace defaults
GEOMETRY_KEYS = ("block_size", "sink_tokens", "window_tokens")
RECALL_KEYS = ("recall_k", "recall_budget")  # one setting: either one given explicitly overrides both
KEYS = (*GEOMETRY_KEYS, "max_new_tokens", *RECALL_KEYS)
MAX_FILE_BYTES = 64 * 1024


class TraceDefaultsError(UserError):
    """A trace_defaults.json that cannot be used (one line naming the file and the fix)."""


def model_dir(model: str) -> Path | None:
    """The directory holding a `--model`'s trace_defaults.json (a bundled name's, a packaged model's shipped
    with thoughtkv: tracer/packaged.py, or a local directory); None for an HF id or `random:`."""
    from tracer.packaged import PACKAGED_MODELS

    if model in BUNDLED_MODELS:
        return BUNDLED_MODELS[model]
    if model in PACKAGED_MODELS:
        return PACKAGED_MODELS[model].defaults_dir
    if model.startswith("random:"):
        return None
    path = Path(model).expanduser()
    return path if path.is_dir() else None


def tool_defaults() -> dict:
    """What a model without trace defaults gets: the policy contract's defaults and TOOL_MAX_NEW_TOKENS."""
    from traces.policy import PolicySpec

    spec = PolicySpec()
    return {**{key: getattr(spec, key) for key in (*GEOMETRY_KEYS, *RECALL_KEYS)},
            "max_new_tokens": TOOL_MAX_NEW_TOKENS}


def trace_defaults(model: str) -> dict:
    """The model's trace_defaults.json as a dict ({} when it has none), checked: known keys, values the policy
    contract accepts, a decode limit >= 1."""
    directory = model_dir(model)
    path = directory / FILE_NAME if directory is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise TraceDefaultsError(f"{path}: larger than {MAX_FILE_BYTES // 1024} KiB; it holds a few settings")
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceDefaultsError(f"{path}: not readable JSON ({type(exc).__name__}); fix or remove it") from None
    if not isinstance(values, dict) or set(values) - set(KEYS):
        unknown = sorted(set(values) - set(KEYS)) if isinstance(values, dict) else ["(not a mapping)"]
        raise TraceDefaultsError(f"{path}: unknown key(s) {', '.join(map(str, unknown))}; use {', '.join(KEYS)}")
    from traces.policy import PolicyError, PolicySpec

    try:
        PolicySpec(policy="hierarchy", **{k: v for k, v in values.items() if k != "max_new_tokens"})
    except PolicyError as exc:
        raise TraceDefaultsError(f"{path}: {exc}") from None
    limit = values.get("max_new_tokens", 1)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise TraceDefaultsError(f"{path}: max_new_tokens {limit!r} must be a whole number >= 1")
    return values


def resolve(model: str, given: dict, policy: str = "hierarchy") -> tuple[dict, dict]:
    """(every KEYS value, the ones taken from the model). `given` holds the explicit values (None: unset);
    unset values come from the model's trace defaults, else the tool's. The recall pair is one setting: an
    explicit `recall_k` or `recall_budget` keeps the model's recall out; outside the hierarchy nothing is
    recalled, so the model's recall setting is not taken (nor recorded)."""
    from_file = trace_defaults(model)
    if any(given.get(key) is not None for key in RECALL_KEYS) or policy != "hierarchy":
        from_file = {k: v for k, v in from_file.items() if k not in RECALL_KEYS}
    fallback = tool_defaults()
    values, from_model = {}, {}
    for key in KEYS:
        if given.get(key) is not None:
            values[key] = given[key]
        elif key in from_file:
            values[key] = from_model[key] = from_file[key]
        else:
            values[key] = fallback[key]
    return values, from_model


def describe(from_model: dict, model: str) -> str | None:
    """One note line naming the settings a run took from the model, as flags (None when none)."""
    if not from_model:
        return None
    flags = " ".join(f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
                     for k, v in from_model.items())
    return f"note: {model}'s {FILE_NAME} sets {flags} (a flag overrides each)"
