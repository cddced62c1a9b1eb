"""``python -m benchmarks``: fsdp_custom against torch DDP, FSDP1 and FSDP2 on CPU/gloo.

Writes results.json, results.md and plot.png into ``--out``; progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import ConfigOption, add_config_options, command_line, config_fields
from benchmarks.variants import VARIANTS


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world-sizes takes comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes takes positive integers, got {text!r}")
    return sorted(set(sizes))


def _variant_keys(text: str) -> list[str]:
    from benchmarks.variants import parse_variants

    try:
        return parse_variants(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# The options that set a BenchmarkConfig field, in --help order.
_CONFIG_OPTIONS: tuple[ConfigOption, ...] = (
    ("layers", int, "GPT n_layer"),
    ("width", int, "GPT n_embd"),
    ("heads", int, "GPT n_head"),
    ("seq", int, "GPT block_size = sequence length"),
    ("vocab", int, "vocabulary size, >= 62"),
    ("batch", int, "sequences per rank per step"),
    ("steps", int, "timed steps after warmup"),
    ("warmup", int, "untimed first steps"),
    ("mem_steps", int, "steps of the separate profiled memory run"),
    ("world_sizes", _world_sizes, "world sizes of the scaling run"),
    ("scaling_variants", _variant_keys, "variants timed interleaved at each world size ('all' or keys)"),
    ("threads", int, "torch threads per process"),
    ("lr", float, "AdamW learning rate"),
    ("seed", int, "model and data seed"),
    ("loss_rtol", float, "relative tolerance for final losses to agree"),
    ("variant_timeout", float, "seconds before a variant's processes are killed"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks import BenchmarkConfig
    from benchmarks.variants import parse_variants

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Train one GPT with fsdp_custom (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD), torch DDP, FSDP1 and "
        "FSDP2 in 2 gloo processes on CPU; report step time, memory, communication and final loss; then time "
        "fsdp_custom FULL_SHARD against torch DDP at several world sizes.",
    )
    add_config_options(parser, BenchmarkConfig(), _CONFIG_OPTIONS)
    parser.add_argument(
        "--variants", default="all", help=f"'all' or a comma-separated subset of: {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--out", default="benchmark-results", help="folder for results.md, results.json, plot.png (default %(default)s)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="instead: step time eager and with each Block compiled, for one process, DDP, FSDP2 and fsdp_custom "
        "(compile.md, compile.json in --out)",
    )
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of --compile (default %(default)s)"
    )
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
    from benchmarks import BenchmarkConfig, run_benchmark

    args = parse_args(argv)
    cfg = BenchmarkConfig(**config_fields(args, _CONFIG_OPTIONS), variants=args.variant_keys)
    if args.compile:
        from benchmarks.compile import run_compile_benchmark

        results = run_compile_benchmark(cfg, args.out, args.compile_backend, command_line("benchmarks", argv))
        missed = [t["ratio"] for t in results["targets"] if not t["met"]]
        print(f"results in {args.out}/compile.md" + (f"; targets missed: {', '.join(missed)}" if missed else ""))
        return 0
    results = run_benchmark(cfg, out=args.out, command=command_line("benchmarks", argv))
    failed = [r["name"] for r in results["variants"] + results["scaling"] if r["status"] != "ok"]
    disagree = [r["name"] for r in results["variants"] if r.get("loss_agrees") is False]
    print(
        f"results in {args.out}/results.md"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + (f"; final losses disagree: {', '.join(disagree)}" if disagree else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
