"""Collection throughput: tokens/s of the traced decode (hierarchy 30% + recording, `thoughtkv trace`'s loop,
tracer.decode.decode_batch) at batch sizes 1, 8, 32 against HF `generate` with a plain DynamicCache + sdpa at
the same batch and tokens, on `random:tiny`, the bundled micro model (B = 1, 8, 32) and the real 30-layer
`smollm2-135m` (B = 1, 16); one torch thread, same process,
variants interleaved over rounds (the median of each is kept, so background load hits all alike), in a frozen
heap as `thoughtkv trace` decodes (tracer.decode.frozen_heap; both sides).

Printed per model and B: untraced and traced tok/s (medians), traced/untraced (goal >= 0.8: the median of each
round's ratio, its traced and untraced runs back to back, and in brackets the ratio of the medians), beside the same for the
decode steps alone (the time of a run of `--steps` tokens less that of a 1-token run, prefill included in both:
the traced loop prefills each sample alone, as continuous refill does, and `generate` the whole batch at once,
while a reasoning trace is thousands of decode steps per prompt), and at B = 1 the batched
loop against the batch-1 loop `greedy_decode` on the same cache; then B = 32 vs B = 1 traced tok/s (the whole run and
its decode steps); then the kernels
a decode step launches per decoder layer, traced and untraced, counted as `tracer/calibrate/launches.py`
counts them (the launch-bound regime of an eager GPU step, where time follows launches, not arithmetic).

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/collect_throughput.py [--steps 64] [--prompt 128] [--rounds 5]
        [--batches 1,8,32] [--recall-k 4]

`--recall-k 0` runs the same hierarchy without recall: against the default, what the recall costs a step.
`--recall-rule score|oracle` and `--recall-buffer-blocks N` time the other rules and the recall buffer (the
defaults, quest and no buffer, are the figures to compare across checkouts).

The per-row, compacting tracer (v1) against this one at B = 1: tests/bench/tracer_v1_v2.py
(run from another checkout, a script would import this checkout's `tracer`, the venv's editable install).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

import tracer.decode
from tracer.cache import TieredCache
from tracer.calibrate.launches import NO_KERNEL_OPS
from tracer.decode import DecodeJob, decode_batch, frozen_heap, greedy_decode, use_tiered_attention
from tracer.models import load_model
from tracer.recorder import Recorder
from tracer.run import TraceConfig, make_settings

BATCHES = (1, 8, 32)
# The real 30-layer LM at the batch sizes the goals name (B = 16 >= 6x B = 1); the micro models at 1/8/32.
BATCHES_BY_MODEL = {"smollm2-135m": (1, 16)}


class KernelCount(TorchDispatchMode):
    """Dispatched ops that launch a kernel (views and allocations do not), as the hf-eager estimate counts."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in NO_KERNEL_OPS:
            self.n += 1
        return func(*args, **(kwargs or {}))


def measure(spec: str, args) -> dict:
    batches = args.batches or BATCHES_BY_MODEL.get(spec, BATCHES)
    loaded = load_model(spec, "cpu", "float32")
    model = loaded.model
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, min(vocab, 259), (max(batches), args.prompt), generator=generator)
    # Geometry pinned (not the model's trace defaults), so that a figure compares across commits and models.
    config = TraceConfig(model=spec, task="chains", out="-", policy="hierarchy", hbm_budget=0.3, block_size=16,
                         sink_tokens=4, window_tokens=32, recall_k=args.recall_k, max_new_tokens=args.steps,
                         recall_rule=args.recall_rule, recall_buffer_blocks=args.recall_buffer_blocks)
    n_layers = model.config.num_hidden_layers

    def untraced(batch: int, steps: int) -> float:
        """Seconds for `batch` samples of `steps` new tokens (prefill included)."""
        model.set_attn_implementation("sdpa")
        ids = prompts[:batch]
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, cache=DynamicCache(config=model.config), pad_token_id=0)
        assert out.shape[1] == args.prompt + steps
        return time.perf_counter() - started

    def traced(batch: int, steps: int) -> float:
        use_tiered_attention(model)
        jobs = [DecodeJob(i, prompts[i].tolist(), make_settings(config), Recorder()) for i in range(batch)]
        started = time.perf_counter()
        for job, _ in decode_batch(model, jobs, TieredCache(n_layers, jobs[0].settings), batch, steps, set()):
            job.recorder.steps_table(), job.recorder.access_table()  # the columns the writer receives
        return time.perf_counter() - started

    def v1_loop() -> float:
        use_tiered_attention(model)
        recorder = Recorder()
        started = time.perf_counter()
        cache = TieredCache(n_layers, make_settings(config), recorder)
        greedy_decode(model, prompts[0].tolist(), cache, args.steps, set(), recorder)
        recorder.steps_table(), recorder.access_table()
        return args.steps / (time.perf_counter() - started)

    def launches_per_layer(batch: int) -> tuple[float, float]:
        """(traced, untraced) kernels per decoder layer and decode step: the difference of two run lengths
        divided by the extra steps, so prefills and the loops' set-up cancel out. Both under no_grad (as
        `generate` runs): under inference_mode, as `thoughtkv trace` decodes (tracer.decode.decode_grad_mode), a
        dispatch mode sees composite ops before they decompose (`to`, even when it copies nothing; `linear`)."""
        out = []
        for run in (traced, untraced):
            counts = []
            for steps in (args.steps // 2, args.steps):
                with mock.patch.object(tracer.decode, "decode_grad_mode", lambda settings: torch.no_grad), \
                        KernelCount() as counter:
                    run(batch, steps)
                counts.append(counter.n)
            out.append((counts[1] - counts[0]) / (args.steps - args.steps // 2) / n_layers)
        return out[0], out[1]

    untraced(1, args.steps), traced(1, args.steps), v1_loop()  # warm-up
    runs = {("untraced", b): [] for b in batches} | {("traced", b): [] for b in batches} | {("v1", 1): []}
    decode = {("untraced", b): [] for b in batches} | {("traced", b): [] for b in batches}
    for _ in range(args.rounds):
        for batch in batches:
            for name, run in (("untraced", untraced), ("traced", traced)):
                whole, first = run(batch, args.steps), run(batch, 1)  # first: the prefill and its token
                runs[name, batch].append(batch * args.steps / whole)
                decode[name, batch].append(batch * (args.steps - 1) / (whole - first))
        runs["v1", 1].append(v1_loop())
    launches = {batch: launches_per_layer(batch) for batch in sorted({1, min(16, max(batches))})}
    # Traced/untraced per round, each pair measured back to back, then the median: a shared machine's slow and
    # fast phases last seconds (a round's untraced B = 1 here has read 173 and 277 tok/s in one process), so
    # a ratio of the two medians can pair a slow phase's traced with a fast one's untraced.
    paired = {batch: (statistics.median(t / u for t, u in zip(runs["traced", batch], runs["untraced", batch])),
                      statistics.median(t / u for t, u in zip(decode["traced", batch], decode["untraced", batch])))
              for batch in batches}
    return {"params_m": loaded.manifest["n_params"] / 1e6, "launches": launches, "paired": paired, "batches": batches,
            "decode": {key: statistics.median(v) for key, v in decode.items()},
            **{key: statistics.median(v) for key, v in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="random:tiny,micro,smollm2-135m")
    parser.add_argument("--batches", default=None,
                        help=f"batch sizes, comma-separated (default: {','.join(map(str, BATCHES))}; smollm2-135m 1,16)")
    parser.add_argument("--recall-k", type=int, default=4,
                        help="blocks recalled per layer and step (0: hierarchy without recall, what recall costs)")
    parser.add_argument("--recall-rule", default="quest", help="the traced recall rule (default: quest)")
    parser.add_argument("--recall-buffer-blocks", type=int, default=0,
                        help="a per-layer LRU of recalled blocks (0: none, the default)")
    args = parser.parse_args()
    args.batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else None
    torch.set_num_threads(1)
    print(f"prompt {args.prompt} tokens, {args.steps} new tokens per sample, {args.rounds} rounds (median), "
          f"torch threads {torch.get_num_threads()}; traced = hierarchy 0.3, recall_k {args.recall_k}, rule "
          f"{args.recall_rule}, buffer {args.recall_buffer_blocks}, block 16, sink 4, window 32, recording on")
    for spec in args.models.split(","):
        with frozen_heap():  # as `thoughtkv trace` decodes (both sides measured in it)
            r = measure(spec, args)
        print(f"\n{spec} ({r['params_m']:.1f}M params)")
        print(f"{'B':>4} {'untraced tok/s':>15} {'traced tok/s':>13} {'traced/untraced':>16}  (goal >= 0.8)"
              f"   decode steps only: {'untraced':>9} {'traced':>8} {'ratio':>6}   "
              "(ratios: median over rounds of each round's pair; of the medians in brackets)")
        for batch in r["batches"]:
            u, t = r["untraced", batch], r["traced", batch]
            du, dt = r["decode"]["untraced", batch], r["decode"]["traced", batch]
            whole, steps = r["paired"][batch]
            print(f"{batch:>4} {u:>15.1f} {t:>13.1f} {whole:>8.3f} ({t / u:.3f})   {'':>19}{du:>9.1f} {dt:>8.1f} "
                  f"{steps:>6.3f} ({dt / du:.3f})")
        print(f"B=1 decode_batch / greedy_decode (the batched loop vs the batch-1 loop, one cache): "
              f"{r['traced', 1] / r['v1', 1]:.3f}")
        widest = max(r["batches"])
        decode = r["decode"]
        print(f"B={widest} vs B=1 traced tok/s: {r['traced', widest] / r['traced', 1]:.2f}x  "
              f"(untraced: {r['untraced', widest] / r['untraced', 1]:.2f}x); decode steps only: "
              f"{decode['traced', widest] / decode['traced', 1]:.2f}x (untraced: "
              f"{decode['untraced', widest] / decode['untraced', 1]:.2f}x)")
        for batch, (tiered, plain) in r["launches"].items():
            print(f"B={batch}: kernels launched per decoder layer and decode step: traced {tiered:.0f}, untraced "
                  f"{plain:.0f} ({tiered / plain:.1f}x)")


if __name__ == "__main__":
    main()
