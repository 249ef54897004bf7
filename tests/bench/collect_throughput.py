"""Collection throughput: tokens/s of the traced decode (hierarchy 30% + recording, `thoughtkv trace`'s loop,
tracer.decode.decode_batch) at batch sizes 1, 8, 32 against HF `generate` with a plain DynamicCache + sdpa at
the same batch and tokens, on `random:tiny` and the bundled micro model; one torch thread, same process,
variants interleaved over rounds (the median of each is kept, so background load hits all alike).

Printed per model and B: untraced and traced tok/s, traced/untraced (goal >= 0.8), and at B = 1 the batch-1
loop `greedy_decode` (the v1 path) for v2/v1 (goal >= 1.0); then B = 32 vs B = 1 traced tok/s.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/collect_throughput.py [--steps 64] [--prompt 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from tracer.cache import TieredCache
from tracer.decode import DecodeJob, decode_batch, greedy_decode, use_tiered_attention
from tracer.models import load_model
from tracer.recorder import Recorder
from tracer.run import TraceConfig, make_settings

BATCHES = (1, 8, 32)


def measure(spec: str, args) -> dict:
    loaded = load_model(spec, "cpu", "float32")
    model = loaded.model
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, min(vocab, 259), (max(BATCHES), args.prompt), generator=generator)
    config = TraceConfig(model=spec, task="chains", out="-", policy="hierarchy", hbm_budget=0.3, block_size=16,
                         recall_k=4, max_new_tokens=args.steps)
    n_layers = model.config.num_hidden_layers

    def untraced(batch: int) -> float:
        model.set_attn_implementation("sdpa")
        ids = prompts[:batch]
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.steps,
                             min_new_tokens=args.steps, do_sample=False, cache=DynamicCache(config=model.config),
                             pad_token_id=0)
        assert out.shape[1] == args.prompt + args.steps
        return batch * args.steps / (time.perf_counter() - started)

    def traced(batch: int) -> float:
        use_tiered_attention(model)
        jobs = [DecodeJob(i, prompts[i].tolist(), make_settings(config), Recorder()) for i in range(batch)]
        started = time.perf_counter()
        for job, _ in decode_batch(model, jobs, TieredCache(n_layers, jobs[0].settings), batch, args.steps, set()):
            job.recorder.steps_table(), job.recorder.access_table()  # the columns the writer receives
        return batch * args.steps / (time.perf_counter() - started)

    def v1_loop() -> float:
        use_tiered_attention(model)
        recorder = Recorder()
        started = time.perf_counter()
        cache = TieredCache(n_layers, make_settings(config), recorder)
        greedy_decode(model, prompts[0].tolist(), cache, args.steps, set(), recorder)
        recorder.steps_table(), recorder.access_table()
        return args.steps / (time.perf_counter() - started)

    untraced(1), traced(1), v1_loop()  # warm-up
    runs = {("untraced", b): [] for b in BATCHES} | {("traced", b): [] for b in BATCHES} | {("v1", 1): []}
    for _ in range(args.rounds):
        for batch in BATCHES:
            runs["untraced", batch].append(untraced(batch))
            runs["traced", batch].append(traced(batch))
        runs["v1", 1].append(v1_loop())
    return {"params_m": loaded.manifest["n_params"] / 1e6, **{key: statistics.median(v) for key, v in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="random:tiny,micro")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"prompt {args.prompt} tokens, {args.steps} new tokens per sample, {args.rounds} rounds (median), "
          f"torch threads {torch.get_num_threads()}; traced = hierarchy 0.3, recall_k 4, block 16, recording on")
    for spec in args.models.split(","):
        r = measure(spec, args)
        print(f"\n{spec} ({r['params_m']:.1f}M params)")
        print(f"{'B':>4} {'untraced tok/s':>15} {'traced tok/s':>13} {'traced/untraced':>16}  (goal >= 0.8)")
        for batch in BATCHES:
            u, t = r["untraced", batch], r["traced", batch]
            print(f"{batch:>4} {u:>15.1f} {t:>13.1f} {t / u:>16.3f}")
        print(f"B=1 v2 (decode_batch) / v1 (greedy_decode): {r['traced', 1] / r['v1', 1]:.3f}  (goal >= 1.0)")
        print(f"B=32 vs B=1 traced tok/s: {r['traced', 32] / r['traced', 1]:.2f}x  "
              f"(untraced: {r['untraced', 32] / r['untraced', 1]:.2f}x)")


if __name__ == "__main__":
    main()
