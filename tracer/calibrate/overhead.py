"""The framework's fixed cost of a decode step: Python, module dispatch, kernel launches, cache bookkeeping.

Measured on models that do almost no arithmetic (hidden size 32, vocabulary 64: every kernel is tiny), with
1, 2, 4, 8 ... layers, so that a decode step's time is pure overhead; the fit
`step_s = step_overhead_s + n_layers * layer_overhead_s` gives the two `OverheadSpec` terms. Optionally each
layer also streams the real model's weights (`weights=`), so that the overhead is measured with caches as
cold as in a real decode step, and the weights' own time is subtracted afterwards (calibrate.py). The model is a
real Qwen2 from transformers (the layout of `random:tiny` and `random:qwen2-7b`), stepped by the same decode
code the measured run uses, so that the overhead it pays is the one calibrated. The test trace never enters.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tracer.calibrate.bench import STATISTICS, ModelWeights, Series, Timing

# A Qwen2 whose every matrix is a few KB: arithmetic and memory traffic are negligible next to dispatch.
NEAR_ZERO_SHAPES = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        intermediate_size=32, vocab_size=64, tie_word_embeddings=True)

# make_decoder(model, prompt_ids) -> step(): decodes one token; the measured run's decode code, or the plain
# DynamicCache loop below when the caller has no tiered cache.
DecoderFactory = Callable[[torch.nn.Module, torch.Tensor], Callable[[], None]]


def near_zero_model(n_layers: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_hidden_layers=n_layers, max_position_embeddings=4096, **NEAR_ZERO_SHAPES)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()


def dynamic_cache_decoder(model: torch.nn.Module, prompt_ids: torch.Tensor) -> Callable[[], None]:
    """Greedy decode with transformers' DynamicCache and true position ids: the untraced baseline loop."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    state = {"position": prompt_ids.shape[1]}
    with torch.inference_mode():
        logits = model(input_ids=prompt_ids, cache=cache, use_cache=True).logits
    state["token"] = logits[:, -1:].argmax(-1)

    @torch.inference_mode()
    def step() -> None:
        position = torch.tensor([[state["position"]]], device=prompt_ids.device)
        out = model(input_ids=state["token"], position_ids=position, cache=cache, use_cache=True)
        state["token"] = out.logits[:, -1:].argmax(-1)  # argmax forces the step to finish, as a real loop does
        state["position"] += 1

    return step


def time_decode_steps_s(step: Callable[[], None], n_steps: int, timing: Timing) -> float:
    """Time of one decode step, reduced over `n_steps` consecutive steps (on CUDA: wall time up to the device
    finishing the step; `timing.repeats` is not used: consecutive steps are the repeats)."""
    device = timing.device
    clock = time.perf_counter if device.type == "cuda" else timing.clock
    for _ in range(timing.warmup):
        step()
    times = []
    for _ in range(n_steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(clock() - start)
    return STATISTICS[timing.statistic](times)


def overhead_sweep(
    layer_counts: list[int],
    dtype: torch.dtype,
    n_steps: int,
    timing: Timing,
    make_decoder: DecoderFactory = dynamic_cache_decoder,
    prompt_tokens: int = 16,
    weights: ModelWeights | None = None,
) -> Series:
    """Decode-step time of near-zero-work models with each layer count. With `weights`, every decoder layer
    first reads one layer of the real model's weights and the lm_head reads the real lm_head: the step then
    streams the memory a real decode step streams, so the framework's dispatch runs with the caches as cold as
    they really are (measured here: the same non-matmul ops cost ~2x more next to `tiny`'s weight reads than
    in a near-zero model alone). Subtracting the weights' own time (`layer_bytes / bandwidth`) leaves the
    overhead the simulator must add."""
    times = []
    for n_layers in layer_counts:
        model = near_zero_model(n_layers, dtype, timing.device)
        handles = []
        if weights is not None:
            handles = [layer.register_forward_pre_hook(lambda *_: weights.layer()) for layer in model.model.layers]
            handles.append(model.lm_head.register_forward_hook(lambda *_: weights.head()))
        prompt_ids = torch.arange(prompt_tokens, device=timing.device)[None] % NEAR_ZERO_SHAPES["vocab_size"]
        step = make_decoder(model, prompt_ids)
        times.append(time_decode_steps_s(step, n_steps, timing))
        for handle in handles:
            handle.remove()
    name = "decode_step_overhead" if weights is None else "decode_step_with_weights"
    return Series(name, [float(n) for n in layer_counts], times, "layers")
