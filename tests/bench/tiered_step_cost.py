"""Where a traced decode step's time goes, component by component: ms per decode step of the same prompts and
tokens through plain HF `generate` (DynamicCache + sdpa: collect_throughput.py's untraced reference), the
batch-1 loop on a DynamicCache, and `decode_batch` on the tiered cache under full (no recorder, recorder),
evict 30%, hierarchy 30% with recall_k 0 and hierarchy 30% (no recorder, recorder): each step adds one part
(paged append + attention with weights, recording, scoring + placement, recall). One torch thread, one
process, variants interleaved over rounds (median), in a frozen heap as `thoughtkv trace` decodes. Then the kernels a tiered decode step launches per decoder
layer, and what one launch of the tiered attention costs inside a step against the same call repeated at once
(the rest of the forward runs between a layer's ops: on a CPU each op then runs with cold caches), which is
the per-op price the goal traced/untraced >= 0.8 has to fit in.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/tiered_step_cost.py [--model micro] [--batch 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

import tracer.cache.layer as cache_module
from tracer.cache import TieredCache
from tracer.decode import DecodeJob, decode_batch, frozen_heap, greedy_decode, use_tiered_attention
from tracer.models import load_model
from tracer.recorder import Recorder
from tracer.run import TraceConfig, make_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="micro")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.model, "cpu", "float32").model
    n_layers, batch = model.config.num_hidden_layers, args.batch
    prompts = torch.randint(3, min(model.config.vocab_size, 259), (batch, args.prompt),
                            generator=torch.Generator().manual_seed(0))

    def config(policy: str, recall_k: int = 4) -> TraceConfig:
        return TraceConfig(model=args.model, task="chains", out="-", policy=policy, block_size=16, recall_k=recall_k,
                           sink_tokens=4, window_tokens=32,
                           hbm_budget=1.0 if policy == "full" else 0.3, max_new_tokens=args.steps)

    def generate(steps: int) -> None:
        model.set_attn_implementation("sdpa")
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, cache=DynamicCache(config=model.config), pad_token_id=0)

    def loop_dynamic(steps: int) -> None:
        model.set_attn_implementation("sdpa")
        for prompt in prompts:
            greedy_decode(model, prompt.tolist(), DynamicCache(config=model.config), steps, set())

    def tiered(trace_config: TraceConfig, record: bool):
        def run(steps: int) -> None:
            use_tiered_attention(model)
            jobs = [DecodeJob(i, prompts[i].tolist(), make_settings(trace_config), Recorder() if record else None)
                    for i in range(batch)]
            for job, _ in decode_batch(model, jobs, TieredCache(n_layers, jobs[0].settings), batch, steps, set()):
                if record:
                    job.recorder.steps_table(), job.recorder.access_table()
        return run

    variants = {
        "HF generate, DynamicCache + sdpa": generate,
        "batch-1 loop, DynamicCache + sdpa": loop_dynamic,
        "tiered full, no recorder": tiered(config("full"), False),
        "tiered full, recorded": tiered(config("full"), True),
        "tiered evict 30%, recorded": tiered(config("evict"), True),
        "tiered hierarchy 30% recall_k 0, recorded": tiered(config("hierarchy", 0), True),
        "tiered hierarchy 30%, no recorder": tiered(config("hierarchy"), False),
        "tiered hierarchy 30%, recorded": tiered(config("hierarchy"), True),
    }
    if batch > 1:
        del variants["batch-1 loop, DynamicCache + sdpa"]

    def step_ms(run) -> float:
        """ms per decode step: a run of `steps` tokens less a run of one (prefill and set-up cancel out)."""
        started = time.perf_counter()
        run(args.steps)
        middle = time.perf_counter()
        run(1)
        return ((middle - started) - (time.perf_counter() - middle)) / (args.steps - 1) * 1e3

    times = {name: [] for name in variants}
    with frozen_heap():  # as `thoughtkv trace` decodes
        for run in variants.values():
            run(4)
        for _ in range(args.rounds):
            for name, run in variants.items():
                times[name].append(step_ms(run))
    reference = statistics.median(times["HF generate, DynamicCache + sdpa"])
    print(f"{args.model}, {n_layers} layers, B={batch}, prompt {args.prompt}, {args.steps} steps, median of "
          f"{args.rounds} rounds; block 16, recall_k 4")
    print(f"{'variant':44s} {'ms/step':>8} {'vs generate':>12} {'per layer vs generate':>22}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:44s} {median:8.3f} {reference / median:11.3f}x {(median - reference) / n_layers * 1e3:+18.0f} us")
    print(f"traced/untraced >= 0.8 allows {reference * 0.25 / n_layers * 1e3:.0f} us per layer and step beyond generate")

    # One launch of the tiered attention inside a step, against the same call repeated at once.
    inside, again = [], []
    attend = cache_module.attend

    def timed(*call_args, **call_kwargs):
        started = time.perf_counter()
        result = attend(*call_args, **call_kwargs)
        middle = time.perf_counter()
        attend(*call_args, **call_kwargs)
        inside.append(middle - started)
        again.append(time.perf_counter() - middle)
        return result

    cache_module.attend = timed
    try:
        tiered(config("hierarchy"), True)(args.steps)
    finally:
        cache_module.attend = attend
    first, repeat = statistics.median(inside) * 1e6, statistics.median(again) * 1e6
    # (a decode step's: the empty-slot mask, the logits GEMM that adds it, softmax, the output GEMM; the layers'
    # mean and max over heads run once per step, after the last layer: tracer.cache.step.after_attention_of_layers)
    print(f"tiered attention (4 ops: mask, GEMM, softmax, GEMM): {first:.0f} us inside a step, "
          f"{repeat:.0f} us repeated at once "
          f"({first / repeat:.1f}x): about {first / 4:.0f} us per op in context")


if __name__ == "__main__":
    main()
