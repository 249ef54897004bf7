"""Fidelity summaries of a run traced with `--fidelity-reference` (its `samples.fidelity_*` columns), torch-free.

Per sample, over the decode steps (step >= 1: the prefill's prediction is the full cache's for every policy,
as traffic counts decode steps only): the mean KL(full || policy) in nats, the share of steps whose top-1 token
is the reference's, and the mean NLL gap (policy minus full cache) on the reference chain and on the human-written
solution. Over samples: the mean with a 95% percentile-bootstrap interval (fixed seed, 2,000 resamples: KL is
skewed, a normal interval would cross 0), and for answer match a Wilson interval over the samples whose
full-cache chain has an answer. Each subset (`all`, `non-looping`: chains that repeat no 8-gram) carries its n.
"""

from __future__ import annotations

import math

import numpy as np

from traces.stats import wilson_interval

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
# all; non-looping: no repeated 8-gram (the loop flag); no-verbatim-repeat: no repeated span of 32 tokens (a
# sentence repeated verbatim: the degenerate loop; fluent chains repeat short phrases).
SUBSETS = ("all", "non-looping", "no-verbatim-repeat")
VERBATIM_REPEAT_TOKENS = 32


def has_fidelity(samples) -> bool:
    return "fidelity_kl" in samples and samples["fidelity_kl"].notna().any()


def mean_interval(values) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` with its 95% percentile-bootstrap interval (NaN when empty)."""
    values = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if values.size == 0:
        return math.nan, math.nan, math.nan
    if values.size == 1:
        return float(values[0]), float(values[0]), float(values[0])
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    means = values[rng.integers(0, values.size, (BOOTSTRAP_RESAMPLES, values.size))].mean(1)
    low, high = np.quantile(means, [0.025, 0.975])
    return float(values.mean()), float(low), float(high)


def _decode(values) -> np.ndarray:
    """A per-step list without its step 0 (the prefill's prediction)."""
    return np.asarray(values if values is not None else [], dtype=np.float64)[1:]


def _count(value) -> int:
    """A nullable integer column's value (a null reads back as None or NaN): 0 when null."""
    return 0 if value is None or (isinstance(value, float) and math.isnan(value)) else int(value)


def per_sample(samples):
    """One row per sample with fidelity columns: kl, top1, nll_gap (reference chain), human_nll_gap, human_kl,
    human_top1 (NaN without a solution), first_divergence, answer_match, full_answered, loops."""
    import pandas as pd

    rows = []
    for row in samples.itertuples():
        kl = _decode(row.fidelity_kl)
        if kl.size == 0:
            continue
        gap = _decode(row.fidelity_nll) - _decode(row.fidelity_full_nll)
        human = row.fidelity_human_nll
        human_gap = (_decode(human) - _decode(row.fidelity_human_full_nll)) if human is not None else np.array([])
        human_kl = getattr(row, "fidelity_human_kl", None)
        human_top1 = getattr(row, "fidelity_human_top1", None)
        rows.append({
            "sample_id": row.sample_id, "kl": float(kl.mean()), "top1": float(_decode(row.fidelity_top1).mean()),
            "nll_gap": float(gap.mean()), "human_nll_gap": float(human_gap.mean()) if human_gap.size else math.nan,
            "human_kl": float(_decode(human_kl).mean()) if human_kl is not None and len(human_kl) > 1 else math.nan,
            "human_top1": float(_decode(human_top1).mean()) if human_top1 is not None and len(human_top1) > 1
            else math.nan,
            "first_divergence": row.fidelity_first_divergence, "answer_match": bool(row.fidelity_answer_match),
            "full_answered": bool(row.fidelity_full_answered), "loops": bool(row.fidelity_reference_loops),
            "repeat": _count(getattr(row, "fidelity_reference_repeat", None)),
        })
    return pd.DataFrame(rows)


def summary(samples, subset: str = "all") -> dict:
    """The fidelity of a run's samples (`subset`: all | non-looping): n, each mean with its 95% interval
    (`kl`, `top1`, `nll_gap`, `human_nll_gap`: (mean, low, high)), answer match (k, n, low, high) over the
    samples whose full cache answered, the share of looping reference chains and the median first divergence
    (over the samples that diverge) with the share that diverge."""
    if subset not in SUBSETS:
        raise ValueError(f"subset must be one of {SUBSETS}, got {subset!r}")
    table = per_sample(samples)
    n_all = len(table)
    loops = int(table["loops"].sum()) if n_all else 0
    verbatim = int((table["repeat"] >= VERBATIM_REPEAT_TOKENS).sum()) if n_all else 0
    if subset == "non-looping" and n_all:
        table = table[~table["loops"]]
    elif subset == "no-verbatim-repeat" and n_all:
        table = table[table["repeat"] < VERBATIM_REPEAT_TOKENS]
    n = len(table)
    out = {"subset": subset, "n": n, "n_looping": loops, "n_verbatim_repeat": verbatim, "n_all": n_all}
    for key in ("kl", "top1", "nll_gap", "human_nll_gap", "human_kl", "human_top1"):
        out[key] = mean_interval(table[key]) if n else (math.nan,) * 3
    answered = table[table["full_answered"]] if n else table
    k = int(answered["answer_match"].sum()) if len(answered) else 0
    out["answer_match"] = (k, len(answered), *wilson_interval(k, len(answered)))
    diverged = table["first_divergence"].dropna() if n else []
    out["diverged_share"] = len(diverged) / n if n else math.nan
    out["median_first_divergence"] = float(np.median(diverged)) if len(diverged) else math.nan
    return out


def interval_text(triple, scale: float = 1.0, digits: int = 3) -> str:
    """'0.123 [0.101, 0.147]' (a (mean, low, high) triple; `scale` 100 for percentages)."""
    mean, low, high = (v * scale for v in triple)
    if math.isnan(mean):
        return "—"
    return f"{mean:.{digits}g} [{low:.{digits}g}, {high:.{digits}g}]"


def summary_line(samples, subset: str = "all") -> str:
    """One line for `thoughtkv trace`'s output: KL, top-1 and answer match with their intervals and n."""
    s = summary(samples, subset)
    k, n, low, high = s["answer_match"]
    match = f"{k}/{n} = {100 * k / n:.1f}% [{100 * low:.1f}%, {100 * high:.1f}%]" if n else "— (no full-cache answers)"
    return (f"fidelity to the full cache ({subset}, n={s['n']}; {s['n_looping']} of {s['n_all']} reference chains "
            f"loop): KL {interval_text(s['kl'])} nats/token, top-1 agreement {interval_text(s['top1'], 100)}%, "
            f"NLL gap {interval_text(s['nll_gap'])} (human solutions {interval_text(s['human_nll_gap'])}), "
            f"answer match {match} (95% bootstrap / Wilson CIs)")
