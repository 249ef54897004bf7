"""What recording costs the host per row and decoder layer, at R1-7B's layer count: a 28-layer toy Qwen2 (hidden
64, 4 query / 2 KV heads, random weights) decodes 64 tokens after 128-token prompts under hierarchy 30%
(recall_k 4, block 16, `thoughtkv trace`'s loop, tracer.decode.decode_batch, in a frozen heap) with a recorder
per sample and without, interleaved over rounds (median); one torch thread, thread CPU time.

Printed per B: ms per decode step recorded and not, their difference per row and layer (what the README's
GPU estimate charges a traced step for recording), and the recording's own functions per step: the layers'
occupancy (block masses on the device, the rows' counts), the end of step (tracer.recorder.StepRows, built for
every row and layer at once, every `RESOLVE_EVERY` steps) and the tables a finished sample hands the writer (which
build the steps left). On a GPU the occupancy's device ops (per layer, or once per step for layers placed
together: tracer.cache.step.after_attention_of_layers) are launches, which the kernel counts of collect_throughput.py
already charge: the per-row-layer figure here is an upper bound of the host's recording work there.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/recording_cost.py [--batches 1,16] [--layers 28] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import tracer.attention  # noqa: F401  (registers the "thoughtkv" attention function)
import tracer.cache.layer as layer_module
import tracer.recorder as recorder_module
from tracer.cache import TieredCache
from tracer.decode import DecodeJob, decode_batch, frozen_heap
from tracer.recorder import Recorder
from tracer.run import TraceConfig, make_settings

PROMPT, STEPS = 128, 64
TIMED = ((layer_module, "occupancy"), (recorder_module.Recorder, "end_step"),
         (recorder_module.Recorder, "steps_table"), (recorder_module.Recorder, "access_table"))


def run(model, config: TraceConfig, prompts: torch.Tensor, steps: int, recorded: bool) -> float:
    """Thread seconds to decode `steps` tokens for each prompt (prefill included), every prompt in one batch."""
    jobs = [DecodeJob(i, row.tolist(), make_settings(config), Recorder() if recorded else None)
            for i, row in enumerate(prompts)]
    n_layers, batch = model.config.num_hidden_layers, len(jobs)
    started = time.thread_time()
    with frozen_heap():
        for job, _ in decode_batch(model, jobs, TieredCache(n_layers, jobs[0].settings), batch, steps, set()):
            if recorded:
                job.recorder.steps_table(), job.recorder.access_table()
    return time.thread_time() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spent = collections.Counter()

    def timed(name, function):
        @functools.wraps(function)
        def wrapper(*a, **k):
            started = time.thread_time()
            try:
                return function(*a, **k)
            finally:
                spent[name] += time.thread_time() - started
        return wrapper

    for owner, name in TIMED:
        setattr(owner, name, timed(name, getattr(owner, name)))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
        attn_implementation="thoughtkv", dtype=torch.float32).eval()
    config = TraceConfig(model="micro", task="chains", out="-", policy="hierarchy", hbm_budget=0.3, block_size=16,
                         sink_tokens=4, window_tokens=32, recall_k=4, max_new_tokens=STEPS)
    print(f"{args.layers}-layer toy Qwen2, hierarchy 30% recall_k 4, prompt {PROMPT}, {STEPS} steps, "
          f"median of {args.rounds} rounds, thread CPU time")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(3, 300, (batch, PROMPT), generator=torch.Generator().manual_seed(0))

        def per_step_ms(recorded: bool, prompts=prompts) -> float:  # decode steps alone: less a 1-token run
            return (run(model, config, prompts, STEPS, recorded) - run(model, config, prompts, 1, recorded)) \
                / (STEPS - 1) * 1e3

        run(model, config, prompts, 8, True)
        times: dict[bool, list[float]] = {True: [], False: []}
        own: list[dict[str, float]] = []
        for _ in range(args.rounds):
            spent.clear()
            times[True].append(per_step_ms(True))
            own.append({name: seconds / STEPS * 1e3 for name, seconds in spent.items()})  # (the 1-token run: ~0)
            times[False].append(per_step_ms(False))
        recorded, plain = statistics.median(times[True]), statistics.median(times[False])
        parts = {name: statistics.median(o.get(name, 0.0) for o in own) for _, name in TIMED}
        print(f"B={batch:<3d} recorded {recorded:7.2f} ms/step, not {plain:7.2f}: "
              f"{(recorded - plain) * 1e3 / (batch * args.layers):6.1f} us per row and layer; own functions "
              f"{sum(parts.values()):.3f} ms/step (occupancy {parts['occupancy']:.3f}, end of step "
              f"{parts['end_step']:.3f}, tables {parts['steps_table'] + parts['access_table']:.3f})")


if __name__ == "__main__":
    main()
