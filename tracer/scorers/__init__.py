"""Importance scorers (kvpress `presses/` style): one module per scorer, each a small dataclass with one
`score(observation, previous)` method; `SCORERS` is the static registry (nothing registers at import time).

Shapes and the shared mechanics (`Observation`, growing score tables) are in `base.py`. `AlsoScore` computes
extra scorers alongside the policy's own for `tokens.importance_by_scorer` (`also_score.py`).
"""

from __future__ import annotations

from tracer.scorers.also_score import AlsoScore
from tracer.scorers.base import BadScorerOption, Observation, Scorer
from tracer.scorers.gradient import GradientScorer, cached_entries, gradient_importance
from tracer.scorers.h2o import H2OScorer
from tracer.scorers.keynorm import KeyNormScorer
from tracer.scorers.oracle import OracleScorer
from tracer.scorers.random_baseline import RandomScorer
from tracer.scorers.recency import RecencyScorer
from tracer.scorers.rkv import RKVScorer
from tracer.scorers.snapkv import SnapKVScorer
from tracer.scorers.tova import TOVAScorer
from tracer.scorers.vatp import VATPScorer

SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in [
        H2OScorer, TOVAScorer, SnapKVScorer, KeyNormScorer, RKVScorer, RecencyScorer, RandomScorer,
        OracleScorer, VATPScorer, GradientScorer,
    ]
}

__all__ = [
    "SCORERS", "AlsoScore", "BadScorerOption", "GradientScorer", "H2OScorer", "KeyNormScorer", "Observation",
    "OracleScorer", "RKVScorer", "RandomScorer", "RecencyScorer", "Scorer", "SnapKVScorer", "TOVAScorer",
    "VATPScorer", "build_scorer", "cached_entries", "gradient_importance", "parse_also_score", "with_also_score",
]


def build_scorer(name: str, *, seed: int = 0, grad_window: int = 1, grad_interval: int = 1) -> Scorer:
    """A registered scorer with the options of `thoughtkv trace` that apply to it."""
    if name not in SCORERS:
        raise BadScorerOption(f"unknown scorer {name!r}; use one of {', '.join(SCORERS)}")
    if name == "random":
        return SCORERS[name](seed=seed)
    if name == "gradient":
        return GradientScorer(window=grad_window, interval=grad_interval)
    return SCORERS[name]()


def parse_also_score(text: str | None) -> tuple[str, ...]:
    """`--also-score A,B` -> ("A", "B"); the oracle needs its own full pass and cannot ride along."""
    names = tuple(n.strip() for n in (text or "").split(",") if n.strip())
    for name in names:
        if name not in SCORERS:
            raise BadScorerOption(f"--also-score: unknown scorer {name!r}; use one of {', '.join(SCORERS)}")
        if name == "oracle":
            raise BadScorerOption("--also-score cannot include oracle (it needs its own full pass); the full "
                                  "policy's tokens.importance already is the oracle's attention")
    if len(set(names)) != len(names):
        raise BadScorerOption(f"--also-score lists a scorer twice: {text!r}")
    return names


def with_also_score(primary: Scorer | None, names: tuple[str, ...], **options) -> Scorer | None:
    """Wrap the policy's scorer in an AlsoScore when extras are requested (else return it unchanged)."""
    if not names:
        return primary
    return AlsoScore(primary=primary, extras={name: build_scorer(name, **options) for name in names})
