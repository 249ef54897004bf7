"""The `vatp` and `gradient` scorers against independent computations on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

from tracer.scorers import (
    SCORERS,
    AlsoScore,
    BadScorerOption,
    GradientScorer,
    VATPScorer,
    build_scorer,
    gradient_importance,
    parse_also_score,
)


def tiny_model(dtype=torch.float32, attn="sdpa"):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).eval()
    with torch.no_grad():  # larger weights than the init: attention far from uniform, gradients far from 0
        for name, parameter in model.named_parameters():
            if "proj" in name and parameter.dim() == 2:
                parameter.mul_(6.0)
    return model


def prefix_cache(model, token_ids: list[int]):
    """K/V of `token_ids` from one plain forward (the route the decode loop does not take)."""
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([token_ids]), cache=cache, use_cache=True)
    return [layer.keys.clone() for layer in cache.layers], [layer.values.clone() for layer in cache.layers]


def sequential_losses(model, keys, values, query_ids: list[int], first_position: int, targets: list[int]) -> torch.Tensor:
    """Summed next-token loss of the queries fed one at a time on top of a batch of caches ([B, H, n, d] per
    layer), one loss per batch row; plain forwards, no autograd."""
    batch = keys[0].shape[0]
    cache = DynamicCache(ddp_cache_data=list(zip(keys, values, strict=True)))
    loss = torch.zeros(batch, dtype=torch.float64)
    with torch.no_grad():
        for offset, (token, target) in enumerate(zip(query_ids, targets, strict=True)):
            logits = model(
                input_ids=torch.full((batch, 1), token), position_ids=torch.full((batch, 1), first_position + offset),
                cache=cache, use_cache=True,
            ).logits[:, -1]
            loss += torch.nn.functional.cross_entropy(logits, torch.full((batch,), target), reduction="none")
    return loss


def finite_difference_norm(model, keys, values, layer, entry, query_ids, first_position, targets, eps=1e-2):
    """||dL/dk_entry|| + ||dL/dv_entry|| of one layer by central differences, every element perturbed +-eps
    in its own batch row. eps is large because the model computes RMSNorm in float32 even in a float64 model
    (a smaller eps drowns in its rounding); central differences keep the truncation error O(eps^2)."""
    total = 0.0
    for perturb_keys in (True, False):
        target_tensors = keys if perturb_keys else values
        n_heads, _, head_dim = target_tensors[layer][0].shape
        n_elements = n_heads * head_dim
        batch = 2 * n_elements
        shifted = {name: [t.expand(batch, -1, -1, -1).clone() for t in tensors] for name, tensors in (("k", keys), ("v", values))}
        rows = shifted["k" if perturb_keys else "v"][layer]
        deltas = torch.cat([torch.eye(n_elements), -torch.eye(n_elements)]) * eps  # [batch, H*d]
        rows[:, :, entry, :] += deltas.view(batch, n_heads, head_dim)
        losses = sequential_losses(model, shifted["k"], shifted["v"], query_ids, first_position, targets)
        grad = (losses[:n_elements] - losses[n_elements:]) / (2 * eps)
        total += float(grad.norm())
    return total


@pytest.mark.parametrize("window, pruned", [(1, False), (3, False), (1, True)])
def test_gradient_matches_finite_differences(window, pruned):
    model = tiny_model(torch.float64)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 96, (14,), generator=generator).tolist()
    n_cached = len(tokens) - window - 1
    keys, values = prefix_cache(model, tokens[:n_cached])
    if pruned:  # layer 0 keeps every other entry, as a tiered cache may: layers of different lengths
        keys[0], values[0] = keys[0][:, :, ::2].contiguous(), values[0][:, :, ::2].contiguous()
    query_ids, targets = tokens[n_cached : n_cached + window], tokens[n_cached + 1 : n_cached + window + 1]
    importance = gradient_importance(
        model, keys, values, torch.tensor([query_ids]), torch.arange(n_cached, n_cached + window)[None],
        torch.tensor(targets),
    )
    assert [t.shape for t in importance] == [(k.shape[-2],) for k in keys]
    for layer, entry in [(0, 2), (1, n_cached - 1), (1, 0)]:
        expected = finite_difference_norm(model, keys, values, layer, entry, query_ids, n_cached, targets)
        assert expected > 1e-3  # the check has teeth: the entry does matter
        assert float(importance[layer][entry]) == pytest.approx(expected, rel=2e-3)


def test_gradient_scorer_accumulates_every_interval_steps():
    model = tiny_model()
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    scorer = GradientScorer(window=1, interval=2)
    totals = [torch.zeros(len(tokens)) for _ in range(2)]
    for step, end in enumerate(range(8, 12)):  # the cache holds tokens[:end], i.e. incl. the token fed now
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens[:end]]), cache=cache, use_cache=True)
        scorer.after_step(model, cache, tokens[: end + 1], step)
        if step % 2 == 0:
            keys, values = prefix_cache(model, tokens[: end - 1])
            direct = gradient_importance(
                model, keys, values, torch.tensor([[tokens[end - 1]]]), torch.tensor([[end - 1]]),
                torch.tensor([tokens[end]]),
            )
            for layer in range(2):
                totals[layer][: end - 1] += direct[layer]
    for layer in range(2):
        table = scorer.tables[layer]
        assert torch.allclose(table, totals[layer][: table.shape[0]], rtol=1e-4, atol=1e-6)
        assert table[:7].min() > 0
    with pytest.raises(BadScorerOption):
        GradientScorer(window=0)


def test_vatp_is_attention_times_value_l1_norm():
    """Observations of two rows at once, by hand: the scorer adds sum_q a_q,i * mean_h ||v_i^h||_1 at each
    row's attended positions, each row on its own."""
    from tracer.scorers import Observation

    generator = torch.Generator().manual_seed(3)
    weights = torch.softmax(torch.randn(2, 3, 5, generator=generator), dim=-1)  # [rows, queries, slots]
    values = torch.randn(2, 2, 5, 4, generator=generator)  # [rows, KV heads, slots, d]
    positions = torch.tensor([[0, 1, 2, 4, 6], [5, 3, 1, 0, 2]])
    obs = Observation(0, 1, 7, positions, weights, weights, torch.randn(2, 2, 5, 4), values=values)
    previous = torch.tensor([[1.0, 0, 0, 0, 0, 0], [0, 0, 2.0, 0, 0, 0]])
    got = VATPScorer().score(obs, previous)
    for row in range(2):
        expected = torch.zeros(7)
        expected[: previous.shape[1]] = previous[row]
        for column, position in enumerate(positions[row].tolist()):
            norm = (values[row, 0, column].abs().sum() + values[row, 1, column].abs().sum()) / 2
            expected[position] += weights[row, :, column].sum() * norm
        assert torch.allclose(got[row], expected)


def test_registry_options_and_also_score_parsing():
    assert {"vatp", "gradient"} <= set(SCORERS)
    gradient = build_scorer("gradient", grad_window=4, grad_interval=2)
    assert (gradient.window, gradient.interval) == (4, 2)
    assert build_scorer("random", seed=5).seed == 5
    assert parse_also_score("h2o, gradient") == ("h2o", "gradient") and parse_also_score(None) == ()
    for bad in ("nope", "oracle", "h2o,h2o"):
        with pytest.raises(BadScorerOption):
            parse_also_score(bad)
    wrapped = AlsoScore(primary=None, extras={"vatp": VATPScorer()})
    assert wrapped.name == "none" and wrapped.score_under_full


# -- end to end through the tracer: `thoughtkv trace --also-score` records each scorer's importance ------------


def loaded_tiny(model):
    from tracer.models import ByteTokenizer, LoadedModel, _manifest

    return LoadedModel(model, ByteTokenizer(), "test:tiny", True, _manifest(model, "test:tiny", "float32", None, True))


def eager_reference(model, token_ids: list[int]):
    """Per layer: attention each position received, summed over all queries (mean over heads), and the
    values' L1 norms (mean over KV heads), from one eager forward with output_attentions."""
    model.set_attn_implementation("eager")
    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids]), cache=cache, use_cache=True, output_attentions=True)
    received = [a[0].mean(0).sum(0) for a in out.attentions]
    value_l1 = [layer.values[0].abs().sum(-1).mean(0) for layer in cache.layers]
    model.set_attn_implementation("sdpa")
    return received, value_l1


def test_also_score_records_h2o_vatp_gradient_equal_to_independent_computations(tmp_path):
    from tracer.run import TraceConfig, run_trace
    from traces import open_run

    model = tiny_model()
    config = TraceConfig(
        model="test:tiny", task="chains", out=str(tmp_path / "run"), n_samples=1, policy="full",
        also_score="h2o,vatp,gradient", max_new_tokens=10, device="cpu",
    )
    run = open_run(run_trace(config, progress=False, loaded=loaded_tiny(_byte_vocab(model))))
    run.validate()
    tokens = run.tokens().sort_values("position")
    token_ids = tokens["token_id"].tolist()
    recorded = {name: torch.tensor([dict(m)[name] for m in tokens["importance_by_scorer"]]) for name in ("h2o", "vatp", "gradient")}
    fed = token_ids[:-1]  # the last generated token is never fed back
    received, value_l1 = eager_reference(model, fed)
    n_prompt = int(tokens["is_prompt"].sum())
    gradient = [torch.zeros(len(fed)) for _ in received]
    for current in range(n_prompt - 1, len(fed)):  # every step: the token fed at `current` predicts the next
        keys, values = prefix_cache(model, token_ids[:current])
        direct = gradient_importance(model, keys, values, torch.tensor([[token_ids[current]]]),
                                     torch.tensor([[current]]), torch.tensor([token_ids[current + 1]]))
        for layer, norms in enumerate(direct):
            gradient[layer][:current] += norms
    expected = {
        "h2o": torch.stack(received).mean(0),
        "vatp": torch.stack([r * v for r, v in zip(received, value_l1, strict=True)]).mean(0),
        "gradient": torch.stack(gradient).mean(0),
    }
    for name, values in expected.items():
        assert recorded[name][-1] == 0  # never cached
        assert torch.allclose(recorded[name][:-1], values, rtol=1e-4, atol=1e-6), name
    # vatp is not attention in disguise on this model: the value norms reorder the tokens.
    assert not torch.equal(expected["h2o"].argsort(), expected["vatp"].argsort())


def _byte_vocab(model):
    """The tiny model with a vocabulary covering ByteTokenizer's ids (3..258): resize the embeddings."""
    model.resize_token_embeddings(320, mean_resizing=False)
    return model


def test_vatp_places_blocks_as_its_scores_say(tmp_path):
    """vatp as the policy's scorer (evict at 100%: scored every step, nothing dropped) equals the reference."""
    from tracer.cache import TieredCache, TierSettings
    from tracer.decode import greedy_decode, use_tiered_attention
    from traces.policy import PolicySpec

    model = tiny_model()
    use_tiered_attention(model)
    settings = TierSettings(spec=PolicySpec(policy="evict", hbm_budget=1.0, block_size=4), scorer=VATPScorer())
    prompt = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    result = greedy_decode(model, prompt, TieredCache(2, settings), max_new_tokens=12, eos_ids=set())
    fed = (result.prompt_ids + result.generated_ids)[:-1]
    received, value_l1 = eager_reference(model, fed)
    for layer, (r, v) in enumerate(zip(received, value_l1, strict=True)):
        scores = result.cache.layers[layer].token_scores[: len(fed)]
        assert torch.allclose(scores, r * v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("argv, needle", [
    (["--also-score", "h2o,nope"], "unknown scorer 'nope'"),
    (["--also-score", "oracle"], "oracle"),
    (["--scorer", "gradient", "--grad-interval", "0"], "--grad-interval"),
    (["--policy", "evict", "--scorer", "gradient", "--grad-window", "4"], "--grad-window > 1"),
    (["--policy", "evict", "--ddr-dtype", "int8"], "hierarchy policy only"),
])
def test_trace_options_are_checked_before_any_work(tmp_path, capsys, argv, needle):
    from thoughtkv.cli import main

    out = tmp_path / "run"
    assert main(["trace", "--model", "random:tiny", "--task", "chains", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not out.exists()
