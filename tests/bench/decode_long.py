"""Decode speed of the tiered cache at long contexts: tokens/s at 512, 4k and 16k tokens of context.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/decode_long.py [--contexts 512,4096,16384] [--steps 32]

A tiny random Qwen2 (`random:tiny`: 6 layers, 2 KV heads x 64, hidden 384) under the hierarchy policy at 30%
HBM (recall 4 blocks of 16 per layer and step, nothing evicted). For each context length C the prompt (random
token ids) is prefilled in chunks of `--chunk` tokens, then `--steps` tokens are decoded; the script prints
tokens/s, ms per step, and the entries one decode step attends per layer (HBM-resident + recalled), side by
side with the full cache (a DynamicCache under plain sdpa: the untraced reference).

What to expect, and why: with every policy a decode step's attention reads each entry it attends once, so its
cost grows linearly with the context (HBM share x C + recalled); the per-step bookkeeping of the tiered cache
(importance accumulation over all C positions, block scores, the placement sort) is also linear (the sort
C/b log(C/b) in blocks). No step is quadratic: the whole generation of n tokens costs O(n^2) in attention, as
any KV cache does. At small C the fixed per-step cost (6 layers of projections and MLP, Python overhead)
dominates, so tokens/s falls only slowly until the linear terms take over.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from tracer.cache import TieredCache  # noqa: E402
from tracer.decode import use_tiered_attention  # noqa: E402
from tracer.models import load_model  # noqa: E402
from tracer.recorder import Recorder  # noqa: E402
from tracer.run import TraceConfig, make_settings  # noqa: E402


def hierarchy_cache(n_layers: int, recorder: Recorder) -> TieredCache:
    config = TraceConfig(model="random:tiny", task="gsm8k", out="unused", policy="hierarchy", hbm_budget=0.3,
                         evict_ratio=0.0, block_size=16, recall_k=4)
    return TieredCache(n_layers, make_settings(config), recorder)


@torch.no_grad()
def prefill(model, cache, prompt: torch.Tensor, chunk: int, recorder: Recorder | None = None) -> int:
    """Feed the prompt in chunks (true positions); returns the last token's argmax."""
    logits = None
    for start in range(0, prompt.shape[1], chunk):
        ids = prompt[:, start : start + chunk]
        positions = torch.arange(start, start + ids.shape[1])[None]
        logits = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                       logits_to_keep=1).logits
        if recorder is not None:
            recorder.end_step(0.0)
    return int(logits[0, -1].argmax())


@torch.no_grad()
def decode_rate(model, cache, context: int, steps: int, first_token: int, recorder: Recorder | None = None,
                repeats: int = 3) -> float:
    """Tokens/s of greedy decoding after a `context`-token prefill: the best of `repeats` windows of `steps`
    consecutive steps (the context grows by steps x repeats, a few % of it), so that other processes on a
    shared machine inflate the figure as little as possible."""
    token, position, best_s = first_token, context, float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]),
                           cache=cache, use_cache=True, logits_to_keep=1).logits
            token, position = int(logits[0, -1].argmax()), position + 1
            if recorder is not None:
                recorder.end_step(0.0)  # the step counter only: timings are taken over the whole window
        best_s = min(best_s, time.perf_counter() - started)
    return steps / best_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,4096,16384")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed window")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows per context (the best is kept)")
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    loaded = load_model("random:tiny", "cpu", "float32", seed=0)
    model = loaded.model
    n_layers = model.config.num_hidden_layers
    generator = torch.Generator().manual_seed(0)
    print(f"model random:tiny ({n_layers} layers), cpu float32, {torch.get_num_threads()} thread(s), "
          f"best of {args.repeats} windows of {args.steps} decode steps per point, prefill in chunks of {args.chunk}")
    print(f"{'context':>8} {'tiered tok/s':>13} {'ms/step':>8} {'attended/layer':>15} {'full tok/s':>11} "
          f"{'ms/step':>8} {'tiered/full':>12}")
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        prompt = torch.randint(3, model.config.vocab_size, (1, context), generator=generator)
        use_tiered_attention(model)
        recorder = Recorder(record_access=False)
        cache = hierarchy_cache(n_layers, recorder)
        first = prefill(model, cache, prompt, args.chunk, recorder)
        tiered = decode_rate(model, cache, context, args.steps, first, recorder, args.repeats)
        table = recorder.steps_table()
        steps = pd.DataFrame({k: table[k] for k in ("step", "hbm_tokens", "recalled_tokens")})
        last = steps[steps["step"] == steps["step"].max()]
        attended = float((last["hbm_tokens"] + last["recalled_tokens"]).mean())  # per layer, last step
        from transformers import DynamicCache

        model.set_attn_implementation("sdpa")
        reference = DynamicCache()
        first = prefill(model, reference, prompt, args.chunk)
        full = decode_rate(model, reference, context, args.steps, first, repeats=args.repeats)
        rows.append((context, tiered, full))
        attended_text = f"{attended:,.0f}"
        print(f"{context:>8,} {tiered:>13.1f} {1e3 / tiered:>8.2f} {attended_text:>15} {full:>11.1f} "
              f"{1e3 / full:>8.2f} {tiered / full:>12.2f}")
    if len(rows) > 1:
        (c0, t0, f0), (c1, t1, f1) = rows[0], rows[-1]
        print(f"per-step time x{t0 / t1:.2f} tiered, x{f0 / f1:.2f} full from {c0:,} to {c1:,} tokens of "
              f"context (x{c1 / c0:.0f} longer): linear terms (attention over the attended entries, per-position "
              "bookkeeping) on top of a fixed per-step cost; no step is quadratic")


if __name__ == "__main__":
    main()
