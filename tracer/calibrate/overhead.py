"""The framework's fixed cost of a decode step: Python, module dispatch, kernel launches, cache bookkeeping.

Measured on models that do almost no arithmetic (hidden size 32, vocabulary 64: every kernel is tiny), with
1, 2, 4, 8 ... layers, so that a decode step's time is pure overhead; the fit
`step_s = step_overhead_s + n_layers * layer_overhead_s` gives the two `OverheadSpec` terms. Optionally each
layer also streams the real model's weights (`weights=`), so that the overhead is measured with caches as
cold as in a real decode step, and the weights' own time is subtracted afterwards (calibrate.py). The model is a
real Qwen2 from transformers (the layout of `random:tiny` and `random:qwen2-7b`), stepped by the same decode
code the measured run uses, so that the overhead it pays is the one calibrated. The test trace never enters.

Steps in which the tiered cache's placement moves blocks (a block completes under a binding budget: every 16th
step) cost more (up to ~2x a quiet layer for evict / hierarchy on a CPU: the profile's `placement_*` series), so
they are timed apart: the quiet steps give the fit above, the moving ones the placement overhead per layer
(`placement_extra`), which the simulator charges on the layer-steps a trace says moved blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tracer.calibrate.bench import STATISTICS, ModelWeights, Series, Timing

# A Qwen2 whose every matrix is a few KB: arithmetic and memory traffic are negligible next to dispatch.
NEAR_ZERO_SHAPES = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        intermediate_size=32, vocab_size=64, tie_word_embeddings=True)

# make_decoder(model, prompt_ids) -> step(): decodes one token; returns None, or (whether the placement moved
# blocks, the step's seconds as the trace records them, the tokens a layer attended, the decoder layers' summed
# seconds by the trace's layer timer or None); the measured run's decode code, or the plain DynamicCache loop
# below when the caller has no tiered cache.
StepOutcome = tuple[bool, float, int, float | None]
DecoderFactory = Callable[[torch.nn.Module, torch.Tensor], Callable[[], StepOutcome | None]]


def model_shapes(arch) -> dict:
    """The Qwen2 config fields of an architecture's own shapes (traces.architectures.Architecture)."""
    return dict(hidden_size=arch.hidden_size, num_attention_heads=arch.n_heads, num_key_value_heads=arch.n_kv_heads,
                head_dim=arch.head_dim, intermediate_size=arch.intermediate_size, vocab_size=arch.vocab_size,
                tie_word_embeddings=arch.tie_word_embeddings)


def near_zero_model(n_layers: int, dtype: torch.dtype, device: torch.device, shapes: dict | None = None
                    ) -> torch.nn.Module:
    """A Qwen2 of `n_layers` with NEAR_ZERO_SHAPES, or with `shapes` (an architecture's own: `model_shapes`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_hidden_layers=n_layers, max_position_embeddings=4096, **(shapes or NEAR_ZERO_SHAPES))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()


def dynamic_cache_decoder(model: torch.nn.Module, prompt_ids: torch.Tensor) -> Callable[[], None]:
    """Greedy decode with transformers' DynamicCache and true position ids: the untraced baseline loop."""
    from transformers import DynamicCache

    from tracer.compat import cache_kwargs

    cache = DynamicCache(config=model.config)
    state = {"position": prompt_ids.shape[1]}
    with torch.inference_mode():
        logits = model(input_ids=prompt_ids, **cache_kwargs(model, cache), use_cache=True).logits
    state["token"] = logits[:, -1:].argmax(-1)

    @torch.inference_mode()
    def step() -> None:
        position = torch.tensor([[state["position"]]], device=prompt_ids.device)
        out = model(input_ids=state["token"], position_ids=position, **cache_kwargs(model, cache), use_cache=True)
        state["token"] = out.logits[:, -1:].argmax(-1)  # argmax forces the step to finish, as a real loop does
        state["position"] += 1

    return step


@dataclass(frozen=True)
class StepTimes:
    """Decode-step time reduced over the steps where no block moved (`quiet_s`) and over those where the
    placement moved blocks (`moving_s`; None when none did, e.g. the full cache or a DynamicCache)."""

    quiet_s: float
    moving_s: float | None
    attended_tokens: float | None = None  # mean tokens a layer attended over the timed steps (tiered decoders)
    layers_s: float | None = None  # the decoder layers' share of a quiet step (the trace's layer timer)
    rest_s: float | None = None  # the rest of a quiet step (embedding, LM head, sampling, the step's copy)


def time_interleaved_decode_steps_s(steps: list[Callable[[], StepOutcome | None]], n_steps: int, timing: Timing,
                                    visit_steps: int = 1) -> list[StepTimes]:
    """Each decoder's decode-step time, reduced over `n_steps` of its steps (on CUDA: wall time up to the device
    finishing the step; `timing.repeats` is not used: the steps are the repeats). A step returns whether the
    cache's placement moved blocks in it (offload, eviction, promotion): those steps pay the placement's
    bookkeeping on top of the step's fixed cost and are reduced apart, so that neither the per-layer overhead
    nor the placement overhead is a blend of the two. A step that reports its own time (the tracer's, as a trace
    records it) is timed by that; otherwise by `timing`'s clock around the call.

    The decoders are taken in turn, `visit_steps` steps at a time (the order reversed every round): a difference
    between decoders is then a difference of steps timed within one round, so a slow phase of a shared machine
    (seconds long) lands on every decoder alike instead of on one point of a fit or one decoder's figures. With
    `visit_steps` > 1 and several decoders, each visit first takes one untimed step: the other decoders' models
    have pushed this one's weights and cache out of the CPU caches, and a decode loop runs warm (its previous
    step just ran), so the timed steps do too."""
    device = timing.device
    clock = time.perf_counter if device.type == "cuda" else timing.clock
    for step in steps:
        for _ in range(timing.warmup):
            step()
    settle = visit_steps > 1 and len(steps) > 1
    timed = [([], [], [], [], []) for _ in steps]  # per decoder: quiet, moving, attended, layers, rest
    for round_ in range(-(-n_steps // visit_steps)):
        order = range(len(steps)) if round_ % 2 == 0 else reversed(range(len(steps)))
        for i in order:
            if settle:
                steps[i]()
            quiet, moving, attended, layers, rest = timed[i]
            for _ in range(min(visit_steps, n_steps - round_ * visit_steps)):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = clock()
                outcome = steps[i]()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = clock() - start
                moved, reported_s, tokens, layers_s = outcome if outcome is not None else (False, None, None, None)
                step_s = elapsed if reported_s is None else reported_s
                (moving if moved else quiet).append(step_s)
                if tokens is not None:
                    attended.append(tokens)
                if layers_s is not None and not moved:
                    layers.append(layers_s)
                    rest.append(step_s - layers_s)
    reduce = STATISTICS[timing.statistic]
    return [StepTimes(reduce(quiet or moving), reduce(moving) if moving else None,
                      sum(attended) / len(attended) if attended else None,
                      reduce(layers) if layers else None, reduce(rest) if rest else None)
            for quiet, moving, attended, layers, rest in timed]


@dataclass(frozen=True)
class Sweep:
    quiet: Series  # step time vs layers (steps where nothing moved)
    placement: Series | None  # extra time of a moving step vs layers
    attended_tokens: float | None  # mean tokens a layer attended in the timed steps
    split: tuple[Series, Series] | None = None  # (layers' time, the rest) vs layers, by the trace's layer timer


# Steps a decoder takes per visit when the overhead sweep interleaves its models: long enough that the one
# untimed settling step per visit costs little, short enough that a slow phase spans many visits.
OVERHEAD_VISIT_STEPS = 8


def overhead_sweeps(
    layer_counts: list[int],
    dtype: torch.dtype,
    n_steps: int,
    timing: Timing,
    decoders: dict[str, DecoderFactory],
    prompt_tokens: int = 16,
    weights: ModelWeights | None = None,
    shapes: dict | None = None,
) -> dict[str, Sweep]:
    """Per decoder (name -> factory): decode-step time of near-zero-work models with each layer count, and (when
    the decoder's placement moved blocks at every layer count) the extra time of a step in which it did
    (`placement_extra`, per layer count), and the mean tokens a layer attended (tiered decoders; calibrate
    subtracts their per-token cost).

    Every (decoder, layer count) model is timed in one interleaved loop (`time_interleaved_decode_steps_s`,
    `OVERHEAD_VISIT_STEPS` per visit): each point of each decoder's fit is then reduced over steps spread
    across the whole sweep, so neither the step/layer split of one decoder nor the difference between two
    decoders (what the per-policy overheads carry) is a slow phase of the machine.

    With `weights`, every decoder layer first reads one layer of the real model's weights and the lm_head reads
    the real lm_head: the step then streams the memory a real decode step streams, so the framework's dispatch
    runs with the caches as cold as they really are (the same non-matmul ops cost more next to a real model's
    weight reads than in a near-zero model alone). Subtracting the weights' own time (`layer_bytes /
    bandwidth`) leaves the overhead the simulator must add. With `shapes` (no `weights`), the layers have the
    architecture's own shapes: a small model whose weights stay in the cache pays, besides dispatch, its norms,
    rotary and attention on real head shapes; its step minus its weights' read time is then the overhead the
    simulator adds to the roofline."""
    steps, handles = [], []
    for make_decoder in decoders.values():
        for n_layers in layer_counts:  # a model per decoder: a tiered decoder switches its model's attention
            model = near_zero_model(n_layers, dtype, timing.device, shapes)
            if weights is not None:
                handles += [layer.register_forward_pre_hook(lambda *_: weights.layer()) for layer in model.model.layers]
                handles.append(model.lm_head.register_forward_hook(lambda *_: weights.head()))
            prompt_ids = torch.arange(prompt_tokens, device=timing.device)[None] % model.config.vocab_size
            steps.append(make_decoder(model, prompt_ids))
    try:
        measured = time_interleaved_decode_steps_s(steps, n_steps, timing, OVERHEAD_VISIT_STEPS)
    finally:
        for handle in handles:
            handle.remove()
    name = "decode_step_overhead" if weights is None else "decode_step_with_weights"
    x = [float(n) for n in layer_counts]
    sweeps = {}
    for index, decoder in enumerate(decoders):
        times = measured[index * len(layer_counts):(index + 1) * len(layer_counts)]
        extra = [None if t.moving_s is None else max(0.0, t.moving_s - t.quiet_s) for t in times]
        attended = [t.attended_tokens for t in times]
        layers = [t.layers_s for t in times]
        placement = None if None in extra else Series(f"placement_extra/{name}", x, extra, "layers")
        split = None if None in layers else (Series(f"layers/{name}", x, layers, "layers"),
                                             Series(f"rest/{name}", x, [t.rest_s for t in times], "layers"))
        sweeps[decoder] = Sweep(Series(name, x, [t.quiet_s for t in times], "layers"), placement,
                                None if None in attended else sum(attended) / len(attended), split)
    return sweeps


def token_cost_sweep(make_decoder: DecoderFactory, prompts: list[int], n_steps: int, dtype: torch.dtype,
                     timing: Timing, shapes: dict | None, n_layers: int = 2) -> Series:
    """A decode step's time on an `n_layers` model with `shapes` against the tokens a layer attends, from prompts of
    each length: the slope is what one more attended token costs a layer-step (attention, scoring, the
    tiered cache's per-token bookkeeping), which a fixed per-layer overhead cannot carry: over a long context
    it is a sizeable part of a small model's layer (the profile's `token_cost/*` fits).

    Where the decoder reports its layers' time (the trace's layer timer, which holds the attention, scoring and
    placement), that is the time: the rest of the step (embedding, LM head, the step's copy) does not grow with
    the context, and on a model whose LM head dominates the step (`tiny`'s shapes) the noise of the rest
    drowns the slope when whole steps are timed. The prompts' decoders step in turn
    (`time_interleaved_decode_steps_s`), so that a slow phase of the machine is not the slope either."""
    model = near_zero_model(n_layers, dtype, timing.device, shapes)
    decoders = [make_decoder(model, torch.arange(prompt, device=timing.device)[None] % model.config.vocab_size)
                for prompt in prompts]
    measured = time_interleaved_decode_steps_s(decoders, n_steps, timing)
    x = [float(m.attended_tokens if m.attended_tokens is not None else prompt) for m, prompt in zip(measured, prompts)]
    times = [m.quiet_s if m.layers_s is None else m.layers_s for m in measured]
    return Series("token_cost", x, times, "attended_tokens")
