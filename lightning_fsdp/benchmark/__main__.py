"""``python -m lightning_fsdp.benchmark``: fsdp_custom against torch DDP, FSDP1 and FSDP2 on CPU/gloo.

Writes results.json, results.md and plot.png into ``--out``; progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from typing import Any

from lightning_fsdp.benchmark.variants import VARIANTS


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world-sizes takes comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes takes positive integers, got {text!r}")
    return sorted(set(sizes))


def _variant_keys(text: str) -> list[str]:
    from lightning_fsdp.benchmark.variants import parse_variants

    try:
        return parse_variants(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# The options that set a BenchmarkConfig field, in --help order: (field, parser of the value, help without the
# default). Each becomes --<field with dashes>, defaults to the field's default, and main() passes it on by name, so
# an option is declared once here instead of three times (the flag, its default, the config argument).
_CONFIG_OPTIONS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
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
    from lightning_fsdp.benchmark import BenchmarkConfig
    from lightning_fsdp.benchmark.variants import parse_variants

    d = BenchmarkConfig()
    parser = argparse.ArgumentParser(
        prog="python -m lightning_fsdp.benchmark",
        description="Train one GPT with fsdp_custom (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD), torch DDP, FSDP1 and "
        "FSDP2 in 2 gloo processes on CPU; report step time, memory, communication and final loss; then time "
        "fsdp_custom FULL_SHARD against torch DDP at several world sizes.",
    )
    for name, parse, text in _CONFIG_OPTIONS:
        default = getattr(d, name)
        # A list default is written the way the option takes it ("1,2,4"), not as Python prints it.
        shown = ",".join(map(str, default)) if isinstance(default, list) else "%(default)s"
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=parse, default=default, help=f"{text} (default {shown})"
        )
    parser.add_argument(
        "--variants", default="all", help=f"'all' or a comma-separated subset of: {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--out", default="benchmark-results", help="folder for results.md, results.json, plot.png (default %(default)s)"
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
    from lightning_fsdp.benchmark import BenchmarkConfig, run_benchmark

    args = parse_args(argv)
    cfg = BenchmarkConfig(**{name: getattr(args, name) for name, _, _ in _CONFIG_OPTIONS}, variants=args.variant_keys)
    command = "python -m lightning_fsdp.benchmark " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    results = run_benchmark(cfg, out=args.out, command=command.strip())
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
