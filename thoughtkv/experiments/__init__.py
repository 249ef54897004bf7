"""The experiments: commands that regenerate a committed document, apart from the product commands.

Each is `thoughtkv experiment NAME --out docs/`, resumable (one trace run or simulator cell per table cell,
cached on its inputs), and rewrites the documents below from whatever has run. A module here exposes
`add_arguments(parser)` and `run(args)` like every subcommand; this table is the one list of them (the CLI's
help and the README's experiments table read it).
"""

from __future__ import annotations

# (name, module, documents written under --out, one-line help). Order = order in --help.
EXPERIMENTS: list[tuple[str, str, str, str]] = [
    ("micro-table", "thoughtkv.experiments.micro_table", "capacity_accuracy.md",
     "the micro model's capacity-accuracy table (chains)"),
    ("capacity-long", "thoughtkv.experiments.capacity_long", "capacity_accuracy_long.md",
     "the long workload's capacity-accuracy-traffic table and Pareto figure (micro_long)"),
    ("capacity-served", "thoughtkv.experiments.capacity_served", "capacity_served.md",
     "capacity as served: the frontier at qwen2-7b's shapes on three GPUs (micro_long)"),
    ("recall-design", "thoughtkv.experiments.recall_design", "recall_design_space.md",
     "recall rules against the oracle ceiling, with reuse (LRU buffer) and prefetch (micro_long, smollm2)"),
    ("real-model", "thoughtkv.experiments.real_model", "real_model.md, real_model_profile.md",
     "the real LM's attention profile, capacity-fidelity table and served frontier (smollm2-135m, GSM8K)"),
]
