"""The tracer runs on the transformers it finds: models take the KV cache as `cache` (transformers >= 5.2x) or
as `past_key_values` (5.17, the lent GPU machines' image; `make gpu-rehearsal` runs this file under it), and
`tracer.compat.cache_kwargs` names it. A cache passed under the other name would be ignored without an error
(the model builds its own), so each test checks the cache it passed was the one filled, against an independent
reference: HF's `generate` with the cache it builds itself (no keyword of ours)."""

from __future__ import annotations

import pytest
import torch
from _helpers import TINY_CONFIGS
from transformers import AutoModelForCausalLM, DynamicCache

import tracer.attention  # noqa: F401  (registers the "thoughtkv" attention function)
from tracer.cache import TieredCache, TierSettings
from tracer.compat import cache_kwargs
from tracer.decode import DecodeJob, decode_batch
from tracer.scorers import build_scorer
from traces.policy import PolicySpec

STEPS = 24
POLICIES = {
    "full": dict(policy="full"),
    "hierarchy-recall-all": dict(policy="hierarchy", hbm_budget=0.3, recall_k=10_000),
    "hierarchy": dict(policy="hierarchy", hbm_budget=0.3, recall_k=2),
}


def tiny_model(arch: str = "qwen2"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), attn_implementation="sdpa",
                                            dtype=torch.float32).eval()


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def settings(policy: str) -> TierSettings:
    spec = PolicySpec(**POLICIES[policy], block_size=4, sink_tokens=4, window_tokens=8)
    return TierSettings(spec=spec, scorer=build_scorer(spec.scorer))


def generate_reference(model, ids: list[int], **kwargs) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and raw logits [steps, vocab] from HF's generate (its own cache unless one is passed)."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.logits)[:, 0]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_cache_is_passed_under_the_name_the_model_reads(arch):
    model = tiny_model(arch)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt(11)]), **cache_kwargs(model, cache), use_cache=True)
    assert cache.get_seq_length() == 11  # under a name the model ignores, this cache would stay empty


def test_generate_takes_the_cache_under_the_same_name():
    model = tiny_model()
    cache = DynamicCache(config=model.config)
    got = generate_reference(model, prompt(13), **cache_kwargs(model, cache))
    expected = generate_reference(model, prompt(13))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])
    assert cache.get_seq_length() == 13 + STEPS - 1


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunked-prefill"])
def test_tiered_decode_equals_generate_with_its_own_cache(policy, chunk):
    """Two prompts of different lengths in one batch: each gets generate's tokens (and, where every DDR block is
    recalled, its logits), with blocks really offloaded."""
    model = tiny_model()
    prompts = [prompt(21, seed=1), prompt(14, seed=2)]
    references = [generate_reference(model, ids) for ids in prompts]
    model.set_attn_implementation("thoughtkv")
    jobs = [DecodeJob(i, ids, settings(policy)) for i, ids in enumerate(prompts)]
    cache = TieredCache(model.config.num_hidden_layers, jobs[0].settings)
    results = {job.key: result for job, result in decode_batch(model, jobs, cache, 2, STEPS, set(), keep_logits=True,
                                                               prefill_chunk_tokens=chunk)}
    for key, (tokens, logits) in enumerate(references):
        result = results[key]
        assert result.cache.layers[0].logical_len == len(prompts[key]) + STEPS - 1  # this cache was the one used
        if policy != "hierarchy":  # (recall_k 2 attends less than the full cache: its logits differ)
            assert result.generated_ids == tokens
            assert (torch.stack(result.logits) - logits).abs().max().item() <= 1e-5
        if policy != "full":
            assert result.cache.layers[1].n_ddr_blocks > 0  # data really lived in DDR: not vacuous
