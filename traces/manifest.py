"""run.json: build one (`make_manifest`), read and check one (`load_manifest`), compare two on resume."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from traces.encoding import encoding_params
from traces.errors import TraceFormatError
from traces.layout import MANIFEST_NAME, write_bytes_atomic
from traces.schema import MANIFEST_REQUIRED, SCHEMA_VERSION

KINDS = ("traced", "synthetic", "measured")
# Fields that must be positive integers for the readers' checks (block ids, layers) to mean anything.
POSITIVE_INTS = (("model", "n_layers"), ("model", "kv_bytes_per_token"), ("policy", "block_size"))
# What must agree between an existing run and a rerun that appends to it (everything else may change).
RESUME_MUST_MATCH = (("schema",), ("kind",), ("model",), ("task", "name"), ("policy",), ("access",))


def make_manifest(
    *,
    kind: str,
    model: dict,
    task: dict,
    policy: dict,
    hardware: dict,
    seed: int,
    access: bool = True,
    extra: dict | None = None,
) -> dict:
    """A complete run.json dict: fills schema, created (UTC), thoughtkv version + git commit and the access
    encoding; raises TraceFormatError naming the first missing key."""
    from thoughtkv_base import __version__, git_commit

    manifest = {
        "schema": SCHEMA_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "kind": kind,
        "thoughtkv": {"version": __version__, "git_commit": git_commit()},
        "model": dict(model),
        "task": dict(task),
        "policy": dict(policy),
        "hardware": dict(hardware),
        "seed": seed,
        "access": {"enabled": bool(access), **encoding_params()},
    }
    for key, value in (extra or {}).items():
        if key in manifest:
            raise TraceFormatError(f"make_manifest: extra key {key!r} would overwrite a required field; rename it")
        manifest[key] = value
    if kind not in KINDS:
        raise TraceFormatError(f"make_manifest: kind {kind!r} is not one of {', '.join(KINDS)}")
    check_manifest(manifest, where="manifest")
    try:  # fail now, not at write time, on values JSON cannot hold (NaN, numpy scalars, objects)
        json.dumps(manifest, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"make_manifest: a value cannot be stored in run.json ({exc}); use plain JSON types") from None
    return manifest


def check_manifest(manifest: object, *, where: str) -> None:
    """Schema version, required keys and the few fields readers compute with; TraceFormatError otherwise."""
    if not isinstance(manifest, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, found {type(manifest).__name__}")
    found = manifest.get("schema")
    if found != SCHEMA_VERSION:
        raise TraceFormatError(
            f"{where}: schema is {found!r} but this thoughtkv reads {SCHEMA_VERSION!r}; "
            "use the thoughtkv version that wrote it or re-collect the trace"
        )
    for key, subkeys in MANIFEST_REQUIRED.items():
        if key not in manifest:
            raise TraceFormatError(f"{where}: missing required key {key!r}")
        if subkeys and not isinstance(manifest[key], dict):
            raise TraceFormatError(f"{where}: {key!r} must be an object with keys {', '.join(subkeys)}")
        for subkey in subkeys:
            if subkey not in manifest[key]:
                raise TraceFormatError(f"{where}: missing required key {key}.{subkey}")
    for key, subkey in POSITIVE_INTS:
        value = manifest[key][subkey]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise TraceFormatError(f"{where}: {key}.{subkey} must be a positive integer, found {value!r}")
    from traces.policy import PolicyError, PolicySpec

    try:  # the one policy contract: a value it refuses is named by its run.json key
        PolicySpec.from_manifest(manifest["policy"])
    except PolicyError as exc:
        raise TraceFormatError(f"{where}: {str(exc).removeprefix('run.json ')}; fix the value or re-collect the "
                               "trace") from None
    sample_ids = manifest["task"]["sample_ids"]
    if not isinstance(sample_ids, list) or not all(isinstance(s, str) for s in sample_ids):
        raise TraceFormatError(f"{where}: task.sample_ids must be a list of strings")
    access = manifest["access"]
    if not isinstance(access["enabled"], bool):
        raise TraceFormatError(f"{where}: access.enabled must be true or false")
    for key, ok in (("floor_log2", lambda v: v <= 0), ("levels_per_octave", lambda v: v > 0)):
        value = access.get(key, 0 if key == "floor_log2" else 1)
        if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
            raise TraceFormatError(f"{where}: access.{key} is {value!r}, not a valid encoding parameter")


def load_manifest(run_dir: Path) -> dict:
    path = run_dir / MANIFEST_NAME
    if not run_dir.is_dir():
        raise TraceFormatError(f"{run_dir}: no such run directory; pass the directory a trace was written to")
    if not path.is_file():
        raise TraceFormatError(f"{path}: missing; {run_dir} is not a trace run (or its writer never started)")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, RecursionError, OSError) as exc:
        raise TraceFormatError(f"{path}: not valid JSON ({_one_line(exc)}); the file is corrupt") from None
    check_manifest(manifest, where=str(path))
    return manifest


def write_manifest(run_dir: Path, manifest: dict) -> None:
    data = json.dumps(manifest, indent=2, allow_nan=False).encode() + b"\n"
    write_bytes_atomic(run_dir / MANIFEST_NAME, data)


def resume_mismatch(existing: dict, new: dict) -> str | None:
    """The first field (dotted path) where a rerun's manifest disagrees with the run it would append to."""
    for path in RESUME_MUST_MATCH:
        a, b = _get(existing, path), _get(new, path)
        if path == ("model",) and isinstance(a, dict) and isinstance(b, dict):
            a, b = ({**m, "id": portable_model_id(m.get("id"))} for m in (a, b))
        difference = _first_difference(a, b, ".".join(path))
        if difference is not None:
            return difference
    return None


def portable_model_id(model_id):
    """A bundled model's id (its directory inside a checkout, `.../tracer/assets/NAME`) as `NAME`, so a run traced
    in one checkout resumes in another (a fresh clone, a second worktree); any other id as it is."""
    if isinstance(model_id, str):
        parts = model_id.replace("\\", "/").rstrip("/").split("/")
        if len(parts) >= 3 and parts[-3:-1] == ["tracer", "assets"]:
            return parts[-1]
    return model_id


def _get(d: dict, path: tuple[str, ...]):
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def _first_difference(a, b, where: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            difference = _first_difference(a.get(key), b.get(key), f"{where}.{key}")
            if difference is not None:
                return difference
        return None
    # JSON round trip turns tuples into lists and keeps floats: compare as run.json would store them.
    if json.loads(json.dumps(a)) != json.loads(json.dumps(b)):
        return f"{where} is {a!r} in the existing run but {b!r} now"
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def model_manifest(
    architecture,
    *,
    dtype: str = "bfloat16",
    model_id: str | None = None,
    revision: str | None = None,
    random_weights: bool = True,
) -> dict:
    """run.json "model" for a known architecture (an `Architecture` or its name in traces.architectures)."""
    from traces.architectures import get_architecture

    arch = get_architecture(architecture) if isinstance(architecture, str) else architecture
    return {
        "id": model_id or arch.hf_id,
        "revision": revision,
        "architecture": arch.architecture,
        "arch_name": arch.name,
        "n_layers": arch.n_layers,
        "n_heads": arch.n_heads,
        "n_kv_heads": arch.n_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "vocab_size": arch.vocab_size,
        "dtype": dtype,
        "kv_bytes_per_token": arch.kv_bytes_per_token(dtype),
        "weight_bytes": arch.weight_bytes(dtype),
        "n_params": arch.n_params(),
        "random_weights": random_weights,
    }
