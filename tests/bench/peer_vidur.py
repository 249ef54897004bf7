"""serve-sim beside Vidur (microsoft/vidur 0.0.26, the LLM serving simulator users pick), one workload, one run.

Llama-2-7B bf16 on one H100 SXM (serve-sim: h100-sxm, cuda-graphs; Vidur: h100 / h100_dgx, tensor and pipeline
parallel 1), fixed 512-token prompts and 256 output tokens, the same Poisson arrivals (one CSV, in each
simulator's format) at three rates from light to near saturation, vLLM V1-like scheduling on both (serve-sim's
paged admission with recompute preemption and chunked prefill; Vidur's `sarathi` scheduler, the same order:
decodes first, then prefill chunks under the same token budget), batch cap 128. Writes docs/validation/peers.md:
TTFT and TBT mean / p99, throughput, batch-1 ms/token, each with the ratio to Vidur, and both simulators' wall
times, all from this one run.

Installs nothing. The peer lives in its own environment, built once:

    bash tests/bench/peer_vidur_setup.sh     # .venv-vidur (vidur==0.0.26 from PyPI) + its data under build/peer_vidur
    .venv/bin/python tests/bench/peer_vidur.py [--requests 300] [--out docs/validation/peers.md]

Vidur as shipped downloads its profiling tables from a model hub at run time (`snapshot_download` in
vidur/execution_time_predictor/sklearn_execution_time_predictor.py) and has none for Llama-2-7B there. `--setup`
makes them local (Vidur then runs with HF_HUB_OFFLINE=1): the linear layers and small ops are Vidur's own measured
H100 table (tests/bench/peer_data/, from the microsoft/vidur repository); the attention table is a Git LFS object
absent from that repository's snapshot, so it is synthesized from rates measured in the same table
(`synthetic_attention`, documented in peers.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
VIDUR_PYTHON = ROOT / ".venv-vidur" / "bin" / "python"
WORK = ROOT / "build" / "peer_vidur"
CACHE = WORK / "cache"  # Vidur's cache_dir: its local "hub" datasets and its trained predictors
MLP_TABLE = ROOT / "tests" / "bench" / "peer_data" / "vidur-h100-llama2-7b-mlp-tp1.csv.xz"
COMPUTE_DATASET, NETWORK_DATASET = "thoughtkv-local/vidur-llama-2-7b-h100", "thoughtkv-local/vidur-h100-dgx"
SETUP = "bash tests/bench/peer_vidur_setup.sh"

MODEL, VIDUR_MODEL, PROFILE = "llama2-7b", "meta-llama/Llama-2-7b-hf", "h100-sxm"
PROMPT, OUTPUT, BATCH_CAP = 512, 256, 128
BUDGET = 4096  # tokens per iteration on both (Vidur's measured tables end at 4,096 tokens; vLLM's H100 default is 8,192)
RATES = (2.0, 8.0, 16.0)  # requests/s: light, loaded, near saturation (a 256-token request lives ~5-10 s here)
SEED = 0
# Vidur's random forest, one grid point (its default grid of 27, 10-fold, takes hours on two cores)
FOREST = dict(num_estimators=250, max_depth=16, min_samples_split=2)


# ---------------------------------------------------------------- Vidur's data, made local once ---------------


def layer_weight_bytes(h: int = 4096, inner: int = 11008, b: int = 2) -> float:
    """Llama-2-7B's four linear layers (qkv, o, gate+up, down) per layer: what a one-token GEMM reads."""
    return (h * 3 * h + h * h + 3 * h * inner) * b


def measured_rates(mlp: pd.DataFrame) -> dict:
    """From Vidur's own H100 table: the HBM rate its GEMMs reach at one token (weights / time), the FLOP rate they
    reach at the most tokens, and the shortest kernel there (a norm at one token)."""
    mlp = mlp.sort_values("num_tokens")
    gemm = mlp[[f"time_stats.{op}.median" for op in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj",
                                                     "mlp_down_proj")]].sum(axis=1).to_numpy() * 1e-3
    tokens = mlp["num_tokens"].to_numpy()
    one, most = int(np.argmin(tokens)), int(np.argmax(tokens))
    params = layer_weight_bytes() / 2
    return {"hbm_bytes_per_s": float(layer_weight_bytes() / gemm[one]),
            "flops_per_s": float(2 * params * tokens[most] / gemm[most]),
            "floor_s": float(mlp["time_stats.input_layernorm.median"].iloc[one]) * 1e-3}


def synthetic_attention(rates: dict, n_heads: int = 32, n_kv_heads: int = 32, head_dim: int = 128,
                        b: int = 2) -> pd.DataFrame:
    """Vidur's attention table, synthesized (its measured one is a Git LFS object not in the repository): per
    layer, decode attention reads the batch's KV at the measured HBM rate, a prefill chunk's attention is its
    causal pairs' FLOPs at the measured FLOP rate (or its KV at the HBM rate if longer), the KV-cache save writes
    the new tokens' KV at the HBM rate; none shorter than the table's shortest kernel. Times in ms, as Vidur's."""
    kv_token = 2 * n_kv_heads * head_dim * b
    bw, flops, floor = rates["hbm_bytes_per_s"], rates["flops_per_s"], rates["floor_s"]
    rows = []
    for batch in range(1, BATCH_CAP + 1):
        for kv in range(256, 4097, 256):
            rows.append(dict(prefill_chunk_size=0, kv_cache_size=kv, batch_size=batch, is_prefill=False,
                             decode=max(floor, batch * (kv + 1) * kv_token / bw), prefill=0.0,
                             save=max(floor, batch * kv_token / bw)))
    for chunk in range(32, 4097, 32):
        for kv in range(0, 4097 - chunk, 256):
            pairs = chunk * kv + chunk * (chunk + 1) / 2
            rows.append(dict(prefill_chunk_size=chunk, kv_cache_size=kv, batch_size=1, is_prefill=True, decode=0.0,
                             prefill=max(floor, 4 * n_heads * head_dim * pairs / flops, (kv + 2 * chunk) * kv_token / bw),
                             save=max(floor, chunk * kv_token / bw)))
    table = pd.DataFrame(rows)
    out = table[["prefill_chunk_size", "kv_cache_size", "batch_size", "is_prefill"]].assign(
        n_embd=n_heads * head_dim, n_q_head=n_heads, n_kv_head=n_kv_heads, block_size=16,
        num_tensor_parallel_workers=1)
    for op, column in (("attn_prefill", "prefill"), ("attn_decode", "decode"), ("attn_kv_cache_save", "save")):
        out[f"time_stats.{op}.median"] = 1e3 * table[column]
    return out


def local_dataset(repo_id: str, files: dict[str, object]) -> Path:
    """A dataset in the layout huggingface_hub's snapshot_download reads offline (refs/main -> snapshots/REV)."""
    org, name = repo_id.split("/")
    kind = "compute" if "llama" in name else "network"
    base = CACHE / "profiling_data" / kind / f"datasets--{org}--{name}"
    snapshot = base / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text("local")
    for file_name, content in files.items():
        if isinstance(content, pd.DataFrame):
            content.to_csv(snapshot / file_name, index=False, compression="xz")
        else:
            (snapshot / file_name).write_text(json.dumps(content))
    return snapshot


def setup() -> None:
    """Vidur's profiling data made local (copied and synthesized), then its predictors trained once (cached)."""
    if not VIDUR_PYTHON.is_file():
        sys.exit(f"no peer environment at {VIDUR_PYTHON.parent.parent}; run: {SETUP}")
    mlp = pd.read_csv(MLP_TABLE)
    rates = measured_rates(mlp)
    local_dataset(COMPUTE_DATASET, {"config.json": {"model": VIDUR_MODEL, "device_sku": "h100"}, "mlp.csv.xz": mlp,
                                    "attention.csv.xz": synthetic_attention(rates)})
    local_dataset(NETWORK_DATASET, {"config.json": {"sku": "h100_dgx"}})  # no collectives at tensor parallel 1
    (WORK / "rates.json").write_text(json.dumps(rates, indent=1))
    arrivals = poisson(1.0, 2)
    started = time.perf_counter()
    run_vidur(arrivals, WORK / "warmup")  # trains and caches the predictors
    (WORK / "forest_s.txt").write_text(f"{time.perf_counter() - started:.1f}")
    print(f"peer_vidur: data under {CACHE}, predictors trained in {time.perf_counter() - started:.0f} s; measured "
          f"rates {rates}")


def forest_seconds() -> float | None:
    path = WORK / "forest_s.txt"
    return float(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------- the workload --------------------------------


def poisson(rate_per_s: float, n_requests: int, seed: int = SEED) -> np.ndarray:
    return np.cumsum(np.random.default_rng([seed, int(rate_per_s * 1000)]).exponential(1.0 / rate_per_s, n_requests))


def write_arrivals(times: np.ndarray, folder: Path) -> tuple[Path, Path]:
    """The same arrivals as serve-sim's CSV (arrival_s, prompt_tokens, output_tokens) and Vidur's trace
    (Date, Time, PromptTokenCount, CompletionTokenCount; Vidur's scale factors set to 1)."""
    folder.mkdir(parents=True, exist_ok=True)
    ours, theirs = folder / "arrivals.csv", folder / "vidur_trace.csv"
    pd.DataFrame({"arrival_s": times, "prompt_tokens": PROMPT, "output_tokens": OUTPUT}).to_csv(ours, index=False)
    pd.DataFrame({"Date": "2000-01-01", "Time": times, "PromptTokenCount": PROMPT,
                  "CompletionTokenCount": OUTPUT}).to_csv(theirs, index=False)
    return ours, theirs


# ---------------------------------------------------------------- the two simulators ----------------------------


def vidur_args(trace: Path, out: Path) -> list[str]:
    predictor = "random_forrest_execution_time_predictor_config"
    args = {
        "replica_config_device": "h100", "replica_config_network_device": "h100_dgx",
        "replica_config_model_name": VIDUR_MODEL, "replica_config_tensor_parallel_size": 1,
        "replica_config_num_pipeline_stages": 1, "replica_config_gpu_memory_utilization": 0.9,  # vLLM's default
        "cluster_config_num_replicas": 1, "replica_scheduler_config_type": "sarathi",
        "sarathi_scheduler_config_chunk_size": BUDGET, "sarathi_scheduler_config_batch_size_cap": BATCH_CAP,
        "request_generator_config_type": "trace_replay", "trace_request_generator_config_trace_file": trace,
        "trace_request_generator_config_date": "2000-01-01", "trace_request_generator_config_max_tokens": 4096,
        **{f"trace_request_generator_config_{k}_scale_factor": 1 for k in ("prefill", "decode", "time")},
        "execution_time_predictor_config_type": "random_forrest",
        f"{predictor}_model_profiling_dataset": COMPUTE_DATASET,
        f"{predictor}_network_profiling_dataset": NETWORK_DATASET, f"{predictor}_cache_dir": CACHE,
        f"{predictor}_prediction_max_tokens_per_request": 4096, f"{predictor}_prediction_max_prefill_chunk_size": 4096,
        f"{predictor}_prediction_max_batch_size": BATCH_CAP, **{f"{predictor}_{k}": v for k, v in FOREST.items()},
        "metrics_config_output_dir": out, "metrics_config_enable_chrome_trace": False, "metrics_config_store_plots": False,
        "metrics_config_store_token_completion_metrics": True,  # the per-token decode times (TBT), as a CDF
        "metrics_config_wandb_project": "", "metrics_config_wandb_group": "",
    }
    argv = []
    for key, value in args.items():
        argv += [f"--{key}" if value is True else f"--no-{key}"] if isinstance(value, bool) else [f"--{key}", str(value)]
    return argv


def run_vidur(times: np.ndarray, folder: Path) -> tuple[dict, float]:
    _, trace = write_arrivals(times, folder)
    out = folder / "vidur"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run([str(VIDUR_PYTHON), "-m", "vidur.main", *vidur_args(trace, out)], cwd=WORK, env=env,
                          capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"vidur failed ({done.returncode}): {done.stderr.strip().splitlines()[-1] if done.stderr else ''}")
    return vidur_metrics(out, times), wall_s


def vidur_metrics(out: Path, arrivals_s: np.ndarray) -> dict:
    """TTFT, TBT and throughput from Vidur's request metrics (one row per request, in trace order) and its
    per-token decode times (a quantile sketch at 1% steps: TBT p99 is its 99% point)."""
    run_dir = max(out.iterdir(), key=lambda p: p.stat().st_mtime)  # Vidur writes under OUT/<timestamp>/
    requests = pd.read_csv(run_dir / "request_metrics.csv").sort_values("Request Id")
    cdf = pd.read_csv(run_dir / "plots" / "decode_token_execution_plus_preemption_time.csv")
    tbt_p99_s = float(np.interp(0.99, cdf["cdf"], cdf["decode_token_execution_plus_preemption_time"]))
    e2e = requests["request_e2e_time"].to_numpy(dtype=float)
    ttft = requests["prefill_e2e_time"].to_numpy(dtype=float)
    tokens = requests["request_num_decode_tokens"].to_numpy(dtype=float)
    return {"ttft_mean_s": float(ttft.mean()), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tbt_mean_s": float(np.sum(e2e - ttft) / np.sum(tokens - 1)), "tbt_p99_s": tbt_p99_s,
            "throughput_tokens_per_s": float(tokens.sum() / np.max(arrivals_s + e2e))}


def run_serve_sim(times: np.ndarray, folder: Path, run: Path) -> tuple[dict, float]:
    from simulator.options import Projection, ServingConfig, SimOptions
    from simulator.serving import simulate_serving

    ours, _ = write_arrivals(times, folder)
    config = ServingConfig(arrivals_csv=str(ours), max_batch=BATCH_CAP, max_batched_tokens=BUDGET,
                           admission="paged", preempt="recompute", options=SimOptions(overhead_mode="cuda-graphs"),
                           projection=Projection())
    started = time.perf_counter()
    result = simulate_serving(run, PROFILE, config)
    wall_s = time.perf_counter() - started
    s, requests = result.summary, result.requests
    ttft = requests["ttft_s"].to_numpy()
    tokens = requests["tokens"].to_numpy(dtype=float)
    span = (requests["finish_s"] - requests["first_token_s"]).to_numpy()
    return {"ttft_mean_s": float(ttft.mean()), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tbt_mean_s": float(span.sum() / np.sum(tokens - 1)), "tbt_p99_s": float(s["tbt_p99_s"]),
            "throughput_tokens_per_s": float(s["tokens"] / s["end_s"]), "preemptions": s["n_preemptions"],
            "gpu_util": s["gpu_util"], "prefill_share": len(requests) / max(1, len(result.timeline))}, wall_s


# ---------------------------------------------------------------- the document --------------------------------



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per rate (default 300)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "validation" / "peers.md")
    parser.add_argument("--setup", action="store_true", help="make Vidur's data local and train it once (the "
                                                             "setup script runs this)")
    args = parser.parse_args()
    if args.setup:
        return setup()
    if not VIDUR_PYTHON.is_file() or not (CACHE / "profiling_data").is_dir():
        print(f"peer_vidur: Vidur's environment or data is missing; build them once: {SETUP}", file=sys.stderr)
        sys.exit(2)
    from simulator.synth import synth_run

    run = synth_run(WORK / "trace-llama2-7b", model=MODEL, prompt_tokens=PROMPT, decode_steps=OUTPUT - 1,
                    policy="full", samples=1, access=False)
    rows = []
    for name, rate, n in [("batch 1", None, 1)] + [(f"{r:g} req/s", r, args.requests) for r in RATES]:
        times = np.array([0.0]) if rate is None else poisson(rate, n)
        folder = WORK / name.replace(" ", "-").replace("/", "")
        ours, ours_s = run_serve_sim(times, folder, run)
        theirs, theirs_s = run_vidur(times, folder)
        rows.append((name, n, ours, ours_s, theirs, theirs_s))
        print(f"{name}: serve-sim {ours} ({ours_s:.1f} s), vidur {theirs} ({theirs_s:.1f} s)", flush=True)
    args.out.write_text(document(rows, forest_seconds()))
    print(f"wrote {args.out}")


METRICS = (("ttft_mean_s", "TTFT mean (ms)"), ("ttft_p99_s", "TTFT p99 (ms)"), ("tbt_mean_s", "TBT mean (ms)"),
           ("tbt_p99_s", "TBT p99 (ms)"), ("throughput_tokens_per_s", "throughput (tokens/s)"))
TOLERANCE = 0.15

def gemm_ms(tokens: int) -> float:
    """Vidur's measured GEMMs of one layer (qkv, o, gate+up, down) at its table's row nearest `tokens`, ms."""
    mlp = pd.read_csv(MLP_TABLE)
    row = mlp.iloc[int(np.argmin(np.abs(mlp["num_tokens"] - tokens)))]
    return float(sum(row[f"time_stats.{op}.median"] for op in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj",
                                                                "mlp_down_proj")))


def explained(kind: str, ratios: dict[str, list[float]], shares: dict[str, float]) -> str:
    """Why a ratio of this kind falls outside +-15%: the assumption behind it, and which side is nearer to
    measured runs."""
    from hwprofiles import load_profile
    from hwprofiles.overhead_modes import apply_mode
    from simulator.project import target_shape

    shape, profile = target_shape(MODEL), apply_mode(load_profile(PROFILE), "cuda-graphs")

    def within(key: str) -> str:  # the largest deviation of a metric's ratios, as a percentage
        return f"{100 * max(abs(r - 1) for r in ratios.get(key, [1.0])):.0f}%"

    ours_ms = 1e3 * 2 * shape.layer_params * PROMPT / profile.gpu.matmul_flops_per_s
    step = (f"Vidur's measured H100 GEMMs step up past 512 tokens (qkv + o + gate/up + down: {gemm_ms(496):.3f} ms "
            f"per layer at 496 tokens, {gemm_ms(560):.3f} at 560: the tile sizes of its measured kernels), and an "
            "iteration that runs a 512-token prompt with the decodes carries 513 or more tokens (rounded up to 8 by "
            "Vidur); serve-sim's roofline grows smoothly (its GEMMs at 512 tokens, 0.70 of the datasheet FLOP rate: "
            f"{ours_ms:.3f} ms per layer)")
    return {
        "ttft": f"under load a prompt's prefill shares its iteration with the decodes: {step}. Alone (batch 1, exactly "
                f"512 tokens) the two agree within {within('batch-1 TTFT')}. Vidur's side is the measured one here; "
                "docs/validation/published_gpu.md has no prefill row to check either against.",
        "tbt": f"an iteration that also prefills a prompt costs more on Vidur's side: {step}. Such iterations set "
               "the p99 at every rate, and at the highest rate the mean too (a prompt joins "
               + ", ".join(f"{100 * v:.0f}% of the iterations at {k}" for k, v in shares.items()) + " in serve-sim). "
               f"Decode-only iterations agree within {within('batch-1 ms/token')} (batch 1), and serve-sim's captured "
               "batch-1 decode is within 4% of the published gpt-fast captured A100 runs (+1.8%, +3.8%) "
               "(docs/validation/published_gpu.md); for the iterations with a prefill Vidur's side is the measured "
               "one, and no published run here checks either.",
        "throughput": "throughput is the iterations' rate at the batch the arrivals sustain: the TBT terms above, and "
                      "what each side's KV capacity lets run at once (serve-sim: all of HBM but the weights; Vidur: 90% "
                      "of it less its margin).",
    }[kind]


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f}"


def value_text(key: str, value: float) -> str:
    return f"{value:,.0f}" if key == "throughput_tokens_per_s" else ms(value)


def document(rows, forest_s: float | None = None) -> str:
    import datetime

    from thoughtkv_base import __version__

    rates = json.loads((WORK / "rates.json").read_text())
    table = ["| load | metric | serve-sim | Vidur | serve-sim / Vidur |", "|---|---|---|---|---|"]
    outside = {}
    ratios: dict[str, list[float]] = {}
    for name, n, ours, _, theirs, _ in rows:
        keys = ("ttft_mean_s", "tbt_mean_s") if n == 1 else tuple(k for k, _ in METRICS)
        for key in keys:
            label = dict(METRICS)[key] if n > 1 else {"ttft_mean_s": "TTFT (ms)", "tbt_mean_s": "ms/token"}[key]
            r = ours[key] / theirs[key]
            ratios.setdefault("batch-1 ms/token" if n == 1 and key == "tbt_mean_s" else
                              "batch-1 TTFT" if n == 1 else label.split(" (")[0], []).append(r)
            flag = "" if abs(r - 1) <= TOLERANCE else " **(outside ±15%)**"
            if flag:
                outside.setdefault(key.split("_")[0], []).append(f"{name} {label}")
            table.append(f"| {name} | {label} | {value_text(key, ours[key])} | {value_text(key, theirs[key])} | "
                         f"{r:.2f}{flag} |")
    walls = ["| load | requests | serve-sim wall s | Vidur wall s | Vidur / serve-sim |", "|---|---|---|---|---|"]
    for name, n, _, ours_s, _, theirs_s in rows:
        walls.append(f"| {name} | {n} | {ours_s:.2f} | {theirs_s:.1f} | {theirs_s / ours_s:.1f}x |")
    headline = "; ".join(f"{k} {min(v):.2f}" + (f"-{max(v):.2f}" if len(v) > 1 else "") for k, v in ratios.items())
    loaded = [r for r in rows if r[1] > 1]
    shares = {r[0]: r[2]["prefill_share"] for r in loaded}
    lines = [
        "# serve-sim beside a peer simulator (Vidur)", "",
        f"Generated by `tests/bench/peer_vidur.py` on {datetime.date.today().isoformat()} (thoughtkv {__version__}, "
        "vidur 0.0.26 from PyPI in its own `.venv-vidur`, built by `bash tests/bench/peer_vidur_setup.sh`); every "
        "number below is from that one run, on this 2-core machine shared with other jobs (wall times: read the "
        "ratio).", "",
        f"Workload: Llama-2-7B bf16 on one H100 SXM, {PROMPT}-token prompts and {OUTPUT} output tokens, Poisson "
        f"arrivals ({', '.join(f'{r:g}' for r in RATES)} req/s, {loaded[0][1] if loaded else 0} requests each, seed "
        f"{SEED}) written once as one arrival list in each simulator's CSV format, batch cap {BATCH_CAP}, "
        f"{BUDGET} tokens per iteration; and one request alone (batch 1). serve-sim: `h100-sxm`, "
        "`--overhead-mode cuda-graphs`, `--admission paged --preempt recompute`, a synthetic full-cache trace "
        "of `llama2-7b`. Vidur: `--replica_config_device h100`, tensor / pipeline parallel 1, the `sarathi` "
        "scheduler (chunked prefill: decodes first, then prefill chunks to the token budget, FCFS, "
        "recompute-on-restart), its random-forest execution-time predictor.", "",
        f"Headline ratios (serve-sim / Vidur): {headline}.", "",
        *table, "",
        "TBT: serve-sim's every interval between a request's tokens; Vidur's per-token decode time (execution + "
        "preemption, its `decode_token_execution_plus_preemption_time`, a quantile sketch: p99 read at its 99% "
        "point). The means are first-to-last-token time over tokens - 1 on both; throughput is generated tokens "
        "over the time of the last one. serve-sim preempted "
        f"{', '.join(str(int(r[2]['preemptions'])) for r in loaded)} times at the three rates.", "",
        "## Wall time", "", *walls, "",
        "Vidur's wall time includes its start (loading its cached predictors: ~10 s); its predictors were trained "
        "once by the setup script" + (f" ({forest_s:.0f} s)" if forest_s else "") + ".", "",
        "## What differs", "",
        "| | serve-sim | Vidur |", "|---|---|---|",
        "| GEMMs | roofline: max(2 P T / F, W / B), F = 989 TFLOP/s x 0.70, B = 3.35 TB/s x 0.85 x 0.822 "
        "(cuda-graphs' decode fraction) | measured on an H100 (its table: "
        f"{rates['hbm_bytes_per_s'] / 1e12:.2f} TB/s at one token, {rates['flops_per_s'] / 1e12:.0f} TFLOP/s at "
        "4,096) |",
        "| attention | roofline per kernel (decodes', prefill chunks') at the same F and B | **synthesized** (see "
        "below) from the rates its own table measures |",
        "| norms, rotary, activation, add | 7h + 2(H + H_kv)d + 3I elements per token at 0.71 B (calibrated on "
        "Vidur's table: its slope, not its ~19 us per-layer floor, which the decode calibration holds) | measured, "
        "floor included |",
        "| embedding, LM head | in the layers (embedding) and one head per step | none |",
        "| host | cuda-graphs: 50 us per step (assumed), beside the GPU | none |",
        "| KV capacity | HBM less the weights | 90% of HBM (`gpu_memory_utilization`, vLLM's default) less the "
        "weights and Vidur's margin |",
        "| admission | blocks of the current step per request; the last admitted preempted when they run out "
        "(vLLM V1) | the whole prompt's blocks at admission, one block as it grows, 1% watermark; restart on "
        "preemption |", "",
        "What was synthesized, and how: Vidur ships its profiling tables on a model hub (`snapshot_download` at run "
        "time) and has none for Llama-2-7B there; `--setup` writes them as local datasets (HF_HUB_OFFLINE=1). "
        "`mlp.csv` is Vidur's own measured H100 Llama-2-7B table (the microsoft/vidur repository, tensor parallel "
        "1 rows: tests/bench/peer_data/README.md). `attention.csv` is a Git LFS object absent from that "
        "repository's snapshot: it is synthesized, per layer, as decode attention = the batch's KV bytes "
        "(batch x (kv + 1) x 2 x 32 heads x 128 x 2 B) at the HBM rate its GEMMs reach at one token; prefill "
        "attention = 4 H d x the chunk's causal pairs at the FLOP rate its GEMMs reach at 4,096 tokens (or its KV "
        "at the HBM rate, if longer); KV-cache save = the new tokens' KV at the HBM rate; none below "
        f"{1e6 * rates['floor_s']:.0f} us (its shortest kernel: a norm at one token). So Vidur's attention here is "
        "a model built from its own measurements, not a measurement: ratios that depend on attention (TBT at long "
        "contexts, TTFT) compare two models. The network tables are unused at tensor parallel 1 (empty). Vidur's "
        "random forest is fitted at one grid point (250 trees, depth 16, split 2) instead of its 27 (hours on two "
        "cores).", "",
    ]
    if outside:
        lines += ["## Outside ±15%", ""]
        for kind, where in outside.items():
            lines += [f"- {', '.join(where)}: {explained(kind, ratios, shares)}"]
        lines.append("")
    else:
        lines += ["Every ratio is within ±15%.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
