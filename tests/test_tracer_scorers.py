"""Every registered scorer against an independent reference computed from eager attention weights
(`output_attentions=True` of a full-cache DynamicCache pass over the same tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

import tracer.attention  # noqa: F401
from tracer.cache import TieredCache, TierSettings
from tracer.scorers import SCORERS, build_scorer
from traces.policy import PolicySpec

PROMPT_LEN, STEPS, N_LAYERS = 24, 12, 2



def tiny_model(attn: str):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


@torch.no_grad()
def run(model, cache, tokens=None, output_attentions=False):
    ids = torch.randint(3, 320, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    position = torch.arange(PROMPT_LEN)[None]
    attentions, fed = [], []
    for step in range(STEPS):
        out = model(input_ids=ids, position_ids=position, cache=cache, use_cache=True, output_attentions=output_attentions)
        if output_attentions:
            attentions.append([a[0].mean(0).numpy() for a in out.attentions])  # per layer [q, kv], mean heads
        token = tokens[step] if tokens else int(out.logits[0, -1].argmax())
        fed.append(token)
        ids, position = torch.tensor([[token]]), torch.tensor([[PROMPT_LEN + step]])
    return fed, attentions


@pytest.fixture(scope="module")
def reference():
    eager = tiny_model("eager")
    cache = DynamicCache(config=eager.config)
    tokens, attentions = run(eager, cache, output_attentions=True)
    keys = [cache.layers[k].keys[0].numpy() for k in range(N_LAYERS)]  # [H, n, d]
    return tokens, attentions, keys


def tiered_scores(scorer_name: str, tokens, scorer=None):
    """Scores after the run with nothing moving (budget 100%), so every entry is attended each step."""
    model = tiny_model("sdpa")
    model.set_attn_implementation("thoughtkv")
    scorer = scorer or build_scorer(scorer_name)
    cache = TieredCache(N_LAYERS, TierSettings(spec=PolicySpec(policy="hierarchy", hbm_budget=1.0, block_size=4),
                                               scorer=scorer, track_importance=True))
    run(model, cache, tokens)
    length = PROMPT_LEN + STEPS - 1
    return [layer.token_scores[:length].numpy() for layer in cache.layers], cache


def maxpool(x: np.ndarray, kernel: int) -> np.ndarray:
    half = kernel // 2
    return np.array([x[max(0, i - half) : i + half + 1].max() for i in range(len(x))])


def expected_scores(name: str, attentions, keys, layer: int, length: int) -> np.ndarray:
    last = attentions[-1][layer][-1]
    if name == "h2o":
        total = np.zeros(length)
        for step in attentions:
            weights = step[layer]
            total[: weights.shape[1]] += weights.sum(0)
        return total
    if name == "tova":
        return last
    if name == "snapkv":
        return maxpool(last, 7)
    if name == "keynorm":
        return -np.linalg.norm(keys[layer], axis=-1).mean(0)
    if name == "rkv":
        unit = keys[layer] / np.linalg.norm(keys[layer], axis=-1, keepdims=True)
        redundancy = np.einsum("hid,hjd->hij", unit, unit).mean(-1).mean(0)  # full pairwise cosine matrix
        return 0.1 * last / last.max() - 0.9 * redundancy
    if name == "recency":
        return np.arange(length, dtype=float)
    raise AssertionError(name)


# The issue-9 scorers (vatp, gradient) have their references in their own test file.
CORE_SCORERS = ("h2o", "tova", "snapkv", "keynorm", "rkv", "recency", "random", "oracle")


def test_core_scorers_are_registered():
    assert set(CORE_SCORERS) <= set(SCORERS)


@pytest.mark.parametrize("name", CORE_SCORERS)
def test_scorer_matches_reference(name, reference):
    tokens, attentions, keys = reference
    length = PROMPT_LEN + STEPS - 1
    if name == "random":
        first, _ = tiered_scores(name, tokens, build_scorer("random", seed=3))
        again, _ = tiered_scores(name, tokens, build_scorer("random", seed=3))
        other, _ = tiered_scores(name, tokens, build_scorer("random", seed=4))
        assert np.array_equal(first[0], again[0]) and np.array_equal(first[0], first[1])
        assert not np.allclose(first[0], other[0])
        assert first[0].min() >= 0 and first[0].max() < 1 and len(first[0]) == length
        return
    if name == "oracle":
        # The future importance is what a full pass measures: attention received summed over decode steps.
        full = tiny_model("sdpa")
        full.set_attn_implementation("thoughtkv")
        teacher = TieredCache(N_LAYERS, TierSettings(spec=PolicySpec(block_size=4), track_importance=True))
        run(full, teacher, tokens)
        future = [layer.importance[:length].clone() for layer in teacher.layers]
        for layer in range(N_LAYERS):
            summed = np.zeros(length)
            for step in attentions[1:]:
                summed[: step[layer].shape[1]] += step[layer][-1]
            np.testing.assert_allclose(future[layer].numpy(), summed, atol=1e-5)
        scorer = build_scorer("oracle")
        scorer.future_importance = future
        got, _ = tiered_scores(name, tokens, scorer)
        np.testing.assert_allclose(got[0], future[0].numpy(), atol=1e-6)
        return
    got, _ = tiered_scores(name, tokens)
    for layer in range(N_LAYERS):
        expected = expected_scores(name, attentions, keys, layer, length)
        np.testing.assert_allclose(got[layer], expected, atol=2e-5, rtol=1e-4)


def test_unknown_scorer_is_a_user_error():
    from thoughtkv_base import UserError

    with pytest.raises(UserError, match="unknown scorer"):
        build_scorer("lru")
