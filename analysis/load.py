"""Read what the report is made of: trace run directories and simulator results files, checked on the way in.

`run_table` turns runs into one row each (policy, accuracy with Wilson CI, evicted share); `load_sim_results`
reads `thoughtkv simulate` / `thoughtkv sweep` results (Parquet or CSV, or a directory holding them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import stats
from simulator.columns import CORE_COLUMNS, KEY_COLUMNS, POLICY_COLUMNS
from thoughtkv_base import UserError
from traces import TraceFormatError, TraceRun, open_run
from traces.policy import PolicySpec
from traces.stats import completion_summary, run_traffic

SIM_REQUIRED = CORE_COLUMNS  # the simulator's results schema (simulator/columns.py)
SIM_SUFFIXES = (".parquet", ".csv")
RESULTS_STEMS = ("results", "summary")  # per-sample rows first; steps.parquet is per-step, not a results table
RUN_SIM_DIR = "sim"  # `thoughtkv simulate RUN` writes to RUN/sim by default


class AnalysisInputError(UserError):
    """A path given to `thoughtkv plot` that is neither a trace run nor a simulator results file."""


@dataclass
class Inputs:
    runs: list[TraceRun] = field(default_factory=list)
    sim_files: list[Path] = field(default_factory=list)
    ignored: list[Path] = field(default_factory=list)  # e.g. a README that a shell glob picked up


def classify_paths(run_paths: list[str | Path], sim_paths: list[str | Path]) -> Inputs:
    """Sort the user's paths into trace runs and results files; unreadable or unknown ones fail here, first.

    A directory with run.json is a run (its `sim/` results, where `thoughtkv simulate` writes by default,
    come along); a directory of runs (e.g. a demo's runs/) gives each of them; a .parquet/.csv file or a
    directory `thoughtkv simulate/sweep --out` wrote is a results table. Plain files of other types among
    the RUN_DIRs (a README picked up by `traces/samples/*`) are listed as ignored.
    """
    inputs = Inputs()
    for raw in run_paths:
        _add_run_path(Path(raw), inputs)
    for raw in sim_paths:
        path = Path(raw)
        if (path / "run.json").is_file():  # `--sim a.parquet RUN` lets argparse hand the run to --sim
            _add_run_path(path, inputs)
            continue
        found = _results_files(path)
        if not found:
            raise AnalysisInputError(f"--sim {path}: no results file (.parquet or .csv) there; pass what `thoughtkv simulate --out` wrote")
        inputs.sim_files.extend(found)
    check_distinct_runs(inputs.runs)
    return inputs


def check_distinct_runs(runs: list[TraceRun]) -> None:
    """Refuse two runs that trace the same samples of one task with the same model and policy (a run given twice,
    a copy with an edited version): the report pools runs of one method and budget (e.g. two seeds' shards), so
    their accuracy would count each of those samples twice. One line names both and the shared samples."""
    seen: dict[tuple, list[TraceRun]] = {}
    for run in runs:
        manifest = run.manifest
        key = (manifest["model"]["id"], manifest["task"]["name"],
               PolicySpec.from_manifest(manifest["policy"]).identity())
        for other in seen.get(key, []):
            shared = sorted(set(other.sample_ids()) & set(run.sample_ids()))
            if run.path.resolve() == other.path.resolve():
                raise AnalysisInputError(f"{run.path} is given twice: its accuracy would count twice; pass it once")
            if shared:
                raise AnalysisInputError(
                    f"{run.path} and {other.path} trace the same {len(shared)} sample(s) (e.g. {shared[0]!r}) with "
                    "the same model and policy: pooled, each would count twice in the accuracy; pass one of them")
        seen.setdefault(key, []).append(run)


def _add_run_path(path: Path, inputs: Inputs) -> None:
    if not path.exists():
        raise AnalysisInputError(f"{path}: no such file or directory; pass trace run directories (with run.json)")
    if path.is_dir() and (path / "run.json").is_file():
        inputs.runs.append(_open(path))
        inputs.sim_files.extend(_results_files(path / RUN_SIM_DIR))  # simulated in place: take it along
        return
    if path.is_dir():
        children = sorted(p for p in path.iterdir() if p.is_dir() and (p / "run.json").is_file())
        if children:
            for child in children:
                _add_run_path(child, inputs)
            return
        results = _results_files(path)
        if results:
            inputs.sim_files.extend(results)
            return
        raise AnalysisInputError(f"{path}: a directory without run.json, trace runs or results files; pass a trace run directory")
    if path.suffix in SIM_SUFFIXES:
        inputs.sim_files.append(path)
        return
    inputs.ignored.append(path)


def _open(path: Path) -> TraceRun:
    try:
        return open_run(path)
    except TraceFormatError:
        raise
    except OSError as exc:
        raise AnalysisInputError(f"{path}: cannot read the run ({exc.strerror}); check permissions") from None


def _results_files(path: Path) -> list[Path]:
    """The results tables at `path`: the file itself; in a directory `thoughtkv simulate/sweep --out` wrote, its
    per-sample results.parquet (else results.csv; summary.* only when there is no per-sample table); in any
    other directory, every Parquet/CSV file with the results columns."""
    if path.is_file():
        return [path] if path.suffix in SIM_SUFFIXES else []
    if not path.is_dir():
        return []
    for stem in RESULTS_STEMS:
        for suffix in SIM_SUFFIXES:
            if (path / f"{stem}{suffix}").is_file():
                return [path / f"{stem}{suffix}"]
    # Otherwise every results table there (e.g. the demo's one file per run), Parquet over a same-named CSV.
    parquet = sorted(path.glob("*.parquet"))
    stems = {p.stem for p in parquet}
    candidates = parquet + sorted(p for p in path.glob("*.csv") if p.stem not in stems)
    return [p for p in candidates if _has_result_columns(p)]


def _has_result_columns(path: Path) -> bool:
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            names = set(pq.read_schema(path).names)
        else:
            names = set(pd.read_csv(path, nrows=0).columns)
    except Exception:  # noqa: BLE001 - an unreadable file is simply not a results table
        return False
    return set(SIM_REQUIRED) <= names


def load_sim_results(files: list[Path]) -> pd.DataFrame:
    """Concatenate results files; run_dir made absolute (relative to the file's directory if not found as given)."""
    frames = []
    for file in dict.fromkeys(Path(f).resolve() for f in files):  # the same file named twice counts once
        try:
            frame = pd.read_parquet(file) if file.suffix == ".parquet" else pd.read_csv(file)
        except Exception as exc:  # noqa: BLE001 - pandas/pyarrow raise many types for a bad file
            raise AnalysisInputError(f"{file}: unreadable results file ({str(exc).splitlines()[0][:160]})") from None
        missing = [c for c in SIM_REQUIRED if c not in frame.columns]
        if missing:
            raise AnalysisInputError(
                f"{file}: not a simulator results table (missing {', '.join(missing)}); pass `thoughtkv simulate --out` output"
            )
        frame["run_dir"] = [_absolute_run_dir(r, file.parent) for r in frame["run_dir"]]
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=list(SIM_REQUIRED))
    sim = pd.concat(frames, ignore_index=True)
    # The same result read twice (e.g. a run's sim/ and a copy of its results file) counts once.
    dedupe_keys = [c for c in dict.fromkeys([*KEY_COLUMNS, *POLICY_COLUMNS]) if c in sim]
    return sim.drop_duplicates(subset=dedupe_keys, keep="last").reset_index(drop=True)


def align_run_dirs(sim: pd.DataFrame, run_keys: list[str]) -> pd.DataFrame:
    """Point results at the given runs when their recorded run_dir differs only in where the runs now live.

    Results store the path the simulator was given (relative to its working directory, or a directory that
    was moved since); a recorded path whose trailing components (at least the name) match exactly one given
    run is taken to mean that run.
    """
    if sim.empty or not run_keys:
        return sim
    known = set(run_keys)
    mapping = {}
    for recorded in sim["run_dir"].unique():
        if recorded in known:
            continue
        parts = Path(recorded).parts
        for depth in range(len(parts), 0, -1):
            matches = [k for k in run_keys if Path(k).parts[-depth:] == parts[-depth:]]
            if len(matches) == 1:
                mapping[recorded] = matches[0]
                break
            if len(matches) > 1:
                break  # ambiguous at this depth: shorter suffixes only match more runs
    return sim.assign(run_dir=sim["run_dir"].replace(mapping)) if mapping else sim


def _absolute_run_dir(run_dir, base: Path) -> str:
    path = Path(str(run_dir))
    if not path.is_absolute() and not path.exists() and (base / path).exists():
        path = base / path
    return str(path.resolve())


# -- runs -> one row each ------------------------------------------------------------------------------------


def run_key(run: TraceRun) -> str:
    return str(run.path.resolve())


def run_row(run: TraceRun) -> dict:
    """One run as a row: its policy knobs, accuracy with 95% Wilson CI, and the measured evicted share."""
    manifest = run.manifest
    policy, model = manifest["policy"], manifest["model"]
    spec = PolicySpec.from_manifest(policy)
    samples = run.samples()
    scored = samples["correct"].dropna()
    n_correct = int(scored.astype(bool).sum())
    ci_low, ci_high = stats.wilson_interval(n_correct, len(scored))
    return {
        "run_dir": run_key(run),
        "run_label": run.path.name,
        "kind": manifest["kind"],
        "model": model["id"],
        # The shapes a projection of this run prices (report captions name them: a 1.45M-parameter model is not a 7B)
        "model_n_params": model.get("n_params"),
        "model_n_layers": model.get("n_layers"),
        "model_dtype": model.get("dtype"),
        "model_kv_bytes_per_token": model.get("kv_bytes_per_token"),
        "task": manifest["task"]["name"],
        "policy": policy["name"],
        "policy_key": spec.identity(),  # what projections of this policy join on
        "hbm_budget": float(policy["hbm_budget"]),
        "evict_ratio": float(policy["evict_ratio"]),
        "block_size": int(policy["block_size"]),
        "scorer": policy["scorer"],
        "recall_k": policy["recall_k"],
        "recall_budget": spec.recall_budget,  # None: recall_k blocks; else a share of the context (or tokens)
        "recall_rule": spec.recall_rule,  # the rule's name (run.json may hold its v1 description)
        "device": manifest["hardware"].get("device"),
        "n_samples": len(samples),
        "n_scored": len(scored),
        "n_correct": n_correct,
        "accuracy": n_correct / len(scored) if len(scored) else np.nan,
        "ci_low": ci_low,
        "ci_high": ci_high,
        "evicted_frac": evicted_fraction(run),
        **run_traffic(run),  # what the run moved over the link (traces.stats.traffic_summary)
        **completion_summary(samples),  # samples stopped by the token limit, accuracy of finished ones
    }


def run_table(runs: list[TraceRun]) -> pd.DataFrame:
    return pd.DataFrame([run_row(run) for run in runs])


def evicted_fraction(run: TraceRun) -> float:
    """Share of KV entries evicted at the last step (all layers), mean over samples; 0 for an empty run."""
    steps = run.steps(columns=["sample_id", "step", "logical_len", "evicted_tokens"])
    if steps.empty:
        return 0.0
    last = steps[steps["step"] == steps.groupby("sample_id")["step"].transform("max")]
    per_sample = last.groupby("sample_id")[["evicted_tokens", "logical_len"]].sum()
    return float((per_sample["evicted_tokens"] / per_sample["logical_len"]).mean())


def measured_seconds(run: TraceRun) -> pd.DataFrame:
    """Per sample: measured decode time (sum of measured_step_us over steps, in s); empty when not timed."""
    if run.manifest["kind"] == "synthetic":
        return pd.DataFrame(columns=["run_dir", "sample_id", "measured_s"])
    steps = run.steps(columns=["sample_id", "step", "layer", "measured_step_us"])
    per_step = steps.dropna(subset=["measured_step_us"]).drop_duplicates(["sample_id", "step"])
    if per_step.empty:
        return pd.DataFrame(columns=["run_dir", "sample_id", "measured_s"])
    total = per_step.groupby("sample_id", as_index=False)["measured_step_us"].sum()
    return pd.DataFrame({"run_dir": run_key(run), "sample_id": total["sample_id"], "measured_s": total["measured_step_us"] / 1e6,
                         "contended": traced_under_contention(run.manifest)})


def traced_under_contention(manifest: dict) -> bool | None:
    """Whether other work competed for the CPUs while the run was traced: a session (run.json `sessions`) began
    or ended with a 1-minute load average above the CPUs it could use (None when no session recorded it).
    Such samples' timings are kept and flagged, not dropped: the flag says how far to trust them."""
    verdicts = []
    for session in manifest.get("sessions") or []:
        cpus = session.get("cpus")
        loads = [session.get(k) for k in ("load_avg_1m_start", "load_avg_1m_end") if session.get(k) is not None]
        if cpus and loads:
            verdicts.append(max(loads) > cpus)
    return any(verdicts) if verdicts else None


def measuring_profiles(profile_names: list[str], device: str | None) -> list[str]:
    """Of the simulated profiles, those measured by `thoughtkv calibrate` (on `device`, when names match)."""
    from hwprofiles import load_profile

    measured = []
    for name in profile_names:
        try:
            profile = load_profile(name)
        except UserError:
            continue  # a results file may name a profile that is not installed here
        if profile.provenance.get("kind") == "measured":
            measured.append(profile)
    same_device = [p for p in measured if device and p.gpu.name == device]
    return [p.name for p in (same_device or measured)]


def importance_source(runs: list[TraceRun]) -> TraceRun | None:
    """The run whose tokens show the importance distribution least distorted by the policy: full cache, else the
    largest budget."""
    if not runs:
        return None
    return max(runs, key=lambda r: (len(r.sample_ids()) > 0, r.manifest["policy"]["name"] == "full",
                                    float(r.manifest["policy"]["hbm_budget"])))
