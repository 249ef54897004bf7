"""`thoughtkv models`: the models `--model` takes by name, with their shapes and KV bytes per token.

Bundled models ship inside thoughtkv (`micro`, `micro_long`); packaged models ship inside a pip package that
`make` installs (`smollm2-135m`: tracer/packaged.py). Any other `--model` is a local directory or an HF id, and
`random:NAME` gives a known architecture (traces.architectures) with random weights. Torch-free.
"""

from __future__ import annotations

import argparse
import json

from thoughtkv_base.options import TEXT, Flag, add_flags
from traces.architectures import Architecture, architecture_from_config

OWN = (
    Flag("--json", "one JSON object per model instead of the table", None, action="store_true", default=False),
    Flag("--prepare", "convert packaged model NAME into the cache now (what its first use would do; `make setup` "
         "runs it) and print the directory (default: list only)", TEXT, metavar="NAME"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, *OWN)


def model_rows() -> list[dict]:
    """One row per named model: name, kind, status, shapes (traces.architectures.Architecture) and KV bytes."""
    from tracer.model_defaults import BUNDLED_MODELS, trace_defaults
    from tracer.packaged import PACKAGED_MODELS, PackagedModelError, converted_dir, is_prepared, model_file
    from traces.architectures import get_architecture

    rows = []
    for name, directory in BUNDLED_MODELS.items():
        config = directory / "config.json"
        arch = architecture_from_config(name, json.loads(config.read_text(encoding="utf-8")), str(config))
        rows.append(_row(name, "bundled", "ready", arch, "float32", trace_defaults(name), "trained here (tracer/micro)"))
    for name, packaged in PACKAGED_MODELS.items():
        if is_prepared(packaged):
            status = f"ready ({converted_dir(packaged)})"
        else:
            try:
                model_file(packaged)
                status = "installed; converted on first use (~20-45 s, once)"
            except PackagedModelError:
                status = f"not installed: {packaged.install_command}"
        rows.append(_row(name, f"packaged ({packaged.distribution} {packaged.version}, {packaged.license})", status,
                         get_architecture(packaged.architecture), "float32", trace_defaults(name),
                         packaged.description))
    return rows


def _row(name: str, kind: str, status: str, arch: Architecture, dtype: str, defaults: dict, about: str) -> dict:
    return {"name": name, "kind": kind, "status": status, "layers": arch.n_layers, "heads": arch.n_heads,
            "kv_heads": arch.n_kv_heads, "head_dim": arch.head_dim, "params": arch.n_params(),
            "context": arch.max_position_embeddings, "dtype": dtype,
            "kv_bytes_per_token": arch.kv_bytes_per_token(dtype),
            "kv_bytes_per_token_bf16": arch.kv_bytes_per_token("bfloat16"), "trace_defaults": defaults,
            "about": about}


def run(args: argparse.Namespace) -> int:
    if args.prepare is not None:
        from thoughtkv_base import UserError
        from tracer.packaged import PACKAGED_MODELS, prepared_dir

        if args.prepare not in PACKAGED_MODELS:
            raise UserError(f"--prepare {args.prepare}: not a packaged model; use one of {', '.join(PACKAGED_MODELS)}")
        print(prepared_dir(args.prepare))
        return 0
    rows = model_rows()
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    header = f"{'name':<14} {'params':>8} {'layers':>6} {'heads/kv':>8} {'head':>4} {'context':>7} " \
             f"{'KV B/token fp32 (bf16)':>23}  kind; status"
    print(header)
    for r in rows:
        kv = f"{r['kv_bytes_per_token']:,} ({r['kv_bytes_per_token_bf16']:,})"
        print(f"{r['name']:<14} {r['params'] / 1e6:>7.1f}M {r['layers']:>6} {r['heads']:>4}/{r['kv_heads']:<3} "
              f"{r['head_dim']:>4} {r['context']:>7,} {kv:>23}  {r['kind']}; {r['status']}")
    from traces.architectures import ARCHITECTURES

    print("\nAlso: a local model directory or a cached HF id, and random:NAME (a known architecture with random "
          f"weights, timings only) for NAME in {', '.join(ARCHITECTURES)}.")
    return 0
