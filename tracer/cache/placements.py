"""Placement policies: what each policy does with a row's movable blocks after attention (a registry).

One class per policy of the contract (`traces.policy.POLICIES`), one method: `decide(blocks) -> Moves`, on
the device, for every placing row at once (`[m, blocks]` tensors, ids below the rows' widest movable end).
The base class owns the rule the contract states: evict the lowest-scored alive blocks until the eviction
target is met, then keep the `room` best-scored candidates in HBM (a recalled block is a candidate when
promotion is on) and demote the other resident ones; a policy says where a demoted block goes and which of
its counts the host knows without reading the device (`counts_known`, `host_counts`). The mechanics (moving
the bytes, freeing and packing pages, recording the moves) are `tracer.cache.placement`'s. Ties rank by
block id (`tracer.cache.indexing.ranks`), as the simulator's placement (simulator/placement.py) does.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch

from tracer.cache.indexing import ranks
from traces.policy import PolicySpec
from traces.schema import TIER_DDR, TIER_EVICTED, TIER_HBM


class MovableBlocks(NamedTuple):
    """The placing rows' blocks as a placement sees them, `[m, blocks]` each unless said."""

    scores: torch.Tensor  # each block's score (the sum of its tokens')
    tier: torch.Tensor  # TIER_* codes, int8
    in_range: torch.Tensor  # bool: the row's movable blocks (sink_blocks <= id < movable end)
    room: torch.Tensor  # [m, 1]: the movable blocks HBM has room for
    victims: torch.Tensor  # [m, 1]: the blocks to evict now
    any_victims: bool  # (host) whether any row has victims
    recalled: torch.Tensor | None  # bool: recalled this step (promotion candidates); None without promotion


class Moves(NamedTuple):
    """A placement's outcome: the new tiers and what moved, each a `[m, blocks]` mask, None where no block can
    have moved so under the policy (no kernel makes it, none reads it)."""

    tier: torch.Tensor  # the new TIER_* codes, int8
    was_hbm: torch.Tensor  # movable and in HBM before
    offloaded: torch.Tensor | None  # HBM -> DDR (move code 1)
    promoted: torch.Tensor | None  # recalled DDR -> HBM (2)
    evicted_from_hbm: torch.Tensor | None  # (3)
    evicted_from_ddr: torch.Tensor | None  # (4)

    @property
    def outcomes(self) -> tuple:
        """The four masks in move-code order (1-4)."""
        return self.offloaded, self.promoted, self.evicted_from_hbm, self.evicted_from_ddr


class Placement:
    """Evict to the target, keep the room's best candidates, demote the rest to `demoted_to`."""

    name: ClassVar[str]
    demoted_to: ClassVar[int]  # where a demoted block goes: TIER_DDR or TIER_EVICTED

    def counts_known(self, spec: PolicySpec) -> bool:
        """Whether the host knows every tier's block count from the policy's targets alone (no read-back):
        without victims and promotion each placement keeps min(room, candidates) and demotes the rest."""
        return True

    def host_counts(self, leaving: int) -> tuple[int, int, int, int]:
        """(offloaded, promoted, evicted from HBM, evicted from DDR) of a row whose `leaving` blocks are demoted
        (where `counts_known`)."""
        return (leaving, 0, 0, 0) if self.demoted_to == TIER_DDR else (0, 0, leaving, 0)

    def decide(self, blocks: MovableBlocks) -> Moves:
        to_ddr = self.demoted_to == TIER_DDR
        scores, tier, in_range = blocks.scores, blocks.tier, blocks.in_range
        was_hbm = (tier == TIER_HBM) & in_range
        evict_now = None
        if blocks.any_victims:  # the lowest-scored alive blocks, as many as each row's target asks
            alive = (tier != TIER_EVICTED) & in_range
            evict_now = (ranks(scores.masked_fill(~alive, float("inf")), descending=False) < blocks.victims) & alive
            tier = torch.where(evict_now, TIER_EVICTED, tier)
        # (without victims or promotion the tiers are as they were: the candidates are the blocks in HBM)
        promote = blocks.recalled is not None
        candidates = was_hbm if evict_now is None and not promote else (tier == TIER_HBM) & in_range
        if promote:
            candidates |= blocks.recalled & (tier == TIER_DDR)
        # The top `room` candidates by score (all of them when there are fewer), ranked on the device.
        keep = (ranks(scores.masked_fill(~candidates, float("-inf")), descending=True) < blocks.room) & candidates
        demoted = candidates & ~keep & was_hbm
        promoted = None
        if promote:  # (without promotion every candidate, so every kept block, is in HBM)
            promoted = keep & (tier == TIER_DDR)
            tier = torch.where(promoted, TIER_HBM, tier)
        tier = torch.where(demoted, self.demoted_to, tier).to(torch.int8)
        offloaded, evicted_from_hbm, evicted_from_ddr = demoted if to_ddr else None, None, None
        if not to_ddr:  # (demoted blocks were in HBM)
            evict_now = demoted if evict_now is None else evict_now | demoted
        if evict_now is not None:
            evicted_from_hbm = evict_now & was_hbm
            if to_ddr:  # (only victims can be DDR blocks)
                evicted_from_ddr = evict_now & ~was_hbm
        return Moves(tier, was_hbm, offloaded, promoted, evicted_from_hbm, evicted_from_ddr)


class Full(Placement):
    """Everything stays in HBM (the reference): the contract gives no targets, so nothing is ever placed."""

    name, demoted_to = "full", TIER_HBM

    def host_counts(self, leaving: int) -> tuple[int, int, int, int]:
        return 0, 0, 0, 0

    def decide(self, blocks: MovableBlocks) -> Moves:
        was_hbm = (blocks.tier == TIER_HBM) & blocks.in_range
        return Moves(blocks.tier.to(torch.int8), was_hbm, None, None, None, None)


class Evict(Placement):
    """Pure eviction to the HBM budget (StreamingLLM / H2O / TOVA by scorer): a demoted block is dropped."""

    name, demoted_to = "evict", TIER_EVICTED


class Hierarchy(Placement):
    """HBM, then DDR: a demoted block is offloaded (and recalled by the recall rule); `evict_ratio` of the
    length is evicted first, and with `promote` a recalled block competes for HBM by score."""

    name, demoted_to = "hierarchy", TIER_DDR

    def counts_known(self, spec: PolicySpec) -> bool:
        # (eviction may take a DDR or an HBM block, promotion a DDR block: data-dependent counts)
        return spec.evict_ratio == 0 and not spec.promote


PLACEMENTS: dict[str, Placement] = {p.name: p for p in (Full(), Evict(), Hierarchy())}


def counts_are_exact(spec: PolicySpec) -> bool:
    """Whether the host knows every tier's block count of `spec`'s policy from its targets alone."""
    return PLACEMENTS[spec.policy].counts_known(spec)
