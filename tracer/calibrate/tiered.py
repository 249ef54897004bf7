"""Decode steps through the tracer's tiered KV cache, for the framework-overhead microbenchmark.

A measured run pays, besides the model's arithmetic, the tiered cache's bookkeeping on every layer: recall
bounds, attention weights handed back, scoring, placement, recording. `tiered_decoder_factory(policy, ...)`
steps a (near-zero-work) model through the trace's own step (`tracer.decode.decode_step`, what
`decode_batch` runs at batch 1), with the same cache settings,
so that `tracer.calibrate.overhead.overhead_sweeps` measures that bookkeeping as per-step and per-layer overhead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

# One layer timer per model: `token_cost_sweep` makes a decoder per prompt on the same model, and a timer per
# decoder would stack (each wraps every layer's forward), so later prompts would pay the earlier ones' timers.
_TIMERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The sweeps decode at most warmup + overhead_steps (64) + one settling step per visit (overhead.py) tokens per
# decoder; past this the pools still grow.
RESERVED_DECODE_STEPS = 128


def tiered_decoder_factory(
    policy: str, hbm_budget: str | float = 0.5, evict_ratio: float = 0.0, block_size: int = 16,
    scorer: str = "h2o", recall_k: int = 4, sink_tokens: int = 4, window_tokens: int = 32,
) -> Callable[[torch.nn.Module, torch.Tensor], Callable[[], None]]:
    from tracer.run import TraceConfig, make_settings

    # Only the cache settings of this config are used (no task is loaded, nothing is written).
    config = TraceConfig(model="calibration", task="chains", out="", policy=policy, hbm_budget=hbm_budget,
                         evict_ratio=evict_ratio, block_size=block_size, scorer=scorer, recall_k=recall_k,
                         sink_tokens=sink_tokens, window_tokens=window_tokens)

    def make_decoder(model: torch.nn.Module, prompt_ids: torch.Tensor) -> Callable[[], None]:
        from tracer.cache import TieredCache
        from tracer.decode import LayerTimer, decode_grad_mode, decode_step, step_clock, use_tiered_attention
        from tracer.recorder import Recorder

        use_tiered_attention(model)
        recorder = Recorder(record_access=True)
        settings = make_settings(config)
        cache = TieredCache(model.config.num_hidden_layers, settings)
        cache.reset_row(0, settings, recorder)  # as decode_batch admits a sample
        # ... and sizes its pools once (a pool that grew mid-sweep would time its copies as overhead).
        cache.reserve_length(prompt_ids.shape[1], prompt_ids.shape[1] + RESERVED_DECODE_STEPS)
        # The trace's own step (decode_batch -> decode_step): the layer timer, the one deferred copy, the
        # recorder's end of step; one row, as a batch-1 trace.
        timer = _TIMERS.get(model)
        if timer is None:
            timer = _TIMERS[model] = LayerTimer(model)
        clock = step_clock(prompt_ids.device)[1]
        synchronize = torch.cuda.synchronize if prompt_ids.device.type == "cuda" else (lambda: None)
        state = {"ids": prompt_ids, "positions": torch.arange(prompt_ids.shape[1], device=prompt_ids.device)[None]}

        def moved_so_far() -> int:  # blocks that ever left HBM (offloads, evictions), summed over layers
            return sum(layer.n_ddr_blocks + layer.n_evicted_blocks for layer in cache.rows[0])

        @decode_grad_mode(settings)()  # as the trace decodes
        def step() -> tuple[bool, float, int]:
            before = moved_so_far()
            _, tokens, _finite, wall_us, layer_us = decode_step(model, cache, [0], state["ids"], state["positions"],
                                                               timer, clock, synchronize)
            recorder.end_step(wall_us, layer_us, timer.read_deferred_us())
            state["ids"] = torch.tensor([[tokens[0]]], device=prompt_ids.device)
            state["positions"] = torch.tensor([[cache.rows[0][0].logical_len]], device=prompt_ids.device)
            # The step's time as the trace records it (measured_step_us: the forward and the step's one copy;
            # not the recorder's end of step or this loop's bookkeeping), so the fit is what a trace measures.
            attended = recorder.columns["hbm_tokens"][-1] + recorder.columns["recalled_tokens"][-1]
            layers_s = None if layer_us is None else sum(layer_us) / 1e6
            return moved_so_far() != before, wall_us / 1e6, int(attended), layers_s

        step()  # the prefill
        return step

    return make_decoder
