"""`python -m tracer.micro {train,export,table,samples}`: the bundled micro model's one-time jobs (tracer/micro/README.md)."""

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
    p = sub.add_parser("table", help="capacity-accuracy table through the tracer (resumable)")
    p.add_argument("--out", type=Path, default=Path("docs"), help="folder for capacity_accuracy.md")
    p.add_argument("--runs", type=Path, default=Path("build/micro_table"), help="one trace run per cell (resume)")
    p.add_argument("--n-samples", type=int, default=200)
    p.add_argument("--cells", choices=["key", "all", "quant"], default="all",
                   help="key: full and the 30%% budget only; quant: hierarchy e=0 at 30%% with same/int8/int4 DDR")
    p.add_argument("--shard", default="0/1", help="I/N: run every N-th cell from the I-th (N processes side by side)")
    p = sub.add_parser("table-long", help="capacity-accuracy-traffic table on chains_long (resumable)")
    p.add_argument("--out", type=Path, default=Path("docs"), help="folder for capacity_accuracy_long.md")
    p.add_argument("--runs", type=Path, default=Path("build/micro_long_table"), help="one trace run per cell")
    p.add_argument("--n-samples", type=int, default=200)
    p.add_argument("--cells", choices=["key", "all"], default="all", help="key: full and the 30%% column only")
    p.add_argument("--shard", default="0/1", help="I/N: run every N-th cell from the I-th")
    p.add_argument("--model", default=None, help="default: the bundled tracer/assets/micro_long")
    p.add_argument("--full-n-samples", type=int, default=500, help="problems of the full-cache cell (at least n)")
    p.add_argument("--batch-size", type=int, default=1, help="samples decoded per step (same results, faster)")
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
    elif args.command == "table":
        from tracer.micro.table import run_table

        shard = _shard(args.shard)
        print(f"wrote {run_table(args.out, args.runs, args.n_samples, args.cells, shard=shard)}")
    elif args.command == "table-long":
        from tracer.micro.table_long import MODEL_DIR, run_table

        shard = _shard(args.shard)
        model = args.model or str(MODEL_DIR)
        written = run_table(args.out, args.runs, args.n_samples, args.cells, shard=shard, model=model,
                            full_n_samples=args.full_n_samples, batch_size=args.batch_size)
        print(f"wrote {written}")
    elif args.command == "samples":
        from tracer.micro.samples import write_samples

        print(f"wrote {write_samples(args.out, args.n_samples)}")
    return 0


def _shard(text: str) -> tuple[int, int]:
    from tracer.micro.table_long import parse_shard

    return parse_shard(text)


if __name__ == "__main__":
    from thoughtkv_base import UserError

    try:
        sys.exit(main())
    except UserError as exc:
        print(f"python -m tracer.micro: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
