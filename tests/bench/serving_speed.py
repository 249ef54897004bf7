"""Serving simulation speed: simulated seconds per wall second, the fast path against the DES, in one run.

qwen2-7b shapes (synthetic traces: 512-token prompts, 2,000 decode steps, 4 samples; `full` and `hierarchy`
at 30% HBM, recall_k 4), Poisson arrivals at 20 requests/s on h100-pcie, max batch 4096:

1. the fast path (simulator.serving_fast) on 600 s of arrivals: goal >= 60 simulated s per wall s;
2. the DES (simulator.serving, the reference) on 60 s of arrivals, and the fast path on the same 60 s, for the
   ratio (their summaries must agree: the script checks TBT p50 and the end time to 1e-9).

A third case serves the bundled micro hierarchy trace (traces/samples/micro-hierarchy-b30-e0) projected to
qwen2-7b with R1-7B GSM8K-like request lengths (`--as-model qwen2-7b --lengths r1-7b/gsm8k`): the projection and
the length classes are built inside the timed call.

"Simulated seconds" are the end of the last token (arrivals stop at the duration; the run drains). The wall
time is the whole simulate_serving call, loading the run's steps included (as a user waits for it); trace
generation is not timed.
Usage: .venv/bin/python tests/bench/serving_speed.py [--des-duration 60] [--duration 600]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from simulator.options import Projection, ServingConfig, SimOptions
from simulator.serving import simulate_serving
from simulator.synth import synth_run

PROFILE, RATE_PER_S, MAX_BATCH = "h100-pcie", 20.0, 4096


MICRO = Path(__file__).resolve().parents[2] / "traces" / "samples" / "micro-hierarchy-b30-e0"
PROJECTED = "micro h30 [as 7b]"  # the case served with --as-model qwen2-7b --lengths r1-7b/gsm8k


def traces(root: Path) -> dict[str, Path]:
    common = dict(model="qwen2-7b", prompt_tokens=512, decode_steps=2000, samples=4, access=False)
    return {
        "full": synth_run(root / "full", policy="full", **common),
        "hierarchy 30%": synth_run(root / "h30", policy="hierarchy", hbm_budget=0.3, recall_k=4, **common),
        PROJECTED: MICRO,
    }


def timed(engine: str, run: Path, duration_s: float):
    projected = dict(projection=Projection("qwen2-7b"), lengths="r1-7b/gsm8k") if run == MICRO else {}
    config = ServingConfig(rate_per_s=RATE_PER_S, duration_s=duration_s, max_batch=MAX_BATCH,
                           options=SimOptions(engine=engine), **projected)
    start = time.perf_counter()
    result = simulate_serving(run, PROFILE, config)
    return result.summary, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals for the fast path")
    parser.add_argument("--des-duration", type=float, default=60.0, help="seconds of arrivals for the DES")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = traces(Path(tmp))
        print(f"qwen2-7b, {PROFILE}, {RATE_PER_S:g} req/s, max batch {MAX_BATCH}")
        header = f"{'policy':<14} {'engine':<5} {'arrivals s':>10} {'simulated s':>11} {'tokens':>10} " \
                 f"{'wall s':>8} {'sim s/wall s':>12} {'TBT p50 ms':>10}"
        print(header)
        print("-" * len(header))
        for name, run in runs.items():
            rows = []
            for engine, duration in (("fast", args.duration), ("fast", args.des_duration), ("des", args.des_duration)):
                summary, wall_s = timed(engine, run, duration)
                rows.append((engine, duration, summary, wall_s))
                print(f"{name:<14} {engine:<5} {duration:>10g} {summary['end_s']:>11.1f} {summary['tokens']:>10} "
                      f"{wall_s:>8.2f} {summary['end_s'] / wall_s:>12.1f} {1e3 * summary['tbt_p50_s']:>10.2f}")
            (_, _, fast, fast_s), (_, _, des, des_s) = rows[1], rows[2]
            same = all(math.isclose(fast[k], des[k], rel_tol=1e-9) for k in ("end_s", "tbt_p50_s", "tbt_p99_s"))
            print(f"{name:<14} fast / DES on {args.des_duration:g} s of arrivals: {des_s / fast_s:.1f}x faster, "
                  f"summaries {'agree' if same else 'DIFFER'} to 1e-9")


if __name__ == "__main__":
    main()
