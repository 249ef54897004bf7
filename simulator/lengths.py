"""Request lengths of R1-distill reasoning, per task: `thoughtkv serve-sim --lengths r1-7b/gsm8k` serves
"R1-7B on GSM8K-like requests" from any trace run, without an arrival CSV.

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
