"""Tracer overhead: tok/s of `hierarchy` + recording over untraced DynamicCache + sdpa, same model, same run.

The model is `random:tiny` (~20M-parameter Qwen2 from traces.architectures); both variants decode the same
prompt greedily for the same number of steps, interleaved over several rounds (the median of each is kept,
so background load hits both alike). Goal: ratio >= 0.8.

    .venv/bin/python tests/bench/tracer_overhead.py [--steps 128] [--rounds 3] [--prompt 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from tracer.cache import TieredCache
from tracer.decode import greedy_decode
from tracer.models import load_model
from tracer.recorder import Recorder
from tracer.run import TraceConfig, make_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--hbm-budget", default="0.5")
    parser.add_argument("--recall-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: a 20M model's decode is dispatch-bound, threads add jitter)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model("random:tiny")
    model = loaded.model
    prompt = torch.randint(3, 259, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    config = TraceConfig(model="random:tiny", task="gsm8k", out="-", policy="hierarchy", hbm_budget=args.hbm_budget,
                         evict_ratio=0.1, recall_k=args.recall_k)
    n_layers = model.config.num_hidden_layers

    def untraced() -> float:
        model.set_attn_implementation("sdpa")
        started = time.perf_counter()
        greedy_decode(model, prompt, DynamicCache(config=model.config), args.steps, set())
        return args.steps / (time.perf_counter() - started)

    def traced() -> float:
        model.set_attn_implementation("thoughtkv")
        recorder = Recorder()
        started = time.perf_counter()
        greedy_decode(model, prompt, TieredCache(n_layers, make_settings(config), recorder), args.steps, set(), recorder)
        recorder.steps_table(), recorder.access_table()  # the columns the writer receives
        return args.steps / (time.perf_counter() - started)

    untraced(), traced()  # warm-up
    base, tiered = [], []
    for _ in range(args.rounds):
        base.append(untraced())
        tiered.append(traced())
    base_tok_s, tiered_tok_s = statistics.median(base), statistics.median(tiered)
    print(f"model random:tiny ({loaded.manifest['n_params'] / 1e6:.1f}M params), prompt {args.prompt}, "
          f"{args.steps} steps, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    print(f"untraced DynamicCache+sdpa : {base_tok_s:8.1f} tok/s")
    print(f"hierarchy + recording      : {tiered_tok_s:8.1f} tok/s "
          f"(budget {args.hbm_budget}, evict 0.1, recall_k {args.recall_k}, block 16)")
    print(f"ratio traced/untraced      : {tiered_tok_s / base_tok_s:.3f}  (goal >= 0.8)")


if __name__ == "__main__":
    main()
