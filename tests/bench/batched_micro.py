"""Batched = sequential on the bundled micro model, at scale: `thoughtkv trace` on N `chains`
samples at B = 1 and at B = 16 for full, evict 30% and hierarchy 30% (evict 0), in one process. Prints, per
policy, whether every sample's generated text is identical, each accuracy with its 95% Wilson CI, the
traffic (attended fraction, recalled tokens per layer-step, H2D bytes per generated token at the micro model's
own KV size), and the B = 16 / B = 1 wall-time ratio.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/batched_micro.py [--n-samples 200] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from tracer.run import TraceConfig, run_trace
from traces import open_run
from traces.stats import wilson_interval

POLICIES = {
    "full": dict(policy="full"),
    "evict 30%": dict(policy="evict", hbm_budget=0.3),
    "hierarchy 30% e=0": dict(policy="hierarchy", hbm_budget=0.3, evict_ratio=0.0),
}


def trace(out: Path, policy: dict, batch_size: int, n_samples: int) -> tuple[float, object]:
    config = TraceConfig(model="micro", task="chains", out=str(out), n_samples=n_samples, batch_size=batch_size,
                         max_new_tokens=256, block_size=4, window_tokens=8, device="cpu", access=False, **policy)
    started = time.perf_counter()
    run_trace(config, progress=False)
    return time.perf_counter() - started, open_run(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-samples", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"micro, chains, {args.n_samples} samples, B = 1 vs B = {args.batch_size}, block 4, window 8, one thread")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, policy in POLICIES.items():
            runs = {b: trace(Path(tmp) / f"{name}-{b}".replace(" ", "_").replace("%", ""), policy, b, args.n_samples)
                    for b in (1, args.batch_size)}
            (wall_1, one), (wall_b, many) = runs[1], runs[args.batch_size]
            a, b = one.samples().set_index("sample_id"), many.samples().set_index("sample_id")
            same = a.index.equals(b.index) and (a["generated_text"] == b.loc[a.index, "generated_text"]).all()
            steps = one.steps(columns=["query_tokens", "logical_len", "hbm_tokens", "recalled_tokens", "bytes_h2d"])
            decode = steps[steps["query_tokens"] == 1]
            attended = ((decode["hbm_tokens"] + decode["recalled_tokens"]) / decode["logical_len"]).mean()
            h2d_per_token = decode["bytes_h2d"].sum() / a["generated_tokens"].sum()  # micro's own KV bytes
            line = []
            for label, frame in (("B=1", a), (f"B={args.batch_size}", b)):
                correct, n = int(frame["correct"].sum()), len(frame)
                low, high = wilson_interval(correct, n)
                line.append(f"{label} {correct}/{n} = {correct / n:.1%} [{low:.1%}, {high:.1%}]")
            print(f"{name:>18}: token-identical {same}; " + "; ".join(line)
                  + f"; attended {attended:.1%} of the context, recalled "
                  f"{decode['recalled_tokens'].mean():.1f} tokens/layer-step, H2D {h2d_per_token:,.0f} B/token "
                  f"(micro's KV); wall B={args.batch_size} / B=1 "
                  f"{wall_b / wall_1:.2f}")
            failures += not same or int(a["correct"].sum()) != int(b["correct"].sum())
    print("all token-identical with equal accuracy" if not failures else f"{failures} policies differ")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
