"""``python -m lightning_fsdp.benchmark``: fsdp_custom against torch DDP, FSDP1 and FSDP2 on CPU/gloo.

Writes results.json, results.md and plot.png into ``--out``; progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from lightning_fsdp.benchmark.variants import VARIANTS


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world-sizes takes comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes takes positive integers, got {text!r}")
    return sorted(set(sizes))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from lightning_fsdp.benchmark import BenchmarkConfig
    from lightning_fsdp.benchmark.variants import parse_variants

    d = BenchmarkConfig()
    parser = argparse.ArgumentParser(
        prog="python -m lightning_fsdp.benchmark",
        description="Train one GPT with fsdp_custom (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD), torch DDP, FSDP1 and "
        "FSDP2 in 2 gloo processes on CPU; report step time, memory, communication and final loss; then run "
        "fsdp_custom FULL_SHARD at several world sizes.",
    )
    parser.add_argument("--layers", type=int, default=d.layers, help="GPT n_layer (default %(default)s)")
    parser.add_argument("--width", type=int, default=d.width, help="GPT n_embd (default %(default)s)")
    parser.add_argument("--heads", type=int, default=d.heads, help="GPT n_head (default %(default)s)")
    parser.add_argument("--seq", type=int, default=d.seq, help="GPT block_size = sequence length (default %(default)s)")
    parser.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size, >= 62 (default %(default)s)")
    parser.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per step (default %(default)s)")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps after warmup (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="untimed first steps (default %(default)s)")
    parser.add_argument("--mem-steps", type=int, default=d.mem_steps,
                        help="steps of the separate profiled memory run (default %(default)s)")
    parser.add_argument("--world-sizes", type=_world_sizes, default=d.world_sizes,
                        help="world sizes of the fsdp_custom FULL_SHARD scaling run (default 1,2,4)")
    parser.add_argument("--variants", default="all",
                        help=f"'all' or a comma-separated subset of: {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=d.threads,
                        help="torch threads per process (default %(default)s)")
    parser.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="model and data seed (default %(default)s)")
    parser.add_argument("--loss-rtol", type=float, default=d.loss_rtol,
                        help="relative tolerance for final losses to agree (default %(default)s)")
    parser.add_argument("--variant-timeout", type=float, default=d.variant_timeout,
                        help="seconds before a variant's processes are killed (default %(default)s)")
    parser.add_argument("--out", default="benchmark-results",
                        help="folder for results.md, results.json, plot.png (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        args.variant_keys = parse_variants(args.variants)
    except ValueError as error:
        parser.error(str(error))
    for name in ("layers", "width", "heads", "seq", "batch", "steps", "mem_steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.width % args.heads:
        parser.error(f"--width ({args.width}) must be divisible by --heads ({args.heads})")
    return args


def main(argv: list[str] | None = None) -> int:
    from lightning_fsdp.benchmark import BenchmarkConfig, run_benchmark

    args = parse_args(argv)
    cfg = BenchmarkConfig(
        layers=args.layers, width=args.width, heads=args.heads, seq=args.seq, vocab=args.vocab, batch=args.batch,
        steps=args.steps, warmup=args.warmup, mem_steps=args.mem_steps, world_sizes=args.world_sizes,
        variants=args.variant_keys, threads=args.threads, lr=args.lr, seed=args.seed, loss_rtol=args.loss_rtol,
        variant_timeout=args.variant_timeout,
    )
    command = "python -m lightning_fsdp.benchmark " + " ".join(shlex.quote(a) for a in
                                                               (sys.argv[1:] if argv is None else argv))
    results = run_benchmark(cfg, out=args.out, command=command.strip())
    failed = [r["name"] for r in results["variants"] + results["scaling"] if r["status"] != "ok"]
    disagree = [r["name"] for r in results["variants"] if r.get("loss_agrees") is False]
    print(f"results in {args.out}/results.md" + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; final losses disagree: {', '.join(disagree)}" if disagree else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
