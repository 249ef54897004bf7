"""The served part of docs/real_model.md: the real LM's runs served at qwen2-7b's shapes, fidelity against the
highest sustainable arrival rate (`thoughtkv experiment real-model --part served`).

A subset of the table's cells (the full cache, the best evictions and hierarchies at 30% and 50% HBM) is served
by `thoughtkv capacity`'s sweep with docs/capacity_served.md's settings (thoughtkv/capacity_served.py: the one
home of SLOs, windows, lengths and overheads) on h100-pcie and gh200-96gb; each rate is a cached sweep cell under
RUNS/served, so a rerun recomputes nothing that is done. The request lengths are R1-7B GSM8K-like (the traced
chains are resampled to them, every tier keeping its share of the context), so the rates are a 7B's and the
fidelity is the 135M model's at the same policy. Writes OUT/real_model_served.md (embedded in real_model.md),
OUT/real_model_served.csv and OUT/figures/real_model_served_frontier.png.
"""

from __future__ import annotations

from pathlib import Path

from thoughtkv_base.markdown import markdown_table

PROFILES = ("h100-pcie", "gh200-96gb")
FIGURE_STEM = "real_model_served_frontier"


def serve(out: Path, runs: Path, cells, fidelity: dict, workers: int | None = None) -> Path | None:
    """Serve `cells` (thoughtkv.experiments.real_model.Cell, those that have run under `runs`) and write the section;
    `fidelity`: the table's rows by cell name (thoughtkv.experiments.real_model.result_rows). None when no cell has run."""
    from simulator.options import Projection, ServingConfig, SimOptions
    from thoughtkv.capacity import capacity_sweep
    from thoughtkv.experiments.capacity_served import AS_MODEL, OPTIONS, RATES, REFINE, SETTINGS

    cells = [c for c in cells if (runs / c.name / "run.json").is_file()]
    if not cells:
        return None
    config = ServingConfig(**SETTINGS, projection=Projection(AS_MODEL), options=SimOptions(**OPTIONS))
    _, capacity = capacity_sweep([runs / c.name for c in cells], list(PROFILES), config, list(RATES), REFINE,
                                 runs / "served", workers=workers)
    return write(out, capacity, config, fidelity, {c.name: c.label for c in cells})


def write(out: Path, capacity, config, fidelity: dict, labels: dict) -> Path:
    from analysis.real_model_figures import served_frontier
    from analysis.serving import max_rate_text, slo_text
    from analysis.style import save_figure
    from traces.layout import write_atomic
    from traces.stats import bytes_text

    capacity = capacity.assign(cell=[Path(r).name for r in capacity["run_dir"]])
    for column in ("kl", "kl_low", "kl_high", "top1", "top1_low", "top1_high", "n"):
        capacity[column] = [fidelity[c][column] if c in fidelity else (0.0 if column.startswith("kl") else
                                                                          (1.0 if column.startswith("top1") else None))
                            for c in capacity["cell"]]
    # The HBM budget is part of the name: the same rule at two budgets is two points, in the table and the figure.
    capacity["method"] = ["full cache" if cell == "full" else f"{labels[cell]} at {budget:.0%} HBM"
                          for cell, budget in zip(capacity["cell"], capacity["hbm_budget"], strict=True)]
    order = {profile: i for i, profile in enumerate(PROFILES)}
    capacity = capacity.sort_values(["profile", "hbm_budget", "method"], kind="stable",
                                    key=lambda column: column.map(order) if column.name == "profile" else column)
    capacity.to_csv(out / "real_model_served.csv", index=False)
    save_figure(served_frontier(capacity), out / "figures", FIGURE_STEM)
    slo = slo_text(config.tbt_slo_s, config.ttft_slo_s)
    lines = ["## Served: fidelity against the highest sustainable arrival rate", "",
             f"The runs above served by `thoughtkv capacity` at qwen2-7b's shapes with R1-7B GSM8K-like request "
             f"lengths on {' and '.join(PROFILES)} (the settings of docs/capacity_served.md: {config.duration_s:g} s "
             f"of Poisson arrivals per rate, at most {config.max_batch} requests per iteration, overheads "
             f"{config.options.overhead_mode}, transfers {config.options.transfer}; sustainable = {slo}, nothing "
             "rejected). The rate is a 7B's; the fidelity is the 135M model's under the same policy (the full "
             "cache: the reference itself). Regenerate: `thoughtkv experiment real-model --part served --out docs/`.", "",
             f"![served frontier](figures/{FIGURE_STEM}.png)", "",
             ]
    lines += markdown_table(
        ("profile", "method", "max rate (req/s)", "limit beyond it", "top-1 agreement % [95% CI]", "KL nats/token",
         "H2D/token (served)", "link util. at knee", "HBM occupancy at knee"),
        ([r["profile"], r["method"], max_rate_text(r), r["limit"],
          f"{100 * r['top1']:.1f} [{100 * r['top1_low']:.1f}, {100 * r['top1_high']:.1f}]", f"{r['kl']:.3f}",
          bytes_text(r["h2d_bytes_per_token_served"]), f"{100 * r['knee_link_util_h2d']:.0f}%",
          f"{100 * r['knee_hbm_occupancy']:.0f}%"] for _, r in capacity.iterrows()))
    path = out / "real_model_served.md"
    write_atomic(path, lambda temp: temp.write_text("\n".join(lines) + "\n", encoding="utf-8"))
    return path
