"""`python -m tracer.micro {train,export,samples}`: the bundled micro model's one-time jobs (tracer/micro/README.md).

Its tables are experiments: `thoughtkv experiment micro-table` and `thoughtkv experiment capacity-long`.
"""

from __future__ import annotations

import argparse
import sys

from thoughtkv_base.options import (
    NONNEGATIVE_INT,
    OUTPUT_PATH,
    PATH,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SHARED,
    TEXT,
    Flag,
    add_flags,
)

TRAIN = (
    SHARED["out"].use(required=True, help="output directory (checkpoints, log, final model)"),
    "seed",
    Flag("--max-steps", "training steps", POSITIVE_INT, default=3000),
    SHARED["threads"].use(default=2, default_text=None,
                          help="torch CPU threads; use 1 on a busy machine (spinning threads waste CPU there)"),
    Flag("--kv-heads", "KV heads for the 6 query heads (6 = no GQA)", POSITIVE_INT, default=3),
    Flag("--no-resume", "start over even if DIR/checkpoint exists", None, action="store_true", default=False),
    SHARED["task"].use(default="chains", help="curriculum: chains (from scratch) or chains_long"),
    Flag("--init-from", "model directory to fine-tune from (e.g. tracer/assets/micro)", TEXT, default="",
         default_text="none (from scratch)"),
    SHARED["batch_size"].use(default=32, help="training sequences per step"),
    Flag("--lr", "peak learning rate (the final one is lr/10)", POSITIVE_FLOAT, default=3e-3),
    Flag("--warmup-steps", "steps of linear warm-up to the peak learning rate", NONNEGATIVE_INT, default=200),
)
EXPORT = (
    Flag("run_dir", "a finished training run (train's --out)", PATH, metavar="RUN_DIR"),
    Flag("--to", "where the model, tokenizer and log go", OUTPUT_PATH, metavar="DIR",
         default_text="the package's tracer/assets/micro"),
)
SAMPLES = (
    SHARED["out"].use(help="where the sample traces go", default_text="the repository's traces/samples"),
    SHARED["n_samples"].use(default=20, help="samples per trace"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracer.micro", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_flags(sub.add_parser("train", help="train the micro model on chains (seeded; resumes from DIR/checkpoint)"),
              *TRAIN)
    add_flags(sub.add_parser("export", help="copy a finished run's model, tokenizer and log into tracer/assets/micro"),
              *EXPORT)
    add_flags(sub.add_parser("samples", help="regenerate the shipped sample traces in traces/samples/"), *SAMPLES)
    args = parser.parse_args(argv)
    if args.command == "train":
        from tracer.micro.train import TrainConfig, train

        train(args.out, TrainConfig(seed=args.seed, max_steps=args.max_steps, threads=args.threads,
                                    kv_heads=args.kv_heads, task=args.task, init_from=args.init_from,
                                    batch_size=args.batch_size, lr=args.lr, final_lr=args.lr / 10,
                                    warmup_steps=args.warmup_steps), resume=not args.no_resume)
    elif args.command == "export":
        from tracer.micro.train import export_model
        from tracer.models import MICRO_DIR

        export_model(args.run_dir, args.to or MICRO_DIR)
    elif args.command == "samples":
        from tracer.micro.samples import write_samples

        print(f"wrote {write_samples(args.out, args.n_samples)}")
    return 0


if __name__ == "__main__":
    from thoughtkv_base import UserError

    try:
        sys.exit(main())
    except UserError as exc:
        print(f"python -m tracer.micro: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
