"""What committing samples behind the decode loop (traces.WriteBehind on a thread, as `thoughtkv trace` writes on
a GPU) saves against committing each inline, where the loop waits (as it writes on a CPU): `run_trace` on the
micro model (hierarchy 30%, `--batch-size`, one torch thread), the two interleaved round by round in one process,
the other's order every second round.

Printed: the median of each round's paired ratio (behind / inline) of the whole run's wall time, of a decode
step's wall time (tracer.decode.decode_step, timed from outside) and of the trace's own `measured_step_us`.
The first falls by at most the commit's share of the run (access encoding, Parquet + zstd, fsync: a second core
takes it while the first decodes); the other two show what that second core's work costs the decode beside it
(the tables are built between steps either way, so no step waits for the writer): on a CPU, whose decode is the
host's own work, that cost is why `thoughtkv trace` writes inline there.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/write_behind.py [--samples 64] [--batch-size 16] [--rounds 8]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

import tracer.decode
import traces
from tracer.models import load_model
from tracer.run import TraceConfig, run_trace
from traces import WriteBehind, open_run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("micro", "cpu", "float32")
    step_wall_s: list[float] = []
    decode_step = tracer.decode.decode_step

    def timed_step(*a, **k):
        started = time.perf_counter()
        try:
            return decode_step(*a, **k)
        finally:
            step_wall_s.append(time.perf_counter() - started)

    def writer_class(background: bool) -> type:  # run_trace's, on a thread or not whatever the device
        class Forced(WriteBehind):
            def __init__(self, writer, depth: int = 2, **_):
                super().__init__(writer, depth, background=background)
        return Forced

    def one_run(mode: str, out: Path) -> tuple[float, float, float]:
        shutil.rmtree(out, ignore_errors=True)
        step_wall_s.clear()
        config = TraceConfig(model="micro", task="chains", out=str(out), policy="hierarchy", hbm_budget=0.3,
                             batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, n_samples=args.samples,
                             threads=1)
        with mock.patch.object(traces, "WriteBehind", writer_class(mode == "behind")), \
                mock.patch.object(tracer.decode, "decode_step", timed_step):
            started = time.perf_counter()
            run_trace(config, progress=False, loaded=loaded)
            run_s = time.perf_counter() - started
        steps = open_run(out).steps()
        measured_ms = steps.groupby(["sample_id", "step"]).measured_step_us.first().mean() / 1e3
        return run_s, statistics.mean(step_wall_s) * 1e3, measured_ms

    modes = ("inline", "behind")
    results: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        one_run("behind", Path(tmp) / "warm")
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                results[mode].append(one_run(mode, Path(tmp) / mode))
    print(f"micro, hierarchy 30%, {args.samples} chains samples x {args.max_new_tokens} new tokens at B = "
          f"{args.batch_size}, {args.rounds} rounds")
    for mode in modes:
        run_s, wall_ms, measured_ms = (statistics.median(r[i] for r in results[mode]) for i in range(3))
        print(f"{mode:>6}: run {run_s:6.2f} s, decode step wall {wall_ms:6.2f} ms, measured_step_us {measured_ms:6.2f} ms")
    ratios = [statistics.median(b[i] / a[i] for a, b in zip(results["inline"], results["behind"], strict=True))
              for i in range(3)]
    print(f"behind / inline (median of paired rounds): run {ratios[0]:.3f}, step wall {ratios[1]:.3f}, "
          f"measured step {ratios[2]:.3f}")


if __name__ == "__main__":
    main()
