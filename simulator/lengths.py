"""Request lengths: a cited length model of R1-distill reasoning per task (`thoughtkv serve-sim --lengths
r1-7b/gsm8k` serves "R1-7B on GSM8K-like requests" from any trace run), or an arrival CSV's own lengths
(`--arrivals-csv`: `read_arrivals_csv`, `csv_classes`).

A length model is a capped log-normal distribution of output tokens (the chain of thought and the answer) and a
fixed prompt length. Its mean is a published measured mean response length; its shape (sigma, in log space) is
assumed: no per-request length distribution of these models was found published. serve-sim represents the
distribution by `N_CLASSES` equally likely classes, the quantile midpoints (k + 1/2) / N, with the log-normal's
location solved so that the classes' mean equals the cited mean (the cited means are of capped generations, so
they are matched with the same cap). Each class replays one traced sample (drawn with the run's seed) resampled
to the class's length (project.project_arrays: step j of T replays the traced step at the same relative
position, at logical length prompt + j, every tier keeping its share of the context), and Poisson requests pick
a class uniformly: the requests' lengths follow the distribution, their access pattern the trace's.

Why classes, not one draw per request: a request's per-step tables are its length x layers, so a distinct length
per request would cost memory per request (an AIME-like request on a 28-layer model: ~15k steps x 29 operations);
16 classes keep the tables at 16 samples' worth and resolve the distribution's deciles.

An arrival CSV gives each request's prompt and output tokens itself. Each request replays the traced sample
nearest to it in (prompt, output) length (|P - p| + |O - o| smallest), resampled to the request's own lengths
exactly as a length class is (a request of the sample's own lengths replays the sample unchanged); requests of
equal (sample, prompt, output) share one work (`csv_classes`), so the tables cost memory per distinct length,
which `serve-sim` estimates before it starts (`csv_work_bytes`).

Sources (the mean output tokens):
- GSM8K: 716 tokens, DeepSeek-R1-Distill-Qwen-7B, the chain-of-thought baseline of an activation-steering study
  (github.com/qlaxyy/ASC_summer, results/RESULT_SUMMARY.md: "DeepSeek-R1-Distill-Qwen-7B / GSM8K | CoT | 91.25% |
  716.12"). Its MATH row (86%, 2,351 tokens) is the MATH test set, not MATH-500.
- MATH-500: 2,979 tokens per solution, generation limit 16,384 (R-KV, arXiv 2505.24133, README of its code,
  "Datasets" table; R1-Distill-Llama-8B and R1-Distill-Qwen-14B, sampled at temperature 0.6, top-p 0.95). No
  7B figure was found: assumed equal for R1-Distill-Qwen-7B.
- AIME 2024: 15,536 tokens per solution, generation limit 32,768 (the same R-KV table and models; assumed
  equal for the 7B).
Prompt lengths are assumed (a problem statement in the R1 template; they matter little next to the outputs):
GSM8K 128 tokens, MATH-500 96, AIME 160.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

N_CLASSES = 16  # equally likely length classes a length model is represented by in serve-sim


@dataclass(frozen=True)
class LengthModel:
    """Output tokens ~ min(cap, LogNormal(mu, sigma)) with mu set by the cited mean; a fixed prompt length."""

    name: str
    task: str
    mean_output_tokens: float  # cited (see the module docstring)
    max_output_tokens: int  # the generation limit the mean was measured under
    prompt_tokens: int  # assumed
    sigma: float = 0.6  # log-space spread, assumed (coefficient of variation ~0.66 before the cap)
    source: str = ""

    def classes(self, n: int = N_CLASSES) -> list[tuple[int, int]]:
        """`n` equally likely (prompt, output tokens) classes whose mean output is the cited mean."""
        z = np.array([NormalDist().inv_cdf((k + 0.5) / n) for k in range(n)])

        def outputs(mu: float) -> np.ndarray:
            return np.minimum(self.max_output_tokens, np.exp(mu + self.sigma * z))

        low, high = 0.0, math.log(self.max_output_tokens) + 10 * self.sigma
        for _ in range(200):  # the mean grows with mu: bisection to float precision
            mid = 0.5 * (low + high)
            low, high = (mid, high) if outputs(mid).mean() < self.mean_output_tokens else (low, mid)
        tokens = np.maximum(1, np.rint(outputs(0.5 * (low + high)))).astype(int)
        return [(self.prompt_tokens, int(t)) for t in tokens]


LENGTH_MODELS: dict[str, LengthModel] = {
    "r1-7b/gsm8k": LengthModel(
        "r1-7b/gsm8k", "GSM8K", mean_output_tokens=716.12, max_output_tokens=16384, prompt_tokens=128,
        source="github.com/qlaxyy/ASC_summer results/RESULT_SUMMARY.md (R1-Distill-Qwen-7B, CoT baseline); the cap "
               "is assumed"),
    "r1-7b/math-500": LengthModel(
        "r1-7b/math-500", "MATH-500", mean_output_tokens=2979, max_output_tokens=16384, prompt_tokens=96,
        source="R-KV (arXiv 2505.24133) README, Datasets table (R1-Distill-Llama-8B / -Qwen-14B; assumed for 7B)"),
    "r1-7b/aime": LengthModel(
        "r1-7b/aime", "AIME 2024", mean_output_tokens=15536, max_output_tokens=32768, prompt_tokens=160,
        source="R-KV (arXiv 2505.24133) README, Datasets table (R1-Distill-Llama-8B / -Qwen-14B; assumed for 7B)"),
}


def length_model(name: str) -> LengthModel:
    from simulator.errors import OptionError

    if name not in LENGTH_MODELS:
        raise OptionError(f"lengths {name!r} is unknown; use one of {', '.join(LENGTH_MODELS)} (--lengths)")
    return LENGTH_MODELS[name]


# ---------------------------------------------------------------- arrival CSVs -------------------------------

# Column names accepted for an arrival CSV: ours, and those of the Azure LLM inference traces released with
# Splitwise (Azure Public Dataset, AzureLLMInferenceTrace_2023/2024: TIMESTAMP,ContextTokens,GeneratedTokens).
CSV_COLUMNS = {
    "arrival_s": ("arrival_s", "TIMESTAMP", "timestamp"),
    "prompt_tokens": ("prompt_tokens", "ContextTokens", "input_tokens"),
    "output_tokens": ("output_tokens", "GeneratedTokens", "generated_tokens"),
}
# What one distinct CSV length costs to hold, per output token and operation (a layer or the LM head): the
# serving work's arrays (FLOPs, KV bytes, recall and offload bytes and times, bookkeeping: 7 float64), kept once in
# the work and once in the fast path's stacked tables.
WORK_BYTES_PER_STEP_OP = 2 * 7 * 8


@dataclass(frozen=True)
class RequestTrace:
    """The requests of an arrival CSV in arrival order: seconds from the first arrival, prompt and output tokens."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)


def read_arrivals_csv(path: str | Path) -> RequestTrace:
    """Arrivals from a CSV: arrival time (seconds, or timestamps as in the Azure trace; shifted to start at 0),
    prompt tokens (>= 0) and output tokens (>= 1) per request; any bad cell -> one ServingError naming its line."""
    import pandas as pd

    from simulator.errors import ServingError

    path = Path(path)
    if path.is_dir():
        raise ServingError(f"--arrivals-csv {path}: is a directory; pass the CSV file itself")
    if not path.is_file():
        raise ServingError(f"--arrivals-csv {path}: not found; pass an existing CSV")
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise ServingError(f"{path}: empty; write a header arrival_s,prompt_tokens,output_tokens and one row per "
                           "request") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise ServingError(f"{path}: not a readable CSV ({str(exc).splitlines()[0][:120]}); fix the file") from None
    picked = {}
    for ours, names in CSV_COLUMNS.items():
        found = [n for n in names if n in frame.columns]
        if not found:
            raise ServingError(f"{path}: no column for {ours} (one of {', '.join(names)}); add it")
        picked[ours] = frame[found[0]]
    if frame.empty:
        raise ServingError(f"{path}: a header but no requests; add one row per request")
    times = picked["arrival_s"]
    if not pd.api.types.is_numeric_dtype(times):
        try:
            # "mixed": each timestamp parsed on its own (what pandas falls back to, without its warning)
            times = pd.to_datetime(times, errors="raise", format="mixed")
        except (ValueError, TypeError):
            raise ServingError(f"{path}: arrival times must be seconds or timestamps like 2023-11-16 "
                               "18:15:46.68; fix the column") from None
        if times.isna().any():
            raise ServingError(f"{path}: line {int(times.isna().to_numpy().argmax()) + 2} has no arrival time; "
                               "fill it in")
        times = (times - times.min()).dt.total_seconds()
    times = _numbers(path, times, "arrival time (seconds)", whole=False)
    prompt = _numbers(path, picked["prompt_tokens"], "prompt tokens", whole=True)
    output = _numbers(path, picked["output_tokens"], "output tokens", whole=True)
    for values, name, low in ((prompt, "prompt tokens", 0), (output, "output tokens", 1)):
        if (values < low).any():
            row = int(np.argmax(values < low)) + 2  # line in the file: 1-based, after the header
            raise ServingError(f"{path}: line {row}: {name} {int(values[row - 2])} must be >= {low}; fix the row")
    order = np.argsort(times, kind="stable")
    return RequestTrace(arrival_s=(times - times.min())[order], prompt_tokens=prompt.astype(np.int64)[order],
                        output_tokens=output.astype(np.int64)[order])


def _numbers(path: Path, column, what: str, whole: bool) -> np.ndarray:
    """A CSV column as finite float64 numbers (whole ones if `whole`); the first bad cell -> one line."""
    import pandas as pd

    from simulator.errors import ServingError

    values = pd.to_numeric(column, errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values)
    if whole:  # and within what int64 and a sample length can mean
        bad |= (values != np.round(values)) | (np.abs(values) > 2**53)
    if bad.any():
        row = int(np.argmax(bad))
        raise ServingError(f"{path}: line {row + 2}: {what} {_cell_text(column.iloc[row])} is not a finite "
                           f"{'whole number' if whole else 'number'}; fix the cell")
    return values


def _cell_text(value) -> str:
    """A CSV cell as the file shows it: 'empty' for a missing one, plain numbers (never np.float64(nan))."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "(empty)"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return f"{float(value):g}"
    return repr(str(value))


def csv_classes(requests: RequestTrace, sample_lengths: np.ndarray) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    """Each CSV request's work: the traced sample nearest in (prompt, output) length (`sample_lengths`: [samples,
    2] prompt and generated tokens), resampled to the request's own (prompt, output). Returns the distinct
    (sample index, prompt, output) triples, one work each, and the index of each request's triple."""
    sample_lengths = np.asarray(sample_lengths, dtype=np.int64).reshape(-1, 2)
    if not len(sample_lengths):
        return [], np.zeros(len(requests), dtype=np.int64)
    wanted = np.column_stack([requests.prompt_tokens, requests.output_tokens])
    distinct, request_class = np.unique(wanted, axis=0, return_inverse=True)
    nearest = [int(np.argmin(np.abs(sample_lengths - row).sum(1))) for row in distinct]
    classes = [(sample, int(p), int(o)) for sample, (p, o) in zip(nearest, distinct)]
    return classes, np.asarray(request_class, dtype=np.int64).reshape(-1)


def csv_work_bytes(classes: list[tuple[int, int, int]], n_layers: int) -> int:
    """Memory the distinct CSV lengths' works take (WORK_BYTES_PER_STEP_OP per output token and operation)."""
    return int(sum(o for _, _, o in classes)) * (n_layers + 1) * WORK_BYTES_PER_STEP_OP
