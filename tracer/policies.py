"""Placement policies (registry, one small dataclass each): how many tokens may stay in HBM, how many must be
evicted, and whether the rest lives in DDR.

Budgets accept a fraction of the current logical length (0 < b <= 1, the seed's convention) or an absolute
token count (an integer > 1). The tiered cache (tracer/cache.py) applies the targets at block granularity,
after attention, never touching the protected sink and recent-window blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from thoughtkv_base import UserError


class BadBudget(UserError):
    pass


@dataclass(frozen=True)
class Budget:
    """A fraction of the logical length (value <= 1) or an absolute token count (integer value > 1)."""

    value: float

    @classmethod
    def parse(cls, text: str | float, what: str = "--hbm-budget") -> Budget:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise BadBudget(f"{what} {text!r} is not a number; give a fraction in (0, 1] or a token count") from None
        if not value > 0 or math.isinf(value) or (value > 1 and value != int(value)):
            raise BadBudget(f"{what} {text!r} must be a fraction in (0, 1] or a whole token count > 1")
        return cls(value)

    @property
    def is_fraction(self) -> bool:
        return self.value <= 1

    def tokens(self, logical_len: int) -> int:
        if self.is_fraction:
            return math.ceil(self.value * logical_len - 1e-9)
        return int(self.value)

    def describe(self) -> float | int:
        return self.value if self.is_fraction else int(self.value)


@dataclass(frozen=True)
class Targets:
    hbm_tokens: int | None  # None: no HBM limit
    evict_tokens: int  # at least this many tokens must be evicted (rounded down to whole blocks)
    uses_ddr: bool  # False: what does not fit in HBM is evicted (rounded up to whole blocks)


class Policy:
    name: str = ""

    def targets(self, logical_len: int) -> Targets:
        raise NotImplementedError


@dataclass(frozen=True)
class FullPolicy(Policy):
    """Everything stays in HBM: the reference."""

    name: str = "full"

    def targets(self, logical_len):
        return Targets(hbm_tokens=None, evict_tokens=0, uses_ddr=False)


@dataclass(frozen=True)
class EvictPolicy(Policy):
    """Pure eviction to an HBM budget (StreamingLLM / H2O style): the lowest-scored blocks are dropped."""

    hbm_budget: Budget = Budget(1.0)
    name: str = "evict"

    def targets(self, logical_len):
        return Targets(hbm_tokens=self.hbm_budget.tokens(logical_len), evict_tokens=0, uses_ddr=False)


@dataclass(frozen=True)
class HierarchyPolicy(Policy):
    """HBM budget b and eviction ratio e: the lowest-e fraction is evicted, what exceeds b lives in DDR and the
    top `recall_k` DDR blocks for the current query are recalled each step (see tracer/cache.py)."""

    hbm_budget: Budget = Budget(1.0)
    evict_ratio: float = 0.0
    name: str = "hierarchy"

    def targets(self, logical_len):
        return Targets(
            hbm_tokens=self.hbm_budget.tokens(logical_len),
            evict_tokens=math.floor(self.evict_ratio * logical_len),
            uses_ddr=True,
        )


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in [FullPolicy, EvictPolicy, HierarchyPolicy]}


def make_policy(name: str, hbm_budget: str | float = 1.0, evict_ratio: float = 0.0) -> Policy:
    if name not in POLICIES:
        raise UserError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
    if not 0.0 <= evict_ratio < 1.0:
        raise UserError(f"--evict-ratio {evict_ratio} must be in [0, 1)")
    budget = Budget.parse(hbm_budget)  # checked for every policy: a typo must not pass silently
    if name == "full":
        return FullPolicy()
    if name == "evict":
        return EvictPolicy(hbm_budget=budget)
    return HierarchyPolicy(hbm_budget=budget, evict_ratio=evict_ratio)
