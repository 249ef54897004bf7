"""The per-row tracer (v1: one compacting cache per row) against this one (v2: paged, batched), at batch 1,
side by side: tokens/s of `thoughtkv trace`'s decode loop (tracer.decode.decode_batch, B = 1) with hierarchy 30%,
recall_k 4, block 16 and recording on, on `random:tiny` and the bundled micro model, the two versions run
alternately (v1, v2, v1, v2, ...) as subprocesses, v1 from a temporary git worktree of `--rev` (the last commit
before v2's paged cache), so that drift of a shared machine hits both alike. Each run: one torch thread, a
frozen heap on both sides (v1 had no `frozen_heap`: it gets the same conditions), the decode time per token as
the time of `--steps` tokens less that of 1 token (the prefill cancels), the median of 5 repeats.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/tracer_v1_v2.py [--rounds 3] [--models random:tiny,micro]

Prints per model each version's ms per token (median over rounds), v2/v1 in tokens/s (goal >= 1.0) and the
ratio of each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
V1_REV = "6cd08fe"  # README: the 50% eviction figure ... (the parent of 020d944, v2's paged cache)

# Runs inside either checkout (its own `tracer` package, found through the working directory).
MEASURE = """
import gc, statistics, sys, time
import torch
from tracer.cache import TieredCache
from tracer.decode import DecodeJob, decode_batch, use_tiered_attention
from tracer.models import load_model
from tracer.recorder import Recorder
from tracer.run import TraceConfig, make_settings

spec, steps, prompt_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
model = load_model(spec, "cpu", "float32").model
vocab = model.config.vocab_size
prompt = torch.randint(3, min(vocab, 259), (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
config = TraceConfig(model=spec, task="chains", out="-", policy="hierarchy", hbm_budget=0.3, block_size=16,
                     sink_tokens=4, window_tokens=32, recall_k=4, max_new_tokens=steps)
use_tiered_attention(model)


def run(n):
    job = DecodeJob(0, prompt, make_settings(config), Recorder())
    started = time.perf_counter()
    for done, _ in decode_batch(model, [job], TieredCache(model.config.num_hidden_layers, job.settings), 1, n, set()):
        done.recorder.steps_table(), done.recorder.access_table()  # the columns the writer receives
    return time.perf_counter() - started


gc.collect()
gc.freeze()
run(8)
import tracer
print(tracer.__file__)  # which checkout's package ran (the caller checks)
print(statistics.median((run(steps) - run(1)) / (steps - 1) * 1e3 for _ in range(5)))
"""


def ms_per_token(checkout: Path, spec: str, args) -> float:
    done = subprocess.run([sys.executable, "-c", MEASURE, spec, str(args.steps), str(args.prompt)], cwd=checkout,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the measurement in {checkout} failed:\n{done.stderr[-2000:]}")
    package, result = done.stdout.strip().splitlines()[-2:]
    # `python -c` puts the working directory first on sys.path; a script would find the venv's editable install
    # (this checkout) instead, and compare v2 with itself.
    if not Path(package).resolve().is_relative_to(checkout.resolve()):
        raise SystemExit(f"the measurement in {checkout} imported {package}, not that checkout's tracer")
    return float(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default=V1_REV, help="the v1 commit")
    parser.add_argument("--models", default="random:tiny,micro")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="thoughtkv-v1-") as parent:
        v1 = Path(parent) / "v1"
        added = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(v1), args.rev],
                               capture_output=True, text=True, check=False)
        if added.returncode != 0:  # e.g. a shallow clone without that commit
            sys.exit(f"cannot check out {args.rev} (git: {added.stderr.strip()}); fetch it or pass --rev")
        try:
            print(f"v1 = {args.rev}, v2 = this checkout; decode_batch B = 1, hierarchy 0.3, recall_k 4, recording on; "
                  f"prompt {args.prompt}, {args.steps} tokens; {args.rounds} alternating rounds")
            for spec in args.models.split(","):
                times = {"v1": [], "v2": []}
                for _ in range(args.rounds):
                    times["v1"].append(ms_per_token(v1, spec, args))
                    times["v2"].append(ms_per_token(REPO, spec, args))
                old, new = statistics.median(times["v1"]), statistics.median(times["v2"])
                rounds = ", ".join(f"{a / b:.3f}" for a, b in zip(times["v1"], times["v2"], strict=True))
                print(f"{spec:>12}: v1 {old:.3f} ms/token, v2 {new:.3f} ms/token, v2/v1 tokens/s {old / new:.3f} "
                      f"(goal >= 1.0; per round {rounds})")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(v1)], check=False)


if __name__ == "__main__":
    main()
