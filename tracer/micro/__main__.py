"""`python -m tracer.micro {train,export,samples}`: the bundled micro model's one-time jobs (tracer/micro/README.md).

Its tables are experiments: `thoughtkv experiment micro-table` and `thoughtkv experiment capacity-long`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracer.micro", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train the micro model on chains (seeded; resumes from DIR/checkpoint)")
    p.add_argument("--out", type=Path, required=True, help="output directory (checkpoints, log, final model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--threads", type=int, default=2,
                   help="torch CPU threads; use 1 on a busy machine (spinning threads waste CPU there)")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads for the 6 query heads (6 = no GQA)")
    p.add_argument("--no-resume", action="store_true", help="start over even if DIR/checkpoint exists")
    p.add_argument("--task", default="chains", help="curriculum: chains (from scratch) or chains_long")
    p.add_argument("--init-from", default="", help="model directory to fine-tune from (e.g. tracer/assets/micro)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (the final one is lr/10)")
    p.add_argument("--warmup-steps", type=int, default=200)
    p = sub.add_parser("export", help="copy a finished run's model, tokenizer and log into tracer/assets/micro")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--to", type=Path, default=None, help="default: the package's tracer/assets/micro")
    p = sub.add_parser("samples", help="regenerate the shipped sample traces in traces/samples/")
    p.add_argument("--out", type=Path, default=None, help="default: the repository's traces/samples")
    p.add_argument("--n-samples", type=int, default=20)
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
