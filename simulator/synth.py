"""`thoughtkv traces synth`: a valid trace v1 for a known architecture, without torch or a model.

Shapes come from `traces.architectures`; per-block attention masses from the seeded long-tail access model
(`traces.access_model.AccessModel`, documented there); the block movements from the same numpy placement the
what-if replay uses (`simulator.placement`), so a synthetic trace is what the tracer would record if the
model attended the way the access model says. Bytes moved = blocks x block_size x kv_bytes_per_token / n_layers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from thoughtkv_base import UserError

SYNTH_TASK = "synthetic"


class SynthError(UserError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from traces.policy import add_policy_arguments

    parser.add_argument("--model", required=True, help="architecture name from traces.architectures (e.g. qwen2-7b)")
    parser.add_argument("--prompt-tokens", type=int, required=True, help="prompt length P (the prefill, step 0)")
    parser.add_argument("--decode-steps", type=int, required=True, help="decode steps N after the prefill")
    add_policy_arguments(parser, skip=("ddr_dtype",))
    parser.add_argument("--samples", type=int, default=1, help="number of sequences, each its own seed (default: 1)")
    parser.add_argument("--dtype", default="bfloat16", help="KV and weight dtype: bfloat16, float16, float32, float8 (default: bfloat16)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the access model (sample i uses 100003 x seed + i) (default: 0)")
    parser.add_argument("--no-access", action="store_true", help="do not write access.parquet (smaller; no what-if)")
    parser.add_argument("--out", type=Path, required=True, help="run directory to write (resumes if it exists)")


def run(args: argparse.Namespace) -> int:

    from traces.policy import spec_from_args

    spec = synth_spec(spec_from_args(args))
    path = synth_run(
        args.out, model=args.model, prompt_tokens=args.prompt_tokens, decode_steps=args.decode_steps,
        spec=spec, samples=args.samples, dtype=args.dtype, seed=args.seed, access=not args.no_access, progress=True,
    )
    print(f"wrote {path}")
    return 0


def synth_spec(spec):
    """A synthetic trace has masses but no keys: a key-bound recall rule (quest) is played as the query-mass
    ranking it approximates, and run.json records that; a scorer must be computable from masses."""
    import sys
    from dataclasses import replace

    from simulator.placement import MASS_RECALL_RULES, SCORERS
    from traces.policy import recall_warning

    if spec.scorer not in SCORERS:
        raise SynthError(f"--scorer {spec.scorer}: synthetic traces have masses only; use one of {', '.join(SCORERS)}")
    if spec.recall_rule not in MASS_RECALL_RULES:
        spec = replace(spec, recall_rule="query")
    warning = recall_warning(spec)
    if warning:
        print(warning, file=sys.stderr)
    return spec


def synth_run(
    out: str | Path, *, model: str, prompt_tokens: int, decode_steps: int, spec=None,
    samples: int = 1, dtype: str = "bfloat16", seed: int = 0, access: bool = True, progress: bool = False,
    access_params: dict | None = None, **policy,
) -> Path:
    """Write (or resume) a synthetic run; returns its directory. The placement is `spec` (a
    `traces.policy.PolicySpec`) or built from `policy` keyword arguments (its fields)."""
    from tqdm import tqdm

    from traces.architectures import get_architecture
    from traces.manifest import load_manifest, make_manifest, model_manifest
    from traces.policy import PolicySpec
    from traces.writer import TraceWriter

    if prompt_tokens < 1 or decode_steps < 0 or samples < 1:
        raise SynthError("--prompt-tokens must be >= 1, --decode-steps >= 0 and --samples >= 1")
    if not 0 <= seed < 2**32:  # numpy refuses negative seeds with a traceback
        raise SynthError(f"--seed {seed} must be a whole number in [0, 2**32)")
    from traces.layout import MAX_SAMPLES

    if samples > MAX_SAMPLES:  # 10**13 built a sample-id list until the machine ran out of memory
        raise SynthError(f"--samples {samples:,} is more than {MAX_SAMPLES:,}; write fewer (a rerun with more resumes)")
    arch = get_architecture(model)
    if prompt_tokens + decode_steps > arch.max_position_embeddings:  # also keeps array sizes sane (10**40 crashed)
        raise SynthError(f"--prompt-tokens + --decode-steps = {prompt_tokens + decode_steps:,} exceeds {model}'s "
                         f"context of {arch.max_position_embeddings:,} tokens; use fewer")
    if spec is None:
        spec = synth_spec(PolicySpec(**policy))
    config = spec.effective()
    sample_ids = [f"synth/{i:04d}" for i in range(samples)]
    manifest = make_manifest(
        kind="synthetic",
        model=model_manifest(arch, dtype=dtype, random_weights=True),
        task={"name": SYNTH_TASK, "source": "simulator.synth (traces.access_model)", "split": "none",
              "sample_ids": sample_ids},
        policy=config.to_manifest(),
        hardware={"device": "none (synthetic)", "torch": None, "cuda": None, "transformers": None},
        seed=seed,
        access=access,
        extra={"synthetic": {"prompt_tokens": prompt_tokens, "decode_steps": decode_steps,
                             "access_model": dict(access_params or {})}},
    )
    if (Path(out) / "run.json").is_file():  # checked before the writer touches anything
        existing = load_manifest(Path(out))
        if existing.get("synthetic") != manifest["synthetic"] or existing["seed"] != seed:
            raise SynthError(f"{out}: cannot resume: it was written with other lengths, access-model parameters "
                             "or seed; use a new --out")
    writer = TraceWriter(out, manifest, resume=True)
    todo = [(i, s) for i, s in enumerate(sample_ids) if s not in writer.done_sample_ids()]
    for index, sample_id in tqdm(todo, desc="synth", unit="sample", disable=not progress):
        rows = synth_sample(sample_id, index, arch, config, prompt_tokens, decode_steps, dtype, seed,
                            access_params or {})
        writer.write_sample(rows["sample"], rows["steps"], rows["tokens"], rows["access"] if access else None)
    return Path(out)


def synth_sample(sample_id: str, index: int, arch, config, prompt_tokens: int, decode_steps: int, dtype: str,
                 seed: int, access_params: dict) -> dict:
    """One sample's rows: {"sample", "steps", "tokens", "access"} (access with float `block_mass`)."""
    import numpy as np

    from simulator.placement import OracleScorer, Placement, future_mass, get_scorer
    from traces.access_model import AccessModel
    from traces.schema import TIER_HBM

    n_layers, bs = arch.n_layers, config.block_size
    n_steps = decode_steps + 1
    kv_per_token_layer = arch.kv_bytes_per_token(dtype) // n_layers
    block_bytes = bs * kv_per_token_layer
    access_model = AccessModel(n_layers=n_layers, block_size=bs, seed=seed * 100_003 + index, **access_params)
    logical = prompt_tokens + np.arange(n_steps)
    masses = [access_model.masses(s, int(logical[s])) for s in range(n_steps)]
    scorer = get_scorer(config.scorer)
    if isinstance(scorer, OracleScorer):
        scorer.future = future_mass(masses)
    placement = Placement(config, n_layers, scorer)

    names = ("hbm_tokens", "ddr_tokens", "evicted_tokens", "recalled_tokens", "hbm_blocks", "ddr_blocks",
             "evicted_blocks", "n_recalled", "n_offloaded", "mass_hbm", "mass_ddr", "mass_evicted")
    cols = {name: np.zeros((n_steps, n_layers)) for name in names}
    ids = {k: [] for k in ("recalled_block_ids", "promoted_block_ids", "offloaded_block_ids", "evicted_block_ids")}
    n_blocks_final = -(-int(logical[-1] + 1) // bs)
    importance = np.zeros((n_layers, n_blocks_final))
    for s in range(n_steps):
        placed = placement.step(s, int(logical[s]), masses[s], record_ids=True)
        for name in names:
            cols[name][s] = getattr(placed, name)
        for key in ids:
            ids[key].extend(placed.ids[key])
        if s > 0:  # importance counts decode steps; a block's mass is spread evenly over its tokens
            n = masses[s].shape[1]
            tokens_in_block = np.full(n, float(bs))
            tokens_in_block[-1] = logical[s] - (n - 1) * bs
            importance[:, :n] += masses[s] / tokens_in_block

    flat = {name: cols[name].ravel() for name in names}
    step = np.repeat(np.arange(n_steps, dtype=np.int32), n_layers)
    layer = np.tile(np.arange(n_layers, dtype=np.int16), n_steps)
    logical_len = logical[step].astype(np.int32)
    hbm_kv = (flat["hbm_tokens"] + flat["recalled_tokens"]) * kv_per_token_layer
    steps = {
        "step": step, "layer": layer,
        "query_tokens": np.where(step == 0, prompt_tokens, 1).astype(np.int32),
        "logical_len": logical_len,
        **{name: flat[name].astype(np.int32) for name in names[:7]},
        **ids,
        "bytes_h2d": (flat["n_recalled"] * block_bytes).astype(np.int64),
        "bytes_d2h": (flat["n_offloaded"] * block_bytes).astype(np.int64),
        "hbm_kv_bytes": hbm_kv.astype(np.int64),
        "ddr_kv_bytes": (flat["ddr_tokens"] * kv_per_token_layer).astype(np.int64),
        "mass_hbm": flat["mass_hbm"].astype(np.float32),
        "mass_ddr": flat["mass_ddr"].astype(np.float32),
        "mass_evicted": flat["mass_evicted"].astype(np.float32),
    }

    generated = n_steps
    n_positions = prompt_tokens + generated
    position = np.arange(n_positions, dtype=np.int32)
    by_layer = importance[:, position // bs].T.astype(np.float32)  # [positions, layers]
    final_tier = np.full((n_layers, n_blocks_final), TIER_HBM, dtype=np.uint8)
    final_tier[:, : placement.tier.shape[1]] = placement.tier
    rng = np.random.default_rng([seed, index, 7])
    tokens = {
        "position": position,
        "token_id": rng.integers(0, arch.vocab_size, n_positions, dtype=np.int64).astype(np.int32),
        "is_prompt": position < prompt_tokens,
        "importance": by_layer.mean(axis=1),
        "importance_max": by_layer.max(axis=1),
        "importance_by_layer": list(by_layer),
        "final_tier_by_layer": list(final_tier[:, position // bs].T),
    }
    sample = {
        "sample_id": sample_id, "sample_index": index, "prompt_tokens": prompt_tokens, "generated_tokens": generated,
        "stop_reason": "max_new_tokens", "predicted": None, "gold": None, "correct": None, "wall_s": 0.0,
        "nonfinite": False, "generated_text": None,
    }
    access = {"step": step, "layer": layer,
              "block_mass": [m.astype(np.float32) for per_step in masses for m in per_step]}
    return {"sample": sample, "steps": steps, "tokens": tokens, "access": access}
