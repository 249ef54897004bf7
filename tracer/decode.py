"""Greedy decoding of one sample with a tiered cache, step by step, always with true logical positions.

Step 0 is the prefill (it produces the first generated token); each later step feeds the previous token at
position `prompt_len + generated - 1`. Stops at EOS or `max_new_tokens`; NaN/inf logits stop the sample
and flag it (that step's token is never emitted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from tracer.attention import ATTN_IMPLEMENTATION
from tracer.cache import TieredCache
from tracer.recorder import Recorder


@dataclass
class DecodeResult:
    prompt_ids: list[int]
    generated_ids: list[int]
    stop_reason: str  # eos | max_new_tokens | nonfinite
    wall_s: float
    cache: TieredCache


def use_tiered_attention(model) -> None:
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def encode_prompt(tokenizer, text: str, use_chat_template: bool) -> list[int]:
    """Token ids of the prompt; the chat template (with the generation prompt) when the tokenizer has one."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text, add_special_tokens=True))


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def greedy_decode(
    model, prompt_ids: list[int], cache: TieredCache, max_new_tokens: int, eos_ids: set[int],
    recorder: Recorder | None = None, progress=None,
) -> DecodeResult:
    device = model.device
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    input_ids = torch.tensor([prompt_ids], device=device)
    position_ids = torch.arange(len(prompt_ids), device=device)[None]
    generated: list[int] = []
    stop_reason = "max_new_tokens"
    # The gradient scorer's backward pass (tracer/scorers/) runs after each step, untimed; a plain
    # DynamicCache (the untraced reference) has no settings.
    after_step = getattr(getattr(getattr(cache, "settings", None), "scorer", None), "after_step", None)
    started = time.perf_counter()
    for _ in range(max_new_tokens):
        step_started = time.perf_counter()
        logits = model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        token, finite = int(logits.argmax()), bool(torch.isfinite(logits).all())
        synchronize()
        if recorder is not None:
            recorder.end_step((time.perf_counter() - step_started) * 1e6)
        if progress is not None:
            progress.update(1)
        if not finite:
            stop_reason = "nonfinite"
            break
        generated.append(token)
        if after_step is not None:
            after_step(model, cache, prompt_ids + generated, len(generated) - 1)
        if token in eos_ids:
            stop_reason = "eos"
            break
        input_ids = torch.tensor([[token]], device=device)
        position_ids = torch.tensor([[len(prompt_ids) + len(generated) - 1]], device=device)
    return DecodeResult(prompt_ids, generated, stop_reason, time.perf_counter() - started, cache)


def tokens_table(result: DecodeResult) -> dict[str, object]:
    """trace v1 `tokens` columns: importance received over decode steps and the final tier, per layer."""
    token_ids = result.prompt_ids + result.generated_ids
    n = len(token_ids)
    layers = result.cache.layers
    by_layer = np.zeros((n, len(layers)), dtype=np.float32)
    by_layer_max = np.zeros((n, len(layers)), dtype=np.float32)
    tiers = np.zeros((n, len(layers)), dtype=np.uint8)  # a position never cached (the last token) counts as HBM
    for index, layer in enumerate(layers):
        stored = min(n, layer.logical_len)
        by_layer[:stored, index] = layer.importance[:stored].cpu().numpy()
        by_layer_max[:stored, index] = layer.importance_max[:stored].cpu().numpy()
        tiers[:stored, index] = layer.final_tiers()[:stored].cpu().numpy()
    return {
        "position": np.arange(n, dtype=np.int32),
        "token_id": np.asarray(token_ids, dtype=np.int32),
        "is_prompt": np.arange(n) < len(result.prompt_ids),
        "importance": by_layer.mean(1),
        "importance_max": by_layer_max.mean(1),
        "importance_by_layer": list(by_layer),
        "final_tier_by_layer": list(tiers),
    }
