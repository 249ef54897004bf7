"""The shipped sample traces (`traces/samples/`): small runs of the bundled micro model, so that
`thoughtkv simulate` and `thoughtkv plot` work on a fresh clone without torch or a GPU.

    python -m tracer.micro samples [--out traces/samples] [--n-samples 20]

Four runs through `tracer.run.run_trace` with the settings of the capacity–accuracy table: the full cache,
pure eviction (H2O) at 30% HBM, and the hierarchy at 30% HBM with 0% and 10% evicted. Reruns resume.
"""

from __future__ import annotations

from pathlib import Path

from tracer.micro.table import BLOCK_SIZE, MAX_NEW_TOKENS, RECALL_K, SINK_TOKENS, WINDOW_TOKENS

SAMPLES_DIR = Path(__file__).resolve().parents[2] / "traces" / "samples"
RUNS = {  # name -> (policy, scorer, hbm_budget, evict_ratio)
    "micro-full": ("full", "h2o", 1.0, 0.0),
    "micro-evict-h2o-b30": ("evict", "h2o", 0.3, 0.0),
    "micro-hierarchy-b30-e0": ("hierarchy", "h2o", 0.3, 0.0),
    "micro-hierarchy-b30-e10": ("hierarchy", "h2o", 0.3, 0.1),
}


def write_samples(out: Path | None = None, n_samples: int = 20, progress: bool = True) -> Path:
    from tracer.run import TraceConfig, run_trace

    out = out or SAMPLES_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, (policy, scorer, budget, evict_ratio) in RUNS.items():
        config = TraceConfig(
            model="micro", task="chains", out=str(out / name), n_samples=n_samples, policy=policy, scorer=scorer,
            hbm_budget=budget, evict_ratio=evict_ratio, block_size=BLOCK_SIZE, sink_tokens=SINK_TOKENS,
            window_tokens=WINDOW_TOKENS, recall_k=RECALL_K if policy == "hierarchy" else 4,
            max_new_tokens=MAX_NEW_TOKENS, seed=0,
        )
        run_trace(config, progress=progress)
    return out
