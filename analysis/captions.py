"""Caption text of the report's figures and tables: counts, model shapes, what the simulator rows priced, the
overhead modes and links they charged, coinciding profiles. Pure functions of frames; `analysis.report` and the
figure builders (`analysis.report_figures`) use them, and so does `thoughtkv demo`'s summary.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from hwprofiles.overhead_modes import MODE_TEXT
from thoughtkv_base import UserError
from traces.stats import bytes_text


def plural(n: int, word: str, words: str | None = None) -> str:
    """`1 point`, `2 points`: counts in captions are often 1 on small inputs."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def shapes_text(model: str, run_table: pd.DataFrame, dtype: str = "bfloat16") -> str:
    """`micro_long (1.45M parameters, 3 layers, float32 KV 2.3 kB/token)`: a model id with the shapes a
    projection prices, from the runs (or traces.architectures for a --as-model target, in `dtype`); the id alone
    when neither knows it."""
    rows = run_table[run_table["model"] == model] if not run_table.empty and "model_n_params" in run_table else None
    if rows is not None and not rows.empty and pd.notna(rows["model_n_params"].iloc[0]):
        row = rows.iloc[0]
        params, layers, dtype, kv = (row["model_n_params"], row["model_n_layers"], row["model_dtype"],
                                     row["model_kv_bytes_per_token"])
    else:
        from traces.architectures import ARCHITECTURES

        arch = ARCHITECTURES.get(model)
        if arch is None:
            return f"`{model}`"
        params, layers, kv = arch.n_params(), arch.n_layers, arch.kv_bytes_per_token(dtype)
    return f"`{model}` ({_count_text(params)} parameters, {int(layers)} layers, {dtype} KV {bytes_text(kv)}/token)"


def _count_text(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}"


AS_MODEL_LABEL = r"\[as (?P<arch>[^\s\]]+) (?P<dtype>[^\s,\]]+)"  # simulator.project.Projection.label


def priced_text(rows: pd.DataFrame, run_table: pd.DataFrame) -> str:
    """Which model shapes these simulator rows priced, for every projected caption and table: the traced model's
    own (`priced at micro_long (1.45M parameters, ...)'s shapes`), or, under --as-model, the architecture named
    (`projected to qwen2-7b (7.62B parameters, ...) from the micro_long run(s)`)."""
    if rows.empty or "model" not in rows:
        return "model shapes not recorded"
    traced = dict(zip(run_table["run_dir"], run_table["model"])) if {"run_dir", "model"} <= set(run_table) else {}
    labels = rows["run_label"].astype(str) if "run_label" in rows else pd.Series("", index=rows.index)
    as_model = labels.str.extract(AS_MODEL_LABEL)
    parts = []
    projected = rows[as_model["arch"].notna()]
    for (arch, dtype), group in projected.groupby([as_model["arch"], as_model["dtype"]], sort=True):
        sources = sorted({traced[d] for d in group["run_dir"] if d in traced})
        origin = f" from the {', '.join(f'`{s}`' for s in sources)} run(s)" if sources else ""
        parts.append(f"projected to {shapes_text(arch, pd.DataFrame(), dtype)}{origin}")
    for model in sorted(rows.loc[as_model["arch"].isna(), "model"].dropna().unique()):
        parts.append(f"priced at {shapes_text(model, run_table)}'s shapes")
    return "; ".join(parts) or "model shapes not recorded"


def rows_of(sim: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """The simulator rows behind a derived frame (same runs and profiles), for naming what they priced."""
    return sim[sim["run_dir"].isin(frame["run_dir"]) & sim["profile"].isin(frame["profile"])]


COINCIDE_REL = 0.005  # profiles whose every ms/token agrees within this share draw one line


def coinciding_text(latency: pd.DataFrame) -> str:
    """' The lines of N profiles coincide at X ms/token: ...why.' when several profiles project the same ms/token at
    every (method, budget) (their lines and markers lie on top of each other), else ''. Why: under a host mode the
    step takes the longer of the host and the GPU, and a host-bound step (overheads most of it) costs the same on
    every GPU; otherwise their GPU times agree."""
    if latency.empty or latency["profile"].nunique() < 2:
        return ""
    grid = latency.pivot_table(index="profile", columns=["method", "hbm_budget"], values="ms_per_token")
    groups: list[list[str]] = []
    for profile, row in grid.iterrows():
        for group in groups:
            reference = grid.loc[group[0]]
            if np.allclose(row, reference, rtol=COINCIDE_REL, equal_nan=True):
                group.append(profile)
                break
        else:
            groups.append([profile])
    largest = max(groups, key=len)
    if len(largest) < 2:
        return ""
    rows = latency[latency["profile"].isin(largest)]
    ms = float(rows["ms_per_token"].median())
    overhead_share = float((rows["overhead_ms"] / rows["step_ms"]).median()) if "overhead_ms" in rows else 0.0
    modes = ", ".join(sorted(rows["overhead_mode"].dropna().astype(str).unique())) or "the same overhead mode"
    names = ", ".join(largest) if len(largest) <= 3 else f"{len(largest)} profiles"
    if overhead_share > 0.5:
        why = (f"under {modes} the step is host-bound ({overhead_share:.0%} of it is the host issuing ops at one cost "
               "per op, whatever the GPU), so the GPUs cannot be told apart at these shapes; `--overhead-mode "
               "kernel-only` or `--as-model` separates them")
    else:
        why = "their GPU times agree at these shapes (the same bound: compute, bandwidth or the link)"
    return f" The lines of {names} coincide at {ms:.3g} ms/token (one colour and marker each, drawn on top of each " \
           f"other): {why}."


def zero_text(points: pd.DataFrame) -> str:
    """Figure 4 leaves 0%-accuracy points off the frontier (frames.pareto_frame); the caption says how many."""
    zero = int((points["accuracy"] == 0).sum())
    return (f"; {plural(zero, 'point')} at 0% accuracy left off the frontier (a policy that answers nothing buys no "
            "trade-off, however fast)" if zero else "")


LINK_NAMES = {"pcie3": "PCIe", "pcie4": "PCIe", "pcie5": "PCIe", "pcie6": "PCIe", "nvlink-c2c": "NVLink-C2C",
              "cxl": "CXL", "host": "host-memory"}


def link_stall_label(profiles) -> str:
    """Name the stall after the link the profiles have (a GH200's is NVLink-C2C, not PCIe); mixed: all of them."""
    from hwprofiles import load_profile

    names = set()
    for name in set(profiles):
        try:
            names.add(LINK_NAMES.get(load_profile(name).link.kind, "host"))
        except UserError:  # a results file may name a profile not installed here
            names.add("host")
    return f"{names.pop()} link stall" if len(names) == 1 else f"host-link stall ({' / '.join(sorted(names))})"


def config_text(latency: pd.DataFrame) -> str:
    row = latency.iloc[0]
    return (f"overlap={row['overlap']}, async offload={row['async_offload']}, batch={row['batch']}; "
            f"{overheads_text(latency)}")


OVERHEAD_MODE_TEXT = MODE_TEXT  # hwprofiles/overhead_modes.py: the one description of each mode


def overheads_text(latency: pd.DataFrame) -> str:
    """Which framework-overhead mode each profile's projection charged (hwprofiles/overhead_modes.py)."""
    if "overhead_mode" not in latency or latency["overhead_mode"].isna().all():
        return "framework overheads: not recorded (results from before overhead modes)"
    by_mode = latency.drop_duplicates("profile").groupby("overhead_mode")["profile"].apply(sorted)
    parts = [f"{OVERHEAD_MODE_TEXT.get(mode, mode)} for {plural(len(names), 'profile')}"
             + (f" ({', '.join(names)})" if len(names) <= 2 else "") for mode, names in by_mode.items()]
    return "framework overheads: " + "; ".join(parts)


def trust_text(frame: pd.DataFrame) -> str:
    """Which host each side came from, and how many samples were traced under contention (kept, flagged)."""
    same = frame["same_host"] if "same_host" in frame else pd.Series(dtype=object)
    if same.eq(True).all() and len(same):
        host = "profile calibrated on the host that traced the runs"
    elif same.eq(False).any():
        host = "WARNING: the profile was calibrated on another host than the traces (compare like with like)"
    else:
        host = "hosts not recorded on one side"
    contended = int(frame["contended"].eq(True).sum()) if "contended" in frame else 0
    return f"{host}; {plural(contended, 'sample')} traced under CPU contention (kept, flagged in the table)"


def host_warnings(sim: pd.DataFrame) -> list[str]:
    """One line per measured profile that the results applied to runs traced on another host."""
    if sim.empty or "same_host" not in sim:
        return []
    other = sim[sim["same_host"].eq(False)]
    return [f"warning: measured profile {profile} was calibrated on another host than {plural(group['run_dir'].nunique(), 'run')} "
            "it was applied to; calibrate where you trace (`thoughtkv calibrate`) to compare like with like"
            for profile, group in other.groupby("profile")]
