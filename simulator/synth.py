"""`thoughtkv traces synth`: a valid trace v1 for a known architecture, without torch or a model.

Shapes come from `traces.architectures`; per-block attention masses from the seeded long-tail access model
(`traces.access_model.AccessModel`, documented there); the block movements from the same numpy placement the
what-if replay uses (`simulator.placement`), so a synthetic trace is what the tracer would record if the
model attended the way the access model says. Bytes moved = blocks x block_size x kv_bytes_per_token / n_layers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from thoughtkv_base import UserError, check_seed
from thoughtkv_base.options import INT, POSITIVE_INT, SHARED, Flag, add_flags

SYNTH_TASK = "synthetic"


class SynthError(UserError):
    pass


OWN = (
    Flag("--prompt-tokens", "prompt length P (the prefill, step 0)", POSITIVE_INT, required=True),
    # A whole number checked by synth_run: its message says why a sample needs a decode step.
    Flag("--decode-steps", "decode steps N after the prefill", INT, required=True),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from traces.policy import add_policy_arguments

    add_flags(parser, SHARED["model"].use(help="architecture name from traces.architectures (e.g. qwen2-7b)",
                                          required=True), *OWN)
    add_policy_arguments(parser, skip=("ddr_dtype",))
    add_flags(parser, SHARED["samples"].use(help="number of sequences, each its own seed"),
              SHARED["dtype"].use(help="KV and weight dtype: bfloat16, float16, float32, float8", default="bfloat16"),
              SHARED["seed"].use(help="seed of the access model (sample i uses 100003 x seed + i)"),
              SHARED["no_access"].use(help="do not write access.parquet (smaller; no what-if)"),
              SHARED["out"].use(help="run directory to write (resumes if it exists)", required=True),
              SHARED["allow_large"].use(help="write even when the size estimate says the run will not fit in this "
                                             "machine's memory or disk (default: refuse)"))


def run(args: argparse.Namespace) -> int:

    from traces.policy import spec_from_args

    spec = synth_spec(spec_from_args(args))
    path = synth_run(
        args.out, model=args.model, prompt_tokens=args.prompt_tokens, decode_steps=args.decode_steps,
        spec=spec, samples=args.samples, dtype=args.dtype, seed=args.seed, access=not args.no_access, progress=True,
        allow_large=args.allow_large,
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
    access_params: dict | None = None, allow_large: bool = False, **policy,
) -> Path:
    """Write (or resume) a synthetic run; returns its directory. The placement is `spec` (a
    `traces.policy.PolicySpec`) or built from `policy` keyword arguments (its fields). Refused before anything
    is written when its size estimate (`estimate_synth`) exceeds this machine's memory or disk, unless
    `allow_large`; with `progress` the estimate is printed first."""
    from tqdm import tqdm

    from traces.architectures import get_architecture
    from traces.manifest import load_manifest, make_manifest, model_manifest
    from traces.policy import PolicySpec
    from traces.writer import TraceWriter

    if prompt_tokens < 1 or samples < 1:
        raise SynthError(f"--prompt-tokens {prompt_tokens} and --samples {samples} must both be >= 1")
    if decode_steps < 1:  # a prefill-only sample has no time per generated token: ms/token, tokens/s, TBT
        raise SynthError(f"--decode-steps {decode_steps}: give at least 1 decode step after the prefill (a sample "
                         "without one has no time per token to simulate)")
    check_seed(seed)  # the one rule for seeds (thoughtkv_base)
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
    estimate = estimate_synth(arch, prompt_tokens, decode_steps, config.block_size, samples, access)
    check_estimate(estimate, Path(out), allow_large)
    if progress:
        print(f"estimate: {estimate.text()}")
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
        rows = synth_sample(sample_id, index, arch, config, prompt_tokens, decode_steps, dtype, seed=seed,
                            access_params=access_params or {})
        writer.write_sample(rows["sample"], rows["steps"], rows["tokens"], rows["access"] if access else None)
    return Path(out)


# What one synthetic sample costs, in units that set it: a layer-step (one layer at one step: placement and its
# steps row) and a layer-block (one block's mass at one layer and step: the access model draws it in float64,
# access.parquet stores it). Measured on the 2-core development machine (qwen2-7b, block 16, prompts of 512 and
# 8,192 tokens, 250-8,000 decode steps; peak RSS of a fresh process, bytes written, wall time): the time fit is
# within -40%/+20% of what was measured, memory and disk within 25%. Samples are written one at a time, so the
# peak memory is one sample's.
SECONDS_PER_LAYER_STEP, SECONDS_PER_LAYER_BLOCK = 24e-6, 0.31e-6
PEAK_BYTES_PER_LAYER_BLOCK = {True: 55, False: 22}  # with / without access.parquet
BASE_PEAK_BYTES = 64 * 2**20
DISK_BYTES_PER_LAYER_STEP, DISK_BYTES_PER_LAYER_BLOCK = 15, 0.9  # the latter only with access.parquet


@dataclass(frozen=True)
class SynthEstimate:
    samples: int
    layer_steps: int  # per sample
    layer_blocks: int  # per sample
    memory_bytes: int  # peak, one sample at a time
    disk_bytes: int  # all samples
    seconds: float  # all samples

    def text(self) -> str:
        return (f"{self.samples:,} sample(s) x {self.layer_steps:,} layer-steps ({self.layer_blocks:,} layer-blocks): "
                f"~{size_text(self.memory_bytes)} peak memory, ~{size_text(self.disk_bytes)} on disk, "
                f"~{duration_text(self.seconds)}")


def estimate_synth(arch, prompt_tokens: int, decode_steps: int, block_size: int, samples: int,
                   access: bool) -> SynthEstimate:
    """Size, memory and time of a synthetic run from its shape (the coefficients above)."""
    import numpy as np

    lengths = prompt_tokens + np.arange(decode_steps + 1, dtype=np.int64)  # the logical length at each step
    layer_blocks = int((-(-lengths // block_size)).sum()) * arch.n_layers
    layer_steps = (decode_steps + 1) * arch.n_layers
    memory = BASE_PEAK_BYTES + PEAK_BYTES_PER_LAYER_BLOCK[access] * layer_blocks
    disk = samples * (DISK_BYTES_PER_LAYER_STEP * layer_steps + (DISK_BYTES_PER_LAYER_BLOCK * layer_blocks if access else 0))
    seconds = samples * (SECONDS_PER_LAYER_STEP * layer_steps + SECONDS_PER_LAYER_BLOCK * layer_blocks)
    return SynthEstimate(samples, layer_steps, layer_blocks, int(memory), int(disk), float(seconds))


def exceeded_limit(memory_bytes: float, disk_bytes: float, out: Path) -> str | None:
    """What an estimated run would exceed, as the start of a refusal ("~X of memory (...) but Y is available"),
    or None when memory available and the disk free at `out` (or its nearest existing parent) both suffice."""
    import shutil

    from traces.host import available_memory_bytes

    existing = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    limits = (("memory", memory_bytes, available_memory_bytes(), "available"),
              ("disk space", disk_bytes, shutil.disk_usage(existing).free, f"free at {existing}"))
    for what, need, have, where in limits:
        if need > have:
            return f"~{size_text(need)} of {what} but {size_text(have)} is {where}"
    return None


def check_estimate(estimate: SynthEstimate, out: Path, allow_large: bool) -> None:
    """Refuse, before writing, a run whose estimate exceeds the memory available or the disk free at --out."""
    exceeded = None if allow_large else exceeded_limit(estimate.memory_bytes, estimate.disk_bytes, out)
    if exceeded:
        raise SynthError(f"this run needs {exceeded} ({estimate.text()}); use fewer --decode-steps or --samples, a "
                         "larger --block-size, --no-access, or --allow-large to try anyway")


def size_text(n_bytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.3g} {unit}"
    return f"{int(n_bytes)} B"


def duration_text(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    return f"{seconds:.2g} s"


def synth_sample(sample_id: str, index: int, arch, config, prompt_tokens: int, decode_steps: int, dtype: str, *,
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
