"""The recall rule's block bound, Quest's sum_d max(q_d * kmin_d, q_d * kmax_d), two ways, side by side in one
run: written out elementwise (v2 before this change: an [m, blocks, Hkv, group, d] intermediate per layer and
step) and as the one GEMM `tracer.transfer.KeyBounds.logit_bounds` computes ([q+, q-, 1] . [kmax, kmin, mask]), on
R1-Distill-Qwen-7B's attention geometry (28 query heads, 4 KV heads x 128) and on the bundled micro model's
(6 / 3 x 32), for B rows and a context of `blocks` x 16 tokens; one torch thread.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/recall_bound.py [--rounds 5]

Prints per case both times (median of the rounds), GEMM vs elementwise, and the largest difference between the
two bounds relative to the largest bound (rounding: the sums run in another order).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from tracer.transfer import KeyBounds

GEOMETRIES = {"qwen2-7b": (28, 4, 128), "micro": (6, 3, 32)}  # query heads, KV heads, head dim
CASES = ((1, 64), (1, 256), (1, 1024), (16, 64), (16, 256))  # (rows, blocks)


def elementwise(query, key_min, key_max):
    """Quest's bound as written: [m, Hkv, group, blocks]."""
    q = query[:, None]  # [m, 1, Hkv, group, d]
    bound = torch.maximum(q * key_min[:, :, :, None], q * key_max[:, :, :, None]).sum(-1)
    return bound.permute(0, 2, 3, 1)


def seconds(run, rounds: int) -> float:
    run()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    print(f"{'geometry':>9} {'B':>3} {'blocks':>6} {'elementwise ms':>15} {'GEMM ms':>8} {'speed-up':>9} {'max rel diff':>13}")
    for name, (n_heads, n_kv_heads, head_dim) in GEOMETRIES.items():
        for rows, blocks in CASES:
            bounds = KeyBounds(n_kv_heads, head_dim, torch.float32, torch.device("cpu"))
            bounds.reserve(rows, blocks)
            keys = torch.randn(rows * blocks, n_kv_heads, 16, head_dim, generator=generator)
            bounds.put(torch.arange(rows).repeat_interleave(blocks), torch.arange(blocks).repeat(rows), keys)
            bounds.mark(torch.arange(rows), torch.ones(rows, blocks, dtype=torch.bool))  # every block in DDR
            query = torch.randn(rows, n_kv_heads, n_heads // n_kv_heads, head_dim, generator=generator)
            # contiguous [rows, blocks, Hkv, d], as the stores held them before
            key_min, key_max = bounds.key_min[:, :blocks].contiguous(), bounds.key_max[:, :blocks].contiguous()
            written_out = functools.partial(elementwise, query, key_min, key_max)
            gemm = functools.partial(bounds.logit_bounds, query, slice(0, rows), blocks)
            slow, fast = seconds(written_out, args.rounds), seconds(gemm, args.rounds)
            want, got = written_out(), gemm()
            diff = float((got - want).abs().max() / want.abs().max())
            print(f"{name:>9} {rows:>3} {blocks:>6} {slow * 1e3:>15.2f} {fast * 1e3:>8.2f} {slow / fast:>8.1f}x "
                  f"{diff:>13.1e}")


if __name__ == "__main__":
    main()
