"""The tiered cache's two registries, every entry against an independent dense reference written here: the recall
rules (tracer.cache.recall_rules: which DDR blocks a row's query reads) and the placement policies
(tracer.cache.placements: what each policy moves after attention). A new rule or policy is one class and one
line in its registry, and one reference below (the test refuses an entry without one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tracer.cache.placements import PLACEMENTS, MovableBlocks
from tracer.cache.recall_rules import RECALL_RULES, RecallRequest
from tracer.transfer import KeyBounds
from traces.policy import POLICIES, TRACER_RECALL_RULES, PolicySpec
from traces.schema import TIER_DDR, TIER_EVICTED, TIER_HBM

N_KV_HEADS, GROUP, HEAD_DIM, BLOCK, N_BLOCKS = 2, 3, 8, 4, 12


def test_the_registries_hold_every_rule_and_policy_of_the_contract():
    assert set(RECALL_RULES) == set(TRACER_RECALL_RULES)
    assert set(PLACEMENTS) == set(POLICIES)


# -- recall rules ----------------------------------------------------------------------------------------------
def quest_bounds(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Quest's bound, elementwise: [rows, Hkv, group, blocks] = sum_d max(q_d * kmax_d, q_d * kmin_d)."""
    kmax, kmin = keys.amax(3), keys.amin(3)  # keys [rows, blocks, Hkv, block, d] -> [rows, blocks, Hkv, d]
    q = query[:, None]  # [rows, 1, Hkv, group, d]
    return torch.maximum(q * kmax[:, :, :, None], q * kmin[:, :, :, None]).sum(-1).permute(0, 2, 3, 1)


def top(scores: list[float], allowed: list[int], k: int) -> set[int]:
    return set(sorted(allowed, key=lambda b: -scores[b])[:k])


def quest_reference(bounds, in_ddr, wanted):
    picks = []
    for row, k in enumerate(wanted):
        best = bounds[row].flatten(0, 1).amax(0).tolist()
        picks.append((top(best, in_ddr[row], k), None))
    return picks


def per_head_reference(bounds, in_ddr, wanted):
    picks = []
    for row, k in enumerate(wanted):
        heads = [top(bounds[row, h].amax(0).tolist(), in_ddr[row], k) for h in range(N_KV_HEADS)]
        picks.append((set().union(*heads), heads))
    return picks


def oracle_reference(query, keys, in_ddr, wanted, scaling):
    """The true attention mass (mean over query heads) each block gets from an exact softmax over every key of
    the row, dense, in float64; the top `wanted` DDR blocks by it."""
    picks = []
    for row, k in enumerate(wanted):
        flat = keys[row].double().permute(1, 0, 2, 3).flatten(1, 2)  # [Hkv, blocks * block, d]
        weights = torch.softmax(torch.einsum("hgd,hkd->hgk", query[row].double(), flat) * scaling, -1)
        mass = weights.mean((0, 1)).view(N_BLOCKS, BLOCK).sum(1).tolist()
        picks.append((top(mass, in_ddr[row], k), None))
    return picks


def score_reference(token_scores, in_ddr, wanted):
    picks = []
    for row, k in enumerate(wanted):
        block_scores = token_scores[row].view(N_BLOCKS, BLOCK).sum(1).tolist()
        picks.append((top(block_scores, in_ddr[row], k), None))
    return picks


REFERENCES = {"quest": lambda request, keys, in_ddr, wanted: quest_reference(
                  quest_bounds(request.query, keys), in_ddr, wanted),
              "quest-per-head": lambda request, keys, in_ddr, wanted: per_head_reference(
                  quest_bounds(request.query, keys), in_ddr, wanted),
              "oracle": lambda request, keys, in_ddr, wanted: oracle_reference(
                  request.query, keys, in_ddr, wanted, request.scaling),
              "score": lambda request, keys, in_ddr, wanted: score_reference(
                  request.layer.token_scores, in_ddr, wanted)}
# The speculative rules: the same bounds under the layer's query of the previous step (`registry_layer` is layer 0,
# where prev-layer takes it too; prev-layer's query from the previous layer's input is tests/test_recall_design.py's).
for _rule, _reference in (("prev-layer", quest_reference), ("prev-layer-per-head", per_head_reference),
                          ("prev-step", quest_reference), ("prev-step-per-head", per_head_reference)):
    REFERENCES[_rule] = lambda request, keys, in_ddr, wanted, reference=_reference: reference(
        quest_bounds(request.layer.last_query.view(request.query.shape), keys), in_ddr, wanted)


def registry_layer(keys: torch.Tensor, in_ddr: list[list[int]], bounds: KeyBounds, token_scores: torch.Tensor):
    """A layer as the rules read it: the DDR store (bounds, and the DDR blocks' keys through `get`), and the
    resident keys in pages: every non-DDR block's, in shuffled slots, with empty slots (-1) among them; layer 0,
    with its rows' queries of the previous step (`last_query`, what the speculative rules read there)."""
    rows = keys.shape[0]
    slots = N_BLOCKS * BLOCK + 2 * BLOCK
    pages = torch.zeros(rows, N_KV_HEADS, slots, HEAD_DIM)
    slot_pos = torch.full((rows, slots), -1, dtype=torch.long)
    for row in range(rows):
        resident = [b for b in range(N_BLOCKS) if b not in in_ddr[row]]
        order = torch.randperm(slots, generator=torch.Generator().manual_seed(row))
        for j, block in enumerate(resident):
            where = order[j * BLOCK : (j + 1) * BLOCK]
            pages[row, :, where] = keys[row, block]
            slot_pos[row, where] = block * BLOCK + torch.arange(BLOCK)

    def get(row_ids, block_ids, row=None):
        blocks = keys[row_ids, block_ids]
        return blocks, blocks, 0

    last_query = torch.randn(rows, N_KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(rows))
    return SimpleNamespace(ddr=SimpleNamespace(bounds=bounds, get=get), token_scores=token_scores, keys=pages,
                           slot_pos=slot_pos, main_slots=slice(0, slots), head_dim=HEAD_DIM, block_size=BLOCK,
                           layer_idx=0, last_query=last_query)


@pytest.mark.parametrize("name", list(RECALL_RULES))
def test_a_recall_rule_picks_what_its_dense_reference_picks(name):
    rule = RECALL_RULES[name]
    generator = torch.Generator().manual_seed(3)
    rows = 3
    keys = torch.randn(rows, N_BLOCKS, N_KV_HEADS, BLOCK, HEAD_DIM, generator=generator)
    query = torch.randn(rows, N_KV_HEADS, GROUP, HEAD_DIM, generator=generator)
    in_ddr = [[1, 2, 4, 5, 7, 9, 10], [0, 3, 6], [2, 3, 5, 8, 11]]  # each row's blocks whose home is DDR
    wanted = (3, 2, 4)
    bounds = KeyBounds(N_KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    bounds.reserve(rows, N_BLOCKS)
    row_ids, block_ids = torch.arange(rows).repeat_interleave(N_BLOCKS), torch.arange(N_BLOCKS).repeat(rows)
    bounds.put(row_ids, block_ids, keys.flatten(0, 1))
    mask = torch.zeros(rows, N_BLOCKS, dtype=torch.bool)
    for row, blocks in enumerate(in_ddr):
        mask[row, blocks] = True
    bounds.mark(torch.arange(rows), mask)
    token_scores = torch.rand(rows, N_BLOCKS * BLOCK, generator=generator)
    layer = registry_layer(keys, in_ddr, bounds, token_scores)
    request = RecallRequest(query, slice(0, rows), wanted, N_BLOCKS, layer, scaling=0.7)

    choice = rule.select(request)
    assert name in REFERENCES, f"recall rule {name!r} has no reference in this test"
    expected = REFERENCES[name](request, keys, in_ddr, wanted)
    for row, (picks, heads) in enumerate(expected):
        n = choice.per_row[row]
        ids = choice.ids[row, :n].tolist()
        assert len(set(ids)) == n and set(ids) == picks, row  # distinct DDR blocks: the reference's
        if rule.counts_known:
            assert n == wanted[row]
        if heads is not None:  # each KV head attends exactly its own picks among the recalled blocks
            attended = choice.head_picks[row, :n]
            assert [{ids[j] for j in range(n) if attended[j, h]} for h in range(N_KV_HEADS)] == heads
        else:
            assert choice.head_picks is None


# -- placement policies ----------------------------------------------------------------------------------------
def placement_reference(policy: str, scores, tier, in_range, room, victims, recalled):
    """Per row, in plain Python, the contract's rule: evict the lowest-scored alive movable blocks (`victims`),
    keep the `room` best-scored candidates (HBM blocks, and recalled DDR ones under promotion) in HBM, demote
    the other resident ones (to DDR under the hierarchy, dropped under evict); ties by block id."""
    out = []
    for row in range(len(scores)):
        old = tier[row]
        new, moved = list(old), {"offloaded": set(), "promoted": set(), "evicted": set()}
        movable = [b for b in range(len(old)) if in_range[row][b]]
        if policy == "full":
            out.append((new, moved))
            continue
        alive = sorted((b for b in movable if old[b] != TIER_EVICTED), key=lambda b: (scores[row][b], b))
        for b in alive[: victims[row]]:
            new[b] = TIER_EVICTED
            moved["evicted"].add(b)
        candidates = [b for b in movable if new[b] == TIER_HBM]
        if recalled is not None:
            candidates += [b for b in movable if recalled[row][b] and new[b] == TIER_DDR]
        keep = set(sorted(candidates, key=lambda b: (-scores[row][b], b))[: room[row]])
        for b in candidates:
            if b in keep and new[b] == TIER_DDR:
                new[b] = TIER_HBM
                moved["promoted"].add(b)
            elif b not in keep and old[b] == TIER_HBM:
                new[b] = TIER_DDR if policy == "hierarchy" else TIER_EVICTED
                moved["offloaded" if policy == "hierarchy" else "evicted"].add(b)
        out.append((new, moved))
    return out


CASES = [("full", False, False), ("evict", False, False), ("hierarchy", False, False), ("hierarchy", True, False),
         ("hierarchy", False, True), ("hierarchy", True, True)]


@pytest.mark.parametrize("policy, victims, promote", CASES)
def test_a_placement_moves_what_its_dense_reference_moves(policy, victims, promote):
    assert {case[0] for case in CASES} == set(PLACEMENTS)  # (every policy is a case)
    generator = torch.Generator().manual_seed(5)
    rows, n = 4, N_BLOCKS
    scores = torch.rand(rows, n, generator=generator)
    codes = [TIER_HBM] if policy != "hierarchy" else [TIER_HBM, TIER_HBM, TIER_DDR, TIER_EVICTED]
    tier = torch.tensor(codes, dtype=torch.int8)[torch.randint(len(codes), (rows, n), generator=generator)]
    sinks, ends = [1, 0, 2, 1], [10, 12, 9, 11]
    in_range = torch.tensor([[sinks[r] <= b < ends[r] for b in range(n)] for r in range(rows)])
    room = [3, 5, 0, 2]
    evicting = [1, 0, 2, 3] if victims else [0] * rows
    recalled = (torch.rand(rows, n, generator=generator) < 0.5) & (tier == TIER_DDR) if promote else None
    moves = PLACEMENTS[policy].decide(MovableBlocks(
        scores, tier, in_range, torch.tensor(room)[:, None], torch.tensor(evicting)[:, None], any(evicting), recalled))

    expected = placement_reference(policy, scores.tolist(), tier.tolist(), in_range.tolist(), room, evicting,
                                   None if recalled is None else recalled.tolist())
    def ids(mask, row: int) -> set[int]:
        return set() if mask is None else set(mask[row].nonzero().squeeze(1).tolist())

    assert moves.tier.dtype == torch.int8
    for row, (new, moved) in enumerate(expected):
        assert moves.tier[row].tolist() == new, row
        assert ids(moves.offloaded, row) == moved["offloaded"] and ids(moves.promoted, row) == moved["promoted"]
        assert ids(moves.evicted_from_hbm, row) | ids(moves.evicted_from_ddr, row) == moved["evicted"]
        assert not ids(moves.evicted_from_hbm, row) & ids(moves.evicted_from_ddr, row)
    # Where the policy says the host knows the counts, they are the ones that moved.
    spec = PolicySpec(policy=policy, hbm_budget=0.5, evict_ratio=0.1 if victims else 0.0, promote=promote)
    if PLACEMENTS[policy].counts_known(spec):
        for row, (_, moved) in enumerate(expected):
            movable = in_range[row].sum().item()
            hbm_movable = movable - ((tier[row] != TIER_HBM) & in_range[row]).sum().item()
            leaving = hbm_movable - min(room[row], hbm_movable)
            offloaded, _, evicted, _ = PLACEMENTS[policy].host_counts(leaving)
            assert (offloaded, evicted) == (len(moved["offloaded"]), len(moved["evicted"]))
