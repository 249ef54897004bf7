"""Decode steps through the tracer's tiered KV cache, for the framework-overhead microbenchmark.

A measured run pays, besides the model's arithmetic, the tiered cache's bookkeeping on every layer: recall
bounds, attention weights handed back, scoring, placement, recording. `tiered_decoder_factory(policy, ...)`
steps a (near-zero-work) model exactly as `tracer.decode.greedy_decode` does, with the same cache settings,
so that `tracer.calibrate.overhead.overhead_sweep` measures that bookkeeping as per-step and per-layer overhead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
        from tracer.decode import use_tiered_attention
        from tracer.recorder import Recorder

        use_tiered_attention(model)
        recorder = Recorder(record_access=True)
        cache = TieredCache(model.config.num_hidden_layers, make_settings(config), recorder)
        state = {"ids": prompt_ids, "positions": torch.arange(prompt_ids.shape[1], device=prompt_ids.device)[None]}

        @torch.no_grad()
        def step() -> None:
            logits = model(input_ids=state["ids"], position_ids=state["positions"], cache=cache, use_cache=True,
                           logits_to_keep=1).logits[0, -1]
            token, _finite = int(logits.argmax()), bool(torch.isfinite(logits).all())
            recorder.end_step(0.0)
            state["ids"] = torch.tensor([[token]], device=prompt_ids.device)
            state["positions"] = torch.tensor([[cache.logical_len]], device=prompt_ids.device)

        step()  # the prefill
        return step

    return make_decoder
