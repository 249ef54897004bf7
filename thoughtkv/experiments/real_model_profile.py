"""The attention profile part of docs/real_model.md: the real LM (smollm2-135m on GSM8K) beside the bundled
`micro_long` (chains_long), each decoding its own chains with the full cache (tracer/attention_profile.py).

Cached in chunks of problems under RUNS/profile/<model>/ (a chunk's file name carries a hash of its inputs:
model, task, data file content, decode limit, problem range), so an interrupted profile resumes by chunk.
Writes OUT/real_model_profile.md (embedded in real_model.md), OUT/real_model_profile.csv (per model and layer)
and OUT/figures/attention_profile.png.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from thoughtkv_base.markdown import markdown_table

CHUNK = 16
MODELS = {  # model -> (task, decode limit): each on its own task, with its own chain lengths
    "smollm2-135m": ("gsm8k", 256),
    "micro_long": ("chains_long", 600),
}
FIGURE_STEM = "attention_profile"


def _chunk_path(runs: Path, model: str, task: str, max_new: int, data_file: Path | None, first: int, last: int) -> Path:
    digest = hashlib.sha256()
    digest.update(json.dumps([model, task, max_new, first, last]).encode())
    if data_file is not None:
        digest.update(data_file.read_bytes())
    return runs / "profile" / model / f"chunk-{first:04d}-{last:04d}-{digest.hexdigest()[:12]}.parquet"


def profile_model(runs: Path, model: str, n_samples: int, data_file: Path | None, batch_size: int,
                  progress: bool = True):
    """The per-(sample, layer) profile of `model` on its task's first `n_samples` problems (cached by chunk)."""
    import pandas as pd

    from tracer.attention_profile import profile_samples
    from tracer.models import load_model
    from tracer.tasks import get_task
    from traces.layout import write_atomic

    task_name, max_new = MODELS[model]
    task = get_task(task_name)
    source = data_file if task_name == "gsm8k" else None
    samples = task.load(n_samples, str(source) if source is not None else None)
    loaded, frames = None, []
    for first in range(0, len(samples), CHUNK):
        chunk = samples[first : first + CHUNK]
        path = _chunk_path(runs, model, task_name, max_new, source, first, first + len(chunk))
        if not path.is_file():
            loaded = loaded or load_model(model, "cpu", "float32")
            frame = profile_samples(loaded, task, chunk, max_new, batch_size, progress)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda temp, frame=frame: frame.to_parquet(temp))
            if progress:
                print(f"attention profile {model}: {first + len(chunk)}/{len(samples)} problems")
        frames.append(pd.read_parquet(path))
    return pd.concat(frames, ignore_index=True)


def write(out: Path, profiles: dict) -> None:
    """The profile's Markdown part, CSV and figure from the per-model frames."""
    from analysis.real_model_figures import attention_profile, profile_by_layer
    from analysis.style import save_figure
    from tracer.attention_profile import BUDGETS, SCORERS
    from traces.layout import write_atomic, write_csv_atomic

    by_layer = {model: profile_by_layer(frame) for model, frame in profiles.items()}
    write_csv_atomic(out / "real_model_profile.csv",
                     [{"model": m, "layer": layer, **row.to_dict()} for m, t in by_layer.items()
                      for layer, row in t.iterrows()])
    save_figure(attention_profile(profiles, SCORERS, BUDGETS), out / "figures", FIGURE_STEM)
    lines = ["## The attention profile: is attention concentrated on a real LM?", "",
             "Each model decodes its own problems greedily with the full cache (nothing placed), and at every decode "
             "step and layer the new query's attention (mean over query heads) is read "
             "(tracer/attention_profile.py): the share of the mass on the top 1 / 5 / 10 / 20% of positions, on the "
             "first 4 tokens (the sink), on the last 16 / 64 / 256 tokens, the mass-weighted mean distance back, and "
             "the mass on what each scorer would keep at budgets of 10-50% of the context (the new token plus the "
             "top-scored earlier positions by the scores of the steps before; `oracle`: this step's own top "
             "positions, the ceiling). Means over decode steps per problem, then over problems and layers. "
             "`micro_long` is the bundled micro model on its synthetic look-up chains (tracer/assets/micro_long).",
             "", f"![attention profile](figures/{FIGURE_STEM}.png)", "",
             ]
    table = []
    for model, frame in profiles.items():
        t = by_layer[model]
        shares = [f"{100 * t[k].mean():.1f}%" for k in ("top1", "top5", "top10", "top20", "sink", "recent16",
                                                         "recent64", "recent256")]
        table.append([model, MODELS[model][0], frame["sample_id"].nunique(), len(t), *shares,
                      f"{t['mean_distance'].mean():.0f}", f"{frame['decode_steps'].mean():.0f}"])
    lines += markdown_table(("model", "task", "problems", "layers", "top 1%", "top 5%", "top 10%", "top 20%",
                             "sink (4 tokens)", "last 16", "last 64", "last 256", "mean distance (tokens)",
                             "mean decode steps"), table)
    lines += ["", "Captured attention mass (mean over layers, steps and problems) of what each scorer keeps:", ""]
    best, table = {}, []
    for model, frame in profiles.items():
        for scorer in (*SCORERS, "oracle"):
            values = [frame[f"captured_{scorer}_{round(b * 100)}"].mean() for b in BUDGETS]
            table.append([model, f"{scorer}{' (ceiling)' if scorer == 'oracle' else ''}",
                          *(f"{100 * v:.1f}%" for v in values)])
        scores = {s: frame[f"captured_{s}_30"].mean() for s in SCORERS}
        best[model] = max(scores, key=scores.get), scores
    lines += markdown_table(("model", "scorer", *(f"{b:.0%} kept" for b in BUDGETS)), table)
    lines.append("")
    sentences = []
    for model, (winner, scores) in best.items():
        t = by_layer[model]
        sentences.append(f"on {model} the top 10% of positions hold {100 * t['top10'].mean():.1f}% of the attention "
                         f"(top 1%: {100 * t['top1'].mean():.1f}%, the sink {100 * t['sink'].mean():.1f}%), and at "
                         f"30% kept {winner} catches the most ({100 * scores[winner]:.1f}% against the oracle's "
                         f"{100 * profiles[model]['captured_oracle_30'].mean():.1f}%)")
    lines.append("In one sentence: " + "; ".join(sentences) + ".")
    write_atomic(out / "real_model_profile.md", lambda temp: temp.write_text("\n".join(lines) + "\n", encoding="utf-8"))
