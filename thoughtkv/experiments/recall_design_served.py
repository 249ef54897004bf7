"""The recall design space's served point: the best prefetchable rule at 30% HBM, served with `thoughtkv capacity`
at docs/capacity_served.md's settings, with a recall buffer and layer prefetch (`thoughtkv experiment recall-design
--served-point`)."""

from __future__ import annotations

import json
from pathlib import Path

from thoughtkv.experiments.recall_design_settings import LATENCY_BUFFER, best_row, served_rows

SERVED_PROFILE = "h100-pcie"  # where the hierarchy's served rate is link-bound (docs/capacity_served.md)
SERVED_RATES = (4.0, 8.0, 16.0, 32.0)
SERVED_REFINE = 1


def served_point(results: list[dict], runs: Path, work: Path, workers: int | None = None, log=print) -> dict | None:
    """`thoughtkv capacity` (docs/capacity_served.md's serving settings: thoughtkv.experiments.capacity_served) of the best
    prefetchable rule's run at 30% HBM with an LRU of `LATENCY_BUFFER` blocks and layer prefetch, on
    `SERVED_PROFILE` (rates `SERVED_RATES`, `SERVED_REFINE` refinement round); each rate a sweep cell cached under
    WORK/served, summarised in WORK/served_point.json. None when no prefetchable cell has run."""
    import dataclasses

    from simulator.options import Projection, ServingConfig, SimOptions
    from thoughtkv.capacity import capacity_sweep
    from thoughtkv.experiments import capacity_served as served
    from traces.layout import write_atomic
    from traces.policy import recall_is_prefetchable

    prefetched = [r for r in results if r["policy"] == "hierarchy" and r["hbm_budget"] == 0.3
                  and recall_is_prefetchable(r["recall_rule"])]
    if not prefetched:
        return None
    best = best_row(prefetched)
    config = ServingConfig(**served.SETTINGS, projection=Projection(served.AS_MODEL),
                           options=SimOptions(**served.OPTIONS, recall_buffer_blocks=LATENCY_BUFFER,
                                              overlap="layer-prefetch"))
    log(f"recall-design: serving {best['cell']} (layer prefetch, LRU {LATENCY_BUFFER}) on {SERVED_PROFILE}")
    _, capacity = capacity_sweep([runs / best["cell"]], [SERVED_PROFILE], config, list(SERVED_RATES), SERVED_REFINE,
                                 work / "served" / "layer-prefetch", workers=workers, progress=False, log=log)
    row = capacity.iloc[0]
    point = {key: (None if row[key] != row[key] else float(row[key])) if key != "limit" else row[key]
             for key in ("max_rate_per_s", "first_failing_rate_per_s", "limit", "knee_mean_concurrency",
                         "knee_link_util_h2d", "knee_tbt_p99_s", "h2d_bytes_per_token_served")}
    result = {"buffer": LATENCY_BUFFER, "profile": SERVED_PROFILE, "cell": best["cell"],
              "recall_rule": best["recall_rule"], "recall_budget": best["recall_budget"], "n": best["n"],
              "accuracy": best["accuracy"], "ci_low": best["ci_low"], "ci_high": best["ci_high"],
              "settings": dataclasses.asdict(config), **point}
    write_atomic(work / "served_point.json", lambda temp: temp.write_text(json.dumps(result, indent=1, default=str)))
    return result


def served_point_lines(served: dict | None, capacity_csv: Path | None = None) -> list[str]:
    """The served frontier point, beside docs/capacity_served.md's hierarchy row at the same HBM and recall budget
    on the same profile (quest, no buffer, no prefetch) when `capacity_csv` holds it."""
    if not served:
        return []

    from thoughtkv.experiments import capacity_served
    from traces.stats import bytes_text

    settings = capacity_served.SETTINGS
    rate = "—" if served["max_rate_per_s"] is None else f"{served['max_rate_per_s']:.3g}"
    text = (f"Served frontier point (`thoughtkv capacity` at docs/capacity_served.md's settings: "
            f"{capacity_served.AS_MODEL}, {settings['lengths']} request lengths, p99 TBT ≤ "
            f"{1e3 * settings['tbt_slo_s']:g} ms and p99 TTFT ≤ {settings['ttft_slo_s']:g} s, "
            f"{settings['duration_s']:g} s of arrivals per rate, at most {settings['max_batch']} requests per "
            f"iteration; rates {', '.join(f'{r:g}' for r in SERVED_RATES)} req/s, {SERVED_REFINE} refinement round): "
            f"the best prefetchable rule at 30% HBM, {served['recall_rule']} recalling ≤ {served['recall_budget']:.0%} "
            f"({100 * served['accuracy']:.1f} [{100 * served['ci_low']:.1f}, {100 * served['ci_high']:.1f}]%, "
            f"n = {served['n']}), with `--recall-buffer-blocks {served['buffer']} --overlap layer-prefetch`, sustains "
            f"{rate} req/s on {served['profile']} ({served['limit']} beyond it; at the knee H2D "
            f"{bytes_text(served['h2d_bytes_per_token_served'])}/token, link {100 * served['knee_link_util_h2d']:.0f}% "
            f"busy, {served['knee_mean_concurrency']:.0f} requests per iteration)")
    rows = {} if capacity_csv is None or not capacity_csv.is_file() else served_rows(capacity_csv,
                                                                                   served["recall_budget"])
    quest = rows.get(served["profile"])
    if quest is not None:
        text += (f", where quest at the same HBM and recall budget, without buffer or prefetch, sustains "
                 f"{float(quest['max_rate_per_s']):.3g} req/s ({quest['limit']}; "
                 f"{100 * float(quest['accuracy']):.1f}% accurate; docs/capacity_served.md)")
    return [text + "."]


# -- why: how often a speculated query picks what the current one picks -------------------------------------
