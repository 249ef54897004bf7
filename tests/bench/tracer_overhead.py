"""Tracer overhead: tok/s of `hierarchy` + recording over untraced DynamicCache + sdpa, same model, same run.

Per model (default: `random:tiny`, a ~20M-parameter Qwen2 from traces.architectures, and `smollm2-135m`, the
real pretrained 30-layer LM) and batch size (1 and 16): both variants decode the same prompt (at B = 16, the
same prompt in every row) greedily for the same number of steps, interleaved over several rounds; the
traced/untraced ratio is the median of each round's pair (measured back to back, so a shared machine's slow
phase hits both), for the whole run (prefill included) and for its decode steps alone (from the end of the
prefill step). Untraced: a plain decode loop over a DynamicCache (batch-1 `greedy_decode`, or the same loop
over B rows); traced: `thoughtkv trace`'s loop (`decode_batch`) with the tiered cache and a recorder per row.
Goal: ratio >= 0.85 on smollm2-135m at B = 1 and B = 16. Then B = 16 over B = 1, and beside it the most that
batching the model's linear layers alone buys on this machine (a decode step's `nn.Linear`s timed at both).

    .venv/bin/python tests/bench/tracer_overhead.py [--models random:tiny,smollm2-135m] [--batches 1,16]
        [--steps 128] [--rounds 3] [--prompt 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

import torch
from transformers import DynamicCache

from tracer.cache import TieredCache
from tracer.decode import DecodeJob, decode_batch, frozen_heap, use_tiered_attention
from tracer.models import load_model
from tracer.recorder import Recorder
from tracer.run import TraceConfig, make_settings


def measure(spec: str, args) -> dict:
    loaded = load_model(spec, "cpu", "float32")
    model = loaded.model
    vocab = model.config.vocab_size
    prompt = torch.randint(3, min(vocab, 259), (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    # Geometry pinned (not the model's trace defaults), so that a figure compares across commits and models.
    config = TraceConfig(model=spec, task="gsm8k", out="-", policy="hierarchy", hbm_budget=args.hbm_budget,
                         evict_ratio=0.1, recall_k=args.recall_k, block_size=16, sink_tokens=4, window_tokens=32)
    n_layers = model.config.num_hidden_layers

    @torch.inference_mode()
    def untraced(batch: int) -> Rates:
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([prompt] * batch)
        positions = torch.arange(len(prompt))[None].expand(batch, -1)
        started = prefilled = time.perf_counter()
        for step in range(args.steps):
            logits = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            positions = torch.full((batch, 1), len(prompt) + step)
            ids.tolist()  # the host reads the next tokens, as every decode loop does
            if step == 0:
                prefilled = time.perf_counter()
        return Rates.of(batch, args.steps, started, prefilled, time.perf_counter())

    def traced(batch: int) -> Rates:
        use_tiered_attention(model)
        jobs = [DecodeJob(i, prompt, make_settings(config), Recorder()) for i in range(batch)]
        prefill = PrefillDone(batch)  # (the loop reports each row's step to its progress: the first B are the prefill)
        started = time.perf_counter()
        for job, _ in decode_batch(model, jobs, TieredCache(n_layers, jobs[0].settings), batch, args.steps, set(),
                                   progress=prefill):
            job.recorder.steps_table(), job.recorder.access_table()  # the columns the writer receives
        return Rates.of(batch, args.steps, started, prefill.at, time.perf_counter())

    @torch.inference_mode()
    def linear_layers_ms(batch: int) -> float:
        """One decode step's linear layers alone (every `nn.Linear` of the model in order, `batch` rows of one
        token; the weights read from memory as a step reads them): what batching can buy at most."""
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        inputs = {m.in_features: torch.randn(batch, m.in_features) for m in linears}
        best = float("inf")
        for _ in range(args.rounds + 1):
            started = time.perf_counter()
            for m in linears:
                m(inputs[m.in_features])
            best = min(best, time.perf_counter() - started)
        return best * 1e3

    results, linear_ms = {}, {}
    for batch in args.batches:
        untraced(batch), traced(batch)  # warm-up
        base, tiered = [], []
        for _ in range(args.rounds):
            base.append(untraced(batch))
            tiered.append(traced(batch))
        results[batch] = {field: (statistics.median(getattr(u, field) for u in base),
                                  statistics.median(getattr(t, field) for t in tiered),
                                  statistics.median(getattr(t, field) / getattr(u, field) for t, u in zip(tiered, base)))
                          for field in Rates._fields}
        linear_ms[batch] = linear_layers_ms(batch)
    return {"params_m": loaded.manifest["n_params"] / 1e6, "layers": n_layers, "by_batch": results,
            "linear_ms": linear_ms}


class Rates(NamedTuple):
    """One run's tokens/s: the whole run (prefill included), and its decode steps alone (every token after the
    first, from the end of the prefill step: the regime of a reasoning trace, thousands of steps per prompt)."""

    whole: float
    decode: float

    @classmethod
    def of(cls, batch: int, steps: int, started: float, prefilled: float, ended: float) -> Rates:
        return cls(batch * steps / (ended - started), batch * (steps - 1) / (ended - prefilled))


class PrefillDone:
    """A `decode_batch` progress that notes when the prefill step ends: once `batch` rows have reported a step."""

    def __init__(self, batch: int):
        self.batch, self.reported, self.at = batch, 0, None

    def update(self, n: int) -> None:
        self.reported += n
        if self.reported == self.batch:
            self.at = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="random:tiny,smollm2-135m")
    parser.add_argument("--batches", default="1,16", help="batch sizes, comma-separated (default: 1,16)")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--hbm-budget", default="0.5")
    parser.add_argument("--recall-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: a small model's ops are too short to split; threads add jitter)")
    args = parser.parse_args()
    args.batches = tuple(int(b) for b in args.batches.split(","))
    torch.set_num_threads(args.threads)
    print(f"prompt {args.prompt} tokens, {args.steps} steps, {args.rounds} rounds (median), torch threads "
          f"{torch.get_num_threads()}; traced = hierarchy {args.hbm_budget}, evict 0.1, recall_k {args.recall_k}, "
          "block 16, sink 4, window 32, recording on; ratio = median over rounds of each round's pair")
    for spec in args.models.split(","):
        with frozen_heap():  # as `thoughtkv trace` decodes (both sides measured in it)
            r = measure(spec, args)
        print(f"\n{spec} ({r['params_m']:.1f}M params, {r['layers']} layers)")
        print(f"{'B':>4} {'untraced tok/s':>15} {'traced tok/s':>13} {'traced/untraced':>16}  (goal >= 0.85)"
              f"   decode steps only: {'untraced':>9} {'traced':>8} {'ratio':>6}")
        for batch, by in r["by_batch"].items():
            (base, tiered, ratio), (d_base, d_tiered, d_ratio) = by["whole"], by["decode"]
            print(f"{batch:>4} {base:>15.1f} {tiered:>13.1f} {ratio:>16.3f}   {'':>19}{d_base:>9.1f} {d_tiered:>8.1f} "
                  f"{d_ratio:>6.3f}")
        widest = max(r["by_batch"])
        if widest > 1 and 1 in r["by_batch"]:
            wide, one = r["by_batch"][widest], r["by_batch"][1]
            print(f"B={widest} vs B=1 traced tok/s: {wide['whole'][1] / one['whole'][1]:.2f}x whole run, "
                  f"{wide['decode'][1] / one['decode'][1]:.2f}x decode steps (untraced "
                  f"{wide['whole'][0] / one['whole'][0]:.2f}x, {wide['decode'][0] / one['decode'][0]:.2f}x)")
            ms = r["linear_ms"]
            print(f"the model's linear layers alone, one decode step: {ms[1]:.1f} ms at B=1, {ms[widest]:.1f} ms at "
                  f"B={widest}: at most {widest * ms[1] / ms[widest]:.2f}x from batching them")


if __name__ == "__main__":
    main()
