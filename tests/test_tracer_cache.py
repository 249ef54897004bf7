"""Tiered cache correctness against independent references: DynamicCache+sdpa logits (full, hierarchy with
every block recalled), eager attention with a 4D mask hiding the evicted set (evict), and the bytes moved."""

from __future__ import annotations

import pytest
import torch
from _helpers import (
    TINY_CONFIGS,
    TINY_SHAPES,
)
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

import tracer.attention  # noqa: F401  (registers the "thoughtkv" attention function)
from thoughtkv_base import UserError
from tracer.cache import TieredCache, TierSettings
from tracer.recorder import Recorder
from tracer.scorers import build_scorer
from traces.policy import PolicySpec, budget_tokens, parse_budget

SHAPES, CONFIGS = TINY_SHAPES, TINY_CONFIGS
PROMPT_LEN, STEPS = 20, 64



def tiny_model(arch: str, attn: str = "sdpa"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        CONFIGS[arch](), attn_implementation=attn, dtype=torch.float32
    ).eval()


def prompt_ids() -> torch.Tensor:
    return torch.randint(3, 320, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def decode(model, cache, tokens: list[int] | None = None, steps: int = STEPS, recorder=None, masks=None):
    """Greedy (or teacher-forced on `tokens`) decode with true positions; returns stacked logits and tokens."""
    ids, position = prompt_ids(), torch.arange(PROMPT_LEN)[None]
    logits_out, fed = [], []
    for step in range(steps):
        kwargs = {"attention_mask": masks(step, ids.shape[1])} if masks else {}
        logits = model(input_ids=ids, position_ids=position, cache=cache, use_cache=True, **kwargs).logits[0, -1]
        if recorder is not None:
            recorder.end_step(0.0)
        logits_out.append(logits)
        token = tokens[step] if tokens is not None else int(logits.argmax())
        fed.append(token)
        ids, position = torch.tensor([[token]]), torch.tensor([[PROMPT_LEN + step]])
    return torch.stack(logits_out), fed


def settings(policy: dict, scorer="h2o", **kw) -> TierSettings:
    base = dict(block_size=4, sink_tokens=4, window_tokens=8, recall_k=0)
    return TierSettings(spec=PolicySpec(**policy, **{**base, **kw}), scorer=build_scorer(scorer))


FULL = {"policy": "full"}


def hierarchy(budget, **kw) -> dict:
    return {"policy": "hierarchy", "hbm_budget": budget, **kw}


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize(
    "policy,extra",
    [
        (FULL, {}),
        (hierarchy(0.3), {"recall_k": 10_000}),
        (hierarchy(16), {"recall_k": 10_000, "promote": True, "block_size": 1}),
    ],
    ids=["full", "hierarchy-recall-all", "hierarchy-promote-per-token"],
)
def test_logits_equal_dynamic_cache(arch, policy, extra):
    model = tiny_model(arch)
    reference, tokens = decode(model, DynamicCache(config=model.config))
    model.set_attn_implementation("thoughtkv")
    cache = TieredCache(2, settings(policy, **extra))
    got, _ = decode(model, cache, tokens)
    assert (got - reference).abs().max().item() <= 1e-5
    layer = cache.layers[0]
    assert layer.logical_len == PROMPT_LEN + STEPS - 1  # the last token is never fed
    if policy != FULL:  # data really lived in DDR: the test is not vacuous
        assert layer.n_ddr_blocks > 0 and layer.n_hbm < layer.logical_len


def test_recorded_masses_equal_the_full_caches_attention_on_the_blocks():
    """With every DDR block recalled, each layer attends what a full cache attends, so its recorded masses are
    the eager full-cache attention weights (mean over heads) of the last query: per block, and on the recalled
    (DDR) blocks; an independent reference (HF's eager attention, `output_attentions`)."""
    model = tiny_model("qwen2")
    model.set_attn_implementation("eager")
    cache, weights, fed = DynamicCache(config=model.config), [], []
    ids, position = prompt_ids(), torch.arange(PROMPT_LEN)[None]
    with torch.no_grad():
        for step in range(STEPS):
            out = model(input_ids=ids, position_ids=position, cache=cache, use_cache=True, output_attentions=True)
            weights.append([a[0, :, -1].mean(0) for a in out.attentions])  # per layer: [positions]
            fed.append(int(out.logits[0, -1].argmax()))
            ids, position = torch.tensor([[fed[-1]]]), torch.tensor([[PROMPT_LEN + step]])
    model.set_attn_implementation("thoughtkv")
    recorder = Recorder()
    decode(model, TieredCache(2, settings(hierarchy(0.3), recall_k=10_000), recorder), fed, recorder=recorder)
    rows, block_size, checked = recorder.columns, 4, 0
    for row, (step, layer) in enumerate(zip(rows["step"], rows["layer"], strict=True)):
        reference = weights[step][layer]
        blocks = reference.new_zeros(-(-reference.shape[0] // block_size))
        blocks.index_add_(0, torch.arange(reference.shape[0]) // block_size, reference)
        torch.testing.assert_close(torch.as_tensor(recorder.block_mass[row]), blocks, rtol=0, atol=1e-5)
        recalled = rows["recalled_block_ids"][row]
        assert rows["mass_ddr"][row] == pytest.approx(float(blocks[recalled].sum()), abs=1e-5)
        checked += bool(recalled)
    assert checked > STEPS  # most layer-steps recalled blocks: the DDR mass compared is not all zero


def test_generate_with_tiered_cache_matches_dynamic_cache():
    model = tiny_model("qwen2")
    ids = prompt_ids()
    expected = model.generate(ids, max_new_tokens=40, do_sample=False, cache=DynamicCache(config=model.config))
    model.set_attn_implementation("thoughtkv")
    cache = TieredCache(2, settings(hierarchy(0.25), recall_k=10_000))
    got = model.generate(ids, max_new_tokens=40, do_sample=False, cache=cache)
    assert torch.equal(got, expected)
    assert cache.layers[1].n_ddr_blocks > 0


@pytest.mark.parametrize("scorer,block_size,budget", [("recency", 4, 0.4), ("random", 4, 24), ("random", 1, 0.5)])
def test_evict_equals_eager_with_evicted_set_masked(scorer, block_size, budget):
    """Eviction keeps true positions: logits equal a full-cache eager run that masks exactly the evicted set.

    These scorers rank positions identically in every layer, so one 4D mask describes all layers."""
    model = tiny_model("qwen2")
    model.set_attn_implementation("thoughtkv")
    recorder = Recorder()
    policy = {"policy": "evict", "hbm_budget": budget}
    cache = TieredCache(2, settings(policy, scorer=scorer, block_size=block_size), recorder)
    got, tokens = decode(model, cache, recorder=recorder)
    rows = recorder.columns
    evicted_at: dict[int, list[int]] = {}  # step -> block ids evicted after its attention, layer 0
    for step, layer, ids in zip(rows["step"], rows["layer"], rows["evicted_block_ids"]):
        if layer == 0:
            evicted_at[step] = ids
    per_layer = [sorted(ids for s, lay, ids in zip(rows["step"], rows["layer"], rows["evicted_block_ids"]) if lay == k)
                 for k in range(2)]
    assert per_layer[0] == per_layer[1]
    assert sum(len(v) for v in evicted_at.values()) > 4

    def mask(step: int, n_new: int) -> torch.Tensor:
        kv_len = PROMPT_LEN if step == 0 else PROMPT_LEN + step
        allowed = torch.ones(n_new, kv_len, dtype=torch.bool).tril(kv_len - n_new)
        for earlier in range(step):
            for block in evicted_at[earlier]:
                allowed[:, block * block_size : (block + 1) * block_size] = False
        return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]

    eager = tiny_model("qwen2", attn="eager")
    reference, _ = decode(eager, DynamicCache(config=eager.config), tokens, masks=mask)
    assert (got - reference).abs().max().item() <= 1e-5
    layer = cache.layers[0]
    assert layer.n_evicted_blocks > 0 and layer.n_hbm + layer.n_evicted_blocks * block_size == layer.logical_len


def test_bytes_equal_blocks_moved_and_ddr_holds_the_true_kv():
    model = tiny_model("llama")
    reference_cache = DynamicCache(config=model.config)
    _, tokens = decode(model, reference_cache)
    model.set_attn_implementation("thoughtkv")
    recorder = Recorder()
    block_size = 4
    cache = TieredCache(2, settings(hierarchy(0.3, evict_ratio=0.1), recall_k=3), recorder)
    decode(model, cache, tokens, recorder=recorder)
    rows = recorder.columns
    block_bytes = 2 * 2 * block_size * 16 * 4  # K+V, 2 KV heads, block, head_dim 16, fp32
    assert block_bytes == model.config.num_key_value_heads * 16 * 4 * 2 * block_size
    recalled = sum(len(ids) for ids in rows["recalled_block_ids"])
    offloaded = sum(len(ids) for ids in rows["offloaded_block_ids"])
    assert recalled > 0 and offloaded > 0
    assert sum(rows["bytes_h2d"]) == recalled * block_bytes
    assert sum(rows["bytes_d2h"]) == offloaded * block_bytes
    # The tier counts, against the tiers replayed from the recorded moves (a row's counts are at attention time:
    # what the earlier steps' moves left), and the byte columns from them.
    in_ddr, evicted = [set(), set()], [set(), set()]
    for row in range(len(rows["step"])):
        layer = rows["layer"][row]
        assert rows["recalled_tokens"][row] == len(rows["recalled_block_ids"][row]) * block_size
        assert rows["hbm_tokens"][row] + rows["ddr_tokens"][row] + rows["evicted_tokens"][row] == rows["logical_len"][row]
        assert abs(rows["mass_hbm"][row] + rows["mass_ddr"][row] - 1.0) < 1e-4
        assert (rows["ddr_blocks"][row], rows["evicted_blocks"][row]) == (len(in_ddr[layer]), len(evicted[layer]))
        assert rows["ddr_tokens"][row] == len(in_ddr[layer]) * block_size
        assert rows["hbm_blocks"][row] == -(-rows["logical_len"][row] // block_size) - len(in_ddr[layer] | evicted[layer])
        assert rows["ddr_kv_bytes"][row] == len(in_ddr[layer]) * block_bytes
        assert rows["hbm_kv_bytes"][row] == (rows["hbm_tokens"][row] + rows["recalled_tokens"][row]) * block_bytes // block_size
        gone = set(rows["evicted_block_ids"][row])
        in_ddr[layer] = (in_ddr[layer] | set(rows["offloaded_block_ids"][row])) - set(rows["promoted_block_ids"][row]) - gone
        evicted[layer] |= gone
    assert any(evicted) and rows["layer"][:4] == [0, 1, 0, 1]
    # What sits in DDR is the K/V the full cache computed at those positions (the real tensors moved). Layer 0
    # keys depend only on the token and its position, so they must match for every block; deeper layers only
    # for prompt blocks (later ones saw a partial cache).
    for index, layer in enumerate(cache.layers):
        ids = layer.ddr_ids
        assert ids.numel() > 0
        reference_layer = reference_cache.layers[index]
        for block in ids.tolist():
            span = slice(block * block_size, (block + 1) * block_size)
            if index == 0 or span.stop <= PROMPT_LEN:
                torch.testing.assert_close(layer.ddr.keys[block], reference_layer.keys[0, :, span], rtol=0, atol=1e-6)
                torch.testing.assert_close(layer.ddr.values[block], reference_layer.values[0, :, span], rtol=0, atol=1e-6)
        tiers = layer.final_tiers()
        assert int((tiers == 1).sum()) == layer.n_ddr_blocks * block_size


def test_budget_parsing_and_errors():
    assert budget_tokens(parse_budget("0.25"), 100) == 25
    assert budget_tokens(parse_budget("0.3"), 10) == 3
    assert budget_tokens(parse_budget("512"), 100) == 512 and not PolicySpec(hbm_budget="512").budget_is_fraction
    assert budget_tokens(parse_budget("1"), 77) == 77
    for bad in ("0", "-0.5", "1.5", "abc", "inf", "nan"):
        with pytest.raises(UserError):
            parse_budget(bad)
    with pytest.raises(UserError):
        PolicySpec(policy="lru")
    with pytest.raises(UserError):
        PolicySpec(policy="hierarchy", hbm_budget=0.5, evict_ratio=1.2)


def test_batch_above_one_is_refused_with_a_clear_error():
    model = tiny_model("qwen2")
    model.set_attn_implementation("thoughtkv")
    cache = TieredCache(2, settings(FULL))
    with pytest.raises(UserError, match="batch size 1"):
        model(input_ids=torch.ones(2, 5, dtype=torch.long), cache=cache, use_cache=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_logits_stop_the_sample_without_emitting_a_token(bad):
    from tracer.decode import DecodeJob, decode_batch, greedy_decode

    model = tiny_model("qwen2")
    model.set_attn_implementation("thoughtkv")
    with torch.no_grad():
        model.lm_head.weight[7] = bad
    recorder = Recorder()
    cache = TieredCache(2, settings(FULL), recorder)
    result = greedy_decode(model, prompt_ids()[0].tolist(), cache, 8, set(), recorder)
    assert result.stop_reason == "nonfinite" and result.generated_ids == []
    assert recorder.columns["step"] == [0, 0]  # the prefill ran (one row per layer) and nothing after
    jobs = [DecodeJob(i, prompt_ids()[0].tolist()[: 9 + i], settings(FULL), Recorder()) for i in range(2)]
    for job, result in decode_batch(model, jobs, TieredCache(2, jobs[0].settings), 2, 8, set()):  # the batched loop
        assert result.stop_reason == "nonfinite" and result.generated_ids == [], job.key


# -- the policy contract's recall settings ------------------------------------------------------------------


def test_recall_budget_recalls_whole_blocks_of_a_fraction_of_the_length():
    model = tiny_model("qwen2")
    model.set_attn_implementation("thoughtkv")
    recorder = Recorder()
    cache = TieredCache(2, settings(hierarchy(0.3, recall_budget=0.2), recall_k=0), recorder)
    decode(model, cache, recorder=recorder)
    rows = recorder.columns
    checked = 0
    for row in range(len(rows["step"])):
        if rows["query_tokens"][row] != 1:
            continue  # recall runs at decode steps
        length = rows["logical_len"][row]
        expected_blocks = min((-(-2 * length // 10)) // 4, rows["ddr_blocks"][row])  # ceil(0.2 L) tokens, whole blocks
        assert len(rows["recalled_block_ids"][row]) == expected_blocks
        checked += expected_blocks > 1
    assert checked > 10  # the budget really grew with the length


def test_attend_hides_keys_per_kv_head_like_a_softmax_over_the_visible_ones():
    from tracer.attention import attend

    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, 1, 8, generator=generator)  # 4 query heads, 2 KV heads (groups of 2)
    key, value = torch.randn(1, 2, 10, 8, generator=generator), torch.randn(1, 2, 10, 8, generator=generator)
    hidden = torch.zeros(2, 10, dtype=torch.bool)
    hidden[0, 6:8], hidden[1, 8:10] = True, True
    output, mean, _ = attend(query, key, value, 0.5, torch.arange(10)[None], 9, hidden[None])
    mean = mean[0]
    for head in range(4):
        kv = head // 2
        visible = ~hidden[kv]
        weights = torch.softmax(query[0, head, 0] @ key[0, kv, visible].T * 0.5, -1)
        torch.testing.assert_close(output[0, 0, head], weights @ value[0, kv, visible])
    assert torch.all(mean[0, 6:10] < 1) and mean[0].sum().item() == pytest.approx(1.0)
    assert (mean[0, 6:8] > 0).all() and (mean[0, 8:10] > 0).all()  # hidden for one KV head only


@pytest.mark.parametrize("rows_per_chunk", [1, 2])
def test_a_prefill_attended_in_chunks_of_rows_equals_it_attended_whole(rows_per_chunk, monkeypatch):
    """On a CPU a large batched prefill is attended a few rows at a time (tracer.attention.CHUNK_LOGITS): left-
    padded rows, empty slots, outputs and weights (mean, max) are those of one pass over every row (each chunk
    writes its rows of the whole outputs)."""
    import tracer.attention as attention

    generator = torch.Generator().manual_seed(5)
    rows, lq, n_keys = 5, 6, 9
    query = torch.randn(rows, 4, lq, 8, generator=generator)
    key, value = torch.randn(rows, 2, n_keys, 8, generator=generator), torch.randn(rows, 2, n_keys, 8, generator=generator)
    positions = torch.arange(n_keys).repeat(rows, 1)
    positions[1, 7:], positions[3, 2] = -1, -1  # empty slots
    query_start = torch.tensor([0, -2, 0, -5, -1])  # left-padded rows (a pad reads position 0)
    monkeypatch.setattr(attention, "CHUNK_LOGITS", 1 << 30)
    whole = attention.attend(query, key, value, 0.3, positions, query_start)
    monkeypatch.setattr(attention, "CHUNK_LOGITS", rows_per_chunk * 4 * lq * n_keys)
    calls = []
    one_pass = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *a, **k: calls.append(a[0].shape[0]) or one_pass(*a, **k))
    chunked = attention.attend(query, key, value, 0.3, positions, query_start)
    assert calls == [rows_per_chunk] * (rows // rows_per_chunk) + [rows % rows_per_chunk] * (rows % rows_per_chunk > 0)
    for got, expected in zip(chunked, whole, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_attention_in_its_kept_buffers_equals_sdpa_and_keeps_earlier_results_and_gradients():
    """A CPU prefill computes its logits in a kept buffer (tracer.attention.workspace) and a decode step its mask in
    a kept `EmptySlots`: each call equals sdpa (GQA, causal from the query's position), what a call returned is
    not overwritten by the next one's (fresh outputs, not views of the buffer), and under autograd (a scorer's
    backward pass) the gradients are sdpa's."""
    from tracer.attention import EmptySlots, attend

    generator = torch.Generator().manual_seed(9)
    n_keys = 7
    positions = torch.arange(n_keys)[None]

    def reference(query, key, value, start):
        mask = positions[0][None, :] <= (start + torch.arange(query.shape[2]))[:, None]
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3,
                                                                enable_gqa=True).transpose(1, 2)

    def inputs(lq):
        return (torch.randn(1, 4, lq, 8, generator=generator), torch.randn(1, 2, n_keys, 8, generator=generator),
                torch.randn(1, 2, n_keys, 8, generator=generator))

    with torch.inference_mode():
        first, second = inputs(n_keys), inputs(n_keys)
        out_first = attend(*first, 0.3, positions, 0)
        kept = [t.clone() for t in out_first]
        out_second = attend(*second, 0.3, positions, 0)
        for got, expected in zip(out_first, kept, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(out_first[0], reference(*first, 0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out_second[0], reference(*second, 0), rtol=1e-5, atol=1e-6)
        decode = inputs(1)
        empty_slots = EmptySlots(positions, 2, torch.float32)
        for _ in range(2):  # the kept mask, refilled
            torch.testing.assert_close(attend(*decode, 0.3, positions, n_keys - 1, empty_slots=empty_slots)[0],
                                       reference(*decode, n_keys - 1), rtol=1e-5, atol=1e-6)
    for lq, start in ((n_keys, 0), (1, n_keys - 1)):
        query, key, value = (t.requires_grad_() for t in inputs(lq))
        attend(query, key, value, 0.3, positions, start)[0].square().sum().backward()
        grads = [t.grad for t in (query, key, value)]
        for t in (query, key, value):
            t.grad = None
        reference(query, key, value, start).square().sum().backward()
        for got, t in zip(grads, (query, key, value), strict=True):
            torch.testing.assert_close(got, t.grad, rtol=1e-4, atol=1e-5)


def test_quest_per_head_with_one_kv_head_is_quest_and_each_head_attends_its_own_k():
    config = Qwen2Config(**{**SHAPES, "num_key_value_heads": 1})
    torch.manual_seed(0)
    mqa = AutoModelForCausalLM.from_config(config, attn_implementation="thoughtkv", dtype=torch.float32).eval()
    recorders = [Recorder(), Recorder()]
    quest, tokens = decode(mqa, TieredCache(2, settings(hierarchy(0.3), recall_k=2), recorders[0]),
                           recorder=recorders[0])
    per_head, _ = decode(mqa, TieredCache(2, settings(hierarchy(0.3), recall_k=2, recall_rule="quest-per-head"),
                                          recorders[1]), tokens, recorder=recorders[1])
    # One KV head: its own top-k is the shared top-k, so the same blocks move and the logits agree (the staging
    # order differs, by bound vs by id, so to float32 rounding of the softmax's sum, not bitwise).
    tables = [r.steps_table() for r in recorders]
    assert tables[0]["recalled_block_ids"] == tables[1]["recalled_block_ids"]
    assert sum(len(ids) for ids in tables[0]["recalled_block_ids"]) > STEPS
    torch.testing.assert_close(quest, per_head, rtol=0, atol=1e-6)

    model = tiny_model("qwen2")
    model.set_attn_implementation("thoughtkv")
    recorder = Recorder()
    cache = TieredCache(2, settings(hierarchy(0.3), recall_k=2, recall_rule="quest-per-head"), recorder)
    seen_union_above_k = False
    layer = cache.layers[0]

    def check_recall() -> None:  # after each step: what layer 0 recalled and which staged slots each head read
        nonlocal seen_union_above_k
        if layer.recalled_ids is not None:
            n = layer.recalled_ids.numel()
            assert min(2, layer.n_ddr_blocks) <= n <= min(4, layer.n_ddr_blocks)
            staged = ~layer.hidden_keys  # [Hkv, recalled slots]: what each head may read
            assert staged.sum(1).tolist() == [min(2, layer.n_ddr_blocks) * 4] * 2
            seen_union_above_k |= n > 2

    ids, position = prompt_ids(), torch.arange(PROMPT_LEN)[None]
    with torch.no_grad():
        for step in range(STEPS):
            model(input_ids=ids, position_ids=position, cache=cache, use_cache=True)
            check_recall()
            recorder.end_step(0.0)
            ids, position = torch.tensor([[tokens[step]]]), torch.tensor([[PROMPT_LEN + step]])
    assert seen_union_above_k  # the heads disagreed at least once: the union really moved more blocks
    rows = recorder.columns
    assert sum(rows["bytes_h2d"]) == sum(len(ids) for ids in rows["recalled_block_ids"]) * 2 * 2 * 4 * 16 * 4


def test_protected_excess_is_reported_at_the_worst_length():
    from tracer.run import protected_excess_note

    spec = PolicySpec(policy="evict", hbm_budget=0.3, block_size=16, sink_tokens=4, window_tokens=32)
    # L=100: blocks [1, 4) movable (48 tokens), so 52 protected > the 30 allowed; L=1000: 56 protected <= 300.
    note = protected_excess_note(spec, [100, 1000])
    assert note["logical_len"] == 100 and note["effective_hbm_fraction"] == pytest.approx(0.52)
    assert "0.3" in note["warning"] and "52" in note["warning"]
    assert protected_excess_note(spec, [1000]) is None


# -- the paged layout ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [hierarchy(0.3), {"policy": "evict", "hbm_budget": 0.3}, FULL])
def test_pages_hold_exactly_the_resident_blocks_and_are_reused(policy):
    """After every step: each HBM block sits in one page whose slots hold its positions and the K/V the full
    cache computed there (layer 0 depends only on token and position), and the resident blocks fill the first
    main pages (packed); DDR/evicted blocks hold no page; free pages hold nothing. The pool stays at the
    budget's size (pages are reused), not the logical length's."""
    model = tiny_model("llama")
    reference_cache = DynamicCache(config=model.config)
    _, tokens = decode(model, reference_cache, steps=STEPS)
    model.set_attn_implementation("thoughtkv")
    cache = TieredCache(2, settings(policy, recall_k=2))
    layer = cache.layers[0]
    block_size, most_pages, most_hbm_blocks = 4, 0, 0
    ids, position = prompt_ids(), torch.arange(PROMPT_LEN)[None]
    with torch.no_grad():
        for step in range(STEPS):
            model(input_ids=ids, position_ids=position, cache=cache, use_cache=True)
            ids, position = torch.tensor([[tokens[step]]]), torch.tensor([[PROMPT_LEN + step]])
            blocks = -(-layer.logical_len // block_size)
            tier, block_page = layer.block_tier[:blocks], layer.block_page[:blocks]
            resident = (tier == 0).nonzero().squeeze(1)
            assert resident.numel() == layer.hbm_blocks and (block_page[tier != 0] == -1).all()
            pages = block_page[resident]
            assert pages.unique().numel() == pages.numel() and (layer.page_block[pages] == resident).all()
            slots = (pages[:, None] * block_size + torch.arange(block_size)).reshape(-1)
            expected = (resident[:, None] * block_size + torch.arange(block_size)).reshape(-1)
            expected = torch.where(expected < layer.logical_len, expected, -1)  # the partial block's empty tail
            assert torch.equal(layer.slot_pos[slots], expected)
            assert int((layer.slot_pos[layer.main_slots] >= 0).sum()) == layer.n_hbm
            first_page = layer.main_slots.start // block_size  # packed: the first hbm_blocks main pages
            assert sorted(pages.tolist()) == list(range(first_page, first_page + layer.hbm_blocks))
            stored = expected >= 0
            torch.testing.assert_close(layer.keys_buf[0, :, slots[stored]],
                                       reference_cache.layers[0].keys[0, :, expected[stored]], rtol=0, atol=1e-6)
            most_pages, most_hbm_blocks = max(most_pages, layer.n_pages), max(most_hbm_blocks, layer.hbm_blocks)
    assert most_pages <= most_hbm_blocks + max(2, most_hbm_blocks // 8)  # the growth slack, nothing more
    if policy != FULL:
        assert layer.hbm_blocks < blocks - 4 and most_pages < blocks  # moved blocks' pages were reused


def test_a_batch_allocates_its_rows_once_and_exactly():
    """decode_batch names the batch size: a batch of 5 holds 5 rows of pools and DDR store (not 8 by
    doubling, which `tracer.run.kv_buffer_bytes` would not have sized)."""
    from tracer.decode import DecodeJob, decode_batch

    model = tiny_model("qwen2")
    model.set_attn_implementation("thoughtkv")
    jobs = [DecodeJob(i, prompt_ids()[0, : 10 + i].tolist(), settings(hierarchy(0.3), recall_k=2)) for i in range(7)]
    cache = TieredCache(2, jobs[0].settings)
    list(decode_batch(model, jobs, cache, 5, 12, set()))
    for layer in cache.paged:
        assert layer.n_rows == 5 and layer.keys.shape[0] == 5 and layer.ddr.storage.shape[0] == 5


def test_a_forward_that_raises_midway_leaves_the_layers_that_attended_placed(monkeypatch):
    """A decode step's layers are placed together after its last layer attends
    (tracer.cache.step.after_attention_of_layers); when a forward raises before that, the next forward first places
    the layers that did attend, as placing each after its own attention would have: the same tiers, scores and
    recorded rows as the per-layer path after the same failure (a cache a forward raised in is not one to go on
    decoding with, its layers hold different lengths: what matters is that nothing is lost or left half-made)."""
    import tracer.cache.layer as cache_module

    model = tiny_model("qwen2", "thoughtkv")
    n_layers = model.config.num_hidden_layers
    real_attend, calls = cache_module.attend, []

    def second_call_raises(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real_attend(*args, **kwargs)

    def run(per_layer: bool):
        if per_layer:
            monkeypatch.setattr(cache_module.PagedLayer, "layers_alike", lambda self, rows, states: False)
        recorder = Recorder()
        cache = TieredCache(n_layers, settings(hierarchy(0.3), recall_k=2), recorder)
        ids, position = prompt_ids(), torch.arange(PROMPT_LEN)[None]
        with torch.inference_mode():
            for step in range(24):
                if step == 13:  # the second layer's attention raises at a step that places (a block completes)
                    calls.clear()
                    monkeypatch.setattr(cache_module, "attend", second_call_raises)
                    with pytest.raises(RuntimeError, match="injected"):
                        model(input_ids=ids, position_ids=position, cache=cache, use_cache=True)
                    monkeypatch.setattr(cache_module, "attend", real_attend)
                    recorder.end_step(0.0)
                logits = model(input_ids=ids, position_ids=position, cache=cache, use_cache=True).logits[0, -1]
                recorder.end_step(0.0)
                ids, position = logits.argmax().view(1, 1), torch.tensor([[PROMPT_LEN + step]])
        monkeypatch.undo()
        rows = {name: column for name, column in recorder.steps_table().items() if not name.startswith("measured_")}
        return rows, [(layer.final_tiers().tolist(), layer.token_scores.tolist()) for layer in cache.layers]

    (rows, layers), (rows_alone, layers_alone) = run(False), run(True)
    assert layers == layers_alone  # every layer's tiers and scores
    # The same rows in the same order; the failed step's layer that attended is recorded with the next step (it
    # was placed as that one began), not with its own (which ended without it).
    assert {name: column for name, column in rows.items() if name != "step"} == \
        {name: column for name, column in rows_alone.items() if name != "step"}
    assert [a != b for a, b in zip(rows["step"], rows_alone["step"], strict=True)].count(True) == 1
