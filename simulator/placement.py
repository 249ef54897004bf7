"""Block placement in numpy: which KV blocks of each layer sit in HBM, DDR or are evicted, step by step.

One implementation serves two users: `traces synth` (fills the block-movement columns of a synthetic trace
from the access model's masses) and the what-if replay (re-places the masses recorded in access.parquet under
another budget / block size / recall_k / scorer). Its settings and target arithmetic are the policy contract's
(`traces/policy.py`: `PolicySpec`, `movable_range`, `room_blocks`, ...), the very functions the tracer's cache
calls, and `tests/test_placement_matches_tracer.py` replays traced runs and checks every block's tier:

- `full`: every block stays in HBM.
- `evict`: after attention, keep the highest-scored movable blocks that fit the budget in HBM, drop the
  other resident ones for good.
- `hierarchy`: before attention the top `recall_k` DDR blocks are copied to HBM (recalled) and attended.
  After attention, first the lowest-scored blocks are evicted until floor(evict_ratio * logical_len) tokens
  (whole blocks) are gone, then the highest-scored movable blocks that fit the budget stay in HBM: with
  `promote`, a recalled block can take a resident block's place (promoted), and a resident block that no
  longer fits is copied to DDR (offloaded).

Movable blocks, protected tokens and the room the budget leaves are `traces.policy`'s. Scorers see only the blocks that were attended (HBM + recalled); blocks not
attended keep their score. A step's masses on every block (attended or not) are what the
accuracy-risk proxy needs: mass on evicted blocks, and mass on DDR blocks that were not recalled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thoughtkv_base import UserError
from traces.policy import PolicySpec, evict_target_blocks, movable_range, recall_blocks, room_blocks
from traces.schema import TIER_DDR, TIER_EVICTED, TIER_HBM

# Recall rules computable from recorded masses (traces/policy.py RECALL_RULES): "query" ranks DDR blocks by the
# current query's true attention mass (the oracle the tracer's quest bound approximates; it needs this layer's
# query, so layer-prefetch cannot run it), "score" by the scorer's scores from earlier steps (known before the
# step starts, so prefetch is valid). The tracer's key-bound rules ("quest", "quest-per-head") need keys: a
# replay of the run's own settings takes the recalls it recorded, anything else falls back to "query".
MASS_RECALL_RULES = ("query", "score")


class PlacementError(UserError):
    """An impossible placement request (one line, exit 2)."""


# ---------------------------------------------------------------- scorers (from masses only) ------------------


@dataclass
class H2OScorer:
    """Cumulative attention received (H2O)."""

    name: str = "h2o"

    def update(self, score: np.ndarray, mass: np.ndarray, attended: np.ndarray, step: int) -> np.ndarray:
        return score + np.where(attended, mass, 0.0)


@dataclass
class TOVAScorer:
    """The last attention received (TOVA); blocks not attended keep their previous score."""

    name: str = "tova"

    def update(self, score, mass, attended, step):
        return np.where(attended, mass, score)


@dataclass
class RecencyScorer:
    """The later the block, the more important (StreamingLLM)."""

    name: str = "recency"

    def update(self, score, mass, attended, step):
        return np.broadcast_to(np.arange(score.shape[1], dtype=np.float64), score.shape).copy()


@dataclass
class RandomScorer:
    """A seeded uniform score per block (same in every layer): the floor any scorer must beat."""

    name: str = "random"
    seed: int = 0

    def update(self, score, mass, attended, step):
        table = np.random.default_rng(self.seed).random(score.shape[1])
        return np.broadcast_to(table, score.shape).copy()


@dataclass
class OracleScorer:
    """The mass each block receives from now to the end of the sequence (upper bound, not deployable).

    `future` is [steps, layers, blocks]: a suffix sum of the masses, filled by `replay` before the first step.
    """

    name: str = "oracle"
    future: np.ndarray | None = None

    def update(self, score, mass, attended, step):
        if self.future is None:
            raise PlacementError("the oracle scorer needs the whole access table; use it through replay()")
        n = score.shape[1]
        ahead = self.future[step + 1, :, :n] if step + 1 < self.future.shape[0] else np.zeros_like(score)
        return np.array(ahead, dtype=np.float64)


SCORERS = {cls.name: cls for cls in [H2OScorer, TOVAScorer, RecencyScorer, RandomScorer, OracleScorer]}


def get_scorer(name: str, **params):
    try:
        return SCORERS[name](**params)
    except KeyError:
        raise PlacementError(
            f"scorer {name!r} cannot be computed from recorded masses; use one of {', '.join(SCORERS)}"
        ) from None


# ---------------------------------------------------------------- one step ------------------------------------


@dataclass
class StepPlacement:
    """What happened to the blocks of every layer at one step (arrays are [n_layers])."""

    hbm_tokens: np.ndarray  # at attention: resident, incl. new, excl. recalled
    ddr_tokens: np.ndarray  # home in DDR, incl. recalled
    evicted_tokens: np.ndarray
    recalled_tokens: np.ndarray
    hbm_blocks: np.ndarray
    ddr_blocks: np.ndarray
    evicted_blocks: np.ndarray
    n_recalled: np.ndarray  # blocks copied DDR -> HBM before attention
    n_offloaded: np.ndarray  # blocks copied HBM -> DDR after attention
    n_moved: np.ndarray  # blocks whose tier the placement changed (offloaded, promoted, evicted)
    mass_hbm: np.ndarray
    mass_ddr: np.ndarray  # on recalled blocks
    mass_evicted: np.ndarray  # on blocks evicted before this step
    mass_not_recalled: np.ndarray  # on DDR blocks not recalled
    ids: dict[str, list[np.ndarray]] | None = None  # recalled/promoted/offloaded/evicted ids per layer


class Placement:
    """The placement state of one sequence: a tier and a score for every (layer, block).

    `recorded_recalls` (optional, [step][layer] -> block ids): the recalls a traced run made, replayed as they
    were (a replay of the run's own settings with a key-bound recall rule); otherwise the spec's rule decides.
    """

    def __init__(self, config: PolicySpec, n_layers: int, scorer=None, recorded_recalls=None):
        self.config = config
        self.recorded_recalls = recorded_recalls
        self.n_layers = n_layers
        self.scorer = scorer if scorer is not None else get_scorer(config.scorer)
        self.tier = np.zeros((n_layers, 0), dtype=np.int8)
        self.score = np.zeros((n_layers, 0), dtype=np.float64)

    def _grow(self, n_blocks: int) -> None:
        extra = n_blocks - self.tier.shape[1]
        if extra > 0:  # new blocks are written into HBM
            self.tier = np.concatenate([self.tier, np.full((self.n_layers, extra), TIER_HBM, np.int8)], axis=1)
            self.score = np.concatenate([self.score, np.zeros((self.n_layers, extra))], axis=1)

    def step(self, step: int, logical_len: int, mass: np.ndarray, record_ids: bool = False) -> StepPlacement:
        """Advance one step: recall, attention (observe `mass` [n_layers, n_blocks]), then rebalance."""
        cfg = self.config
        n_blocks = -(-logical_len // cfg.block_size)
        self._grow(n_blocks)
        tier = self.tier
        tokens = np.full(n_blocks, float(cfg.block_size))
        tokens[-1] = logical_len - (n_blocks - 1) * cfg.block_size
        in_hbm, in_ddr, evicted = tier == TIER_HBM, tier == TIER_DDR, tier == TIER_EVICTED

        recalled = self._choose_recall(step, logical_len, in_ddr, mass)
        attended = in_hbm | recalled
        mass_recalled = np.where(recalled, mass, 0.0).sum(1)
        result = StepPlacement(
            hbm_tokens=in_hbm @ tokens,
            ddr_tokens=in_ddr @ tokens,
            evicted_tokens=evicted @ tokens,
            recalled_tokens=recalled @ tokens,
            hbm_blocks=in_hbm.sum(1),
            ddr_blocks=in_ddr.sum(1),
            evicted_blocks=evicted.sum(1),
            n_recalled=recalled.sum(1),
            n_offloaded=np.zeros(self.n_layers, dtype=np.int64),
            n_moved=np.zeros(self.n_layers, dtype=np.int64),
            mass_hbm=np.where(in_hbm, mass, 0.0).sum(1),
            mass_ddr=mass_recalled,
            mass_evicted=np.where(evicted, mass, 0.0).sum(1),
            mass_not_recalled=np.where(in_ddr, mass, 0.0).sum(1) - mass_recalled,
        )
        self.score = self.scorer.update(self.score, mass, attended, step)
        offloaded, promoted, newly_evicted = self._rebalance(n_blocks, logical_len, recalled)
        result.n_offloaded = offloaded.sum(1)
        result.n_moved = offloaded.sum(1) + promoted.sum(1) + newly_evicted.sum(1)
        if record_ids:
            result.ids = {
                "recalled_block_ids": _row_ids(recalled),
                "promoted_block_ids": _row_ids(promoted),
                "offloaded_block_ids": _row_ids(offloaded),
                "evicted_block_ids": _row_ids(newly_evicted),
            }
        return result

    def _choose_recall(self, step: int, logical_len: int, in_ddr: np.ndarray, mass: np.ndarray) -> np.ndarray:
        recalled = np.zeros_like(in_ddr)
        if self.recorded_recalls is not None:
            for layer, ids in enumerate(self.recorded_recalls[step]):
                recalled[layer, np.asarray(ids, dtype=np.int64)] = True
            return recalled & in_ddr
        k = recall_blocks(self.config, logical_len)
        if k == 0 or not in_ddr.any():
            return recalled
        key = self.score if self.config.recall_rule == "score" else mass
        priority = np.where(in_ddr, key, -np.inf)
        order = np.argsort(-priority, axis=1, kind="stable")[:, :k]
        rows = np.arange(self.n_layers)[:, None]
        recalled[rows, order] = True
        return recalled & in_ddr

    def _rebalance(self, n_blocks: int, logical_len: int, recalled: np.ndarray):
        """After attention (tracer/cache/placement.py `place`): evict to the eviction target, then keep the budget's
        best movable blocks in HBM and offload (hierarchy) or evict (evict) the other resident ones."""
        cfg = self.config
        none = np.zeros_like(recalled)
        first, end = movable_range(cfg, logical_len)
        if cfg.policy == "full" or end <= first:
            return none, none, none
        tier, score = self.tier[:, first:end], self.score[:, first:end]  # views: writes go to the state
        room = room_blocks(cfg, logical_len)
        was_hbm = tier == TIER_HBM
        recalled = recalled[:, first:end]

        evict_now = np.zeros_like(was_hbm)
        if cfg.policy == "hierarchy":
            alive = tier != TIER_EVICTED
            need = np.minimum(evict_target_blocks(cfg, logical_len) - (~alive).sum(1), alive.sum(1))
            if need.max() > 0:
                evict_now = alive & (_rank(np.where(alive, score, np.inf)) < need[:, None])
                tier[evict_now] = TIER_EVICTED
        candidates = tier == TIER_HBM
        if cfg.promote:
            candidates |= recalled & (tier == TIER_DDR)
        keep = candidates & (_rank(np.where(candidates, -score, np.inf)) < room)
        demoted = candidates & ~keep & was_hbm
        promoted = keep & (tier == TIER_DDR)
        tier[promoted] = TIER_HBM
        if cfg.policy == "hierarchy":
            tier[demoted] = TIER_DDR
            offloaded = demoted
        else:
            tier[demoted] = TIER_EVICTED
            evict_now |= demoted
            offloaded = np.zeros_like(demoted)
        return _widen(offloaded, first, n_blocks), _widen(promoted, first, n_blocks), _widen(evict_now, first, n_blocks)


def _rank(key: np.ndarray) -> np.ndarray:
    """Per row, the position of each entry in ascending order of `key` (ties: lower block id first)."""
    order = np.argsort(key, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(key.shape[1])[None, :].repeat(key.shape[0], 0), axis=1)
    return rank


def _widen(mask: np.ndarray, first: int, n_blocks: int) -> np.ndarray:
    out = np.zeros((mask.shape[0], n_blocks), dtype=bool)
    out[:, first : first + mask.shape[1]] = mask
    return out


def _row_ids(mask: np.ndarray) -> list[np.ndarray]:
    rows, cols = np.nonzero(mask)
    bounds = np.searchsorted(rows, np.arange(mask.shape[0] + 1))
    cols = cols.astype(np.int32)
    return [cols[bounds[i] : bounds[i + 1]] for i in range(mask.shape[0])]


def merge_blocks(mass: np.ndarray, factor: int) -> np.ndarray:
    """Masses of blocks of size b -> masses of blocks of size factor * b (sums of consecutive groups)."""
    if factor == 1:
        return mass
    n = mass.shape[-1]
    padded = np.zeros(mass.shape[:-1] + (-(-n // factor) * factor,), dtype=np.float64)
    padded[..., :n] = mass
    return padded.reshape(mass.shape[:-1] + (-1, factor)).sum(-1)


def future_mass(masses: list[np.ndarray]) -> np.ndarray:
    """Suffix sums over steps of per-step masses [layers, blocks_s] -> [steps, layers, max_blocks] (oracle)."""
    n_layers = masses[0].shape[0]
    width = max(m.shape[1] for m in masses)
    dense = np.zeros((len(masses), n_layers, width))
    for s, m in enumerate(masses):
        dense[s, :, : m.shape[1]] = m
    return np.cumsum(dense[::-1], axis=0)[::-1]
