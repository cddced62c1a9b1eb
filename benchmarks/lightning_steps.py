"""Step time through Lightning: fsdp_custom FULL_SHARD against Lightning DDP on the small model, launches alternated.

    python -m benchmarks.lightning_steps --world-sizes 2,4 --pairs 4 --out DIR
    python -m benchmarks.lightning_steps --merge DIR1 DIR2 --out DIR     # one report of several runs' pairs

A Trainer owns its training loop, so two strategies cannot take turns step by step in one process as
``python -m benchmarks`` interleaves torch's DDP. Here each strategy is launched as a user launches a Lightning script
(``benchmarks/scale_rank.py``, the scale benchmark's rank), and the launches alternate: fsdp_custom then DDP, then DDP
then fsdp_custom, and so on for ``--pairs`` pairs, so that a change in the machine's load between launches falls on
both in turn. Each launch reports the median step (the slower rank per step, steps after the first); each pair gives
one ratio (fsdp_custom's median over DDP's), and the figure to read is the median of the pairs' ratios. No monitor,
no checkpoint: only the training loop is timed. Writes ``steps.json`` and ``steps.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import command_line, machine
from benchmarks.scale import VARIANT_NAMES, ScaleConfig, gpt_shape, run_variant, summarise

__all__ = ["StepConfig", "merge_steps", "run_steps", "steps_markdown"]

CANDIDATE = "fsdp_full"
BASELINE = "ddp"


@dataclass
class StepConfig:
    """The small model of ``python -m benchmarks`` (6 x 512, vocabulary 65, sequence 128: 19.0M parameters, untied
    head, no biases), 8 sequences per rank and step."""

    world_sizes: list[int] = field(default_factory=lambda: [2, 4])
    pairs: int = 4
    params: int = 19_000_000
    width: int = 512
    heads: int = 8
    vocab: int = 65
    seq: int = 128
    batch: int = 8
    steps: int = 16
    threads: int = 1
    profile: bool = False  # torch.profiler over each launch's steps after the first (runs/*/profile-rank*.txt)
    fsdp_options: dict[str, Any] = field(default_factory=dict)  # FSDPStrategy arguments besides the defaults

    def scale_config(self) -> ScaleConfig:
        return ScaleConfig(
            params={0: self.params},
            world_sizes=self.world_sizes,
            variants=[CANDIDATE, BASELINE],
            width=self.width,
            heads=self.heads,
            vocab=self.vocab,
            seq=self.seq,
            batch=self.batch,
            steps=self.steps,
            threads=self.threads,
            lr=1e-3,
            monitor=False,
            save=False,
            profile=self.profile,
            fsdp_options=self.fsdp_options,
            timeout=900.0,
        )


def run_steps(cfg: StepConfig, out: Path, say: Any = print) -> dict[str, Any]:
    """``cfg.pairs`` alternated pairs of launches at each world size; returns (and writes) the launches and ratios."""
    out.mkdir(parents=True, exist_ok=True)
    scale = cfg.scale_config()
    worlds: list[dict[str, Any]] = []
    for world in cfg.world_sizes:
        shape = gpt_shape(scale, cfg.params)
        launches: list[dict[str, Any]] = []
        for pair in range(cfg.pairs):
            order = [CANDIDATE, BASELINE] if pair % 2 == 0 else [BASELINE, CANDIDATE]
            for variant in order:
                work = out / "runs" / f"{variant}-ws{world}-pair{pair}"
                result = run_variant(scale, variant, world, shape, work, load=False)
                if result["status"] != "ok":
                    raise RuntimeError(f"{variant} at {world} ranks failed ({result['error']}):\n{result['log_tail']}")
                summary = summarise(result["ranks"])
                launches.append({"pair": pair, "variant": variant, **summary})
                say(f"[steps] ws={world} pair {pair} {VARIANT_NAMES[variant]}: {summary['median_step_s']:.3f} s")
        worlds.append({"world": world, "launches": launches, **_ratios(launches, cfg.pairs)})
    report = {
        "config": asdict(cfg),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "worlds": worlds,
    }
    (out / "steps.json").write_text(json.dumps(report, indent=1))
    (out / "steps.md").write_text(steps_markdown(report))
    return report


def merge_steps(folders: list[Path], out: Path) -> dict[str, Any]:
    """One report of several runs' ``steps.json`` (each run a few pairs, so that each holds a shared machine's lock
    briefly): per world size, every run's pairs, renumbered in the order given, and the ratios over all of them."""
    reports = [json.loads((folder / "steps.json").read_text()) for folder in folders]
    launches: dict[int, list[dict[str, Any]]] = {}
    for report in reports:
        for w in report["worlds"]:
            first = len(launches.setdefault(w["world"], [])) // 2
            launches[w["world"]] += [{**r, "pair": first + r["pair"]} for r in w["launches"]]
    worlds = [{"world": k, "launches": v, **_ratios(v, len(v) // 2)} for k, v in sorted(launches.items())]
    merged = {
        "config": reports[0]["config"],
        "machine": reports[0]["machine"],
        "dates": [report["date"] for report in reports],
        "runs": [report.get("command") for report in reports],
        "worlds": worlds,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps(merged, indent=1))
    (out / "steps.md").write_text(steps_markdown(merged))
    return merged


def _ratios(launches: list[dict[str, Any]], pairs: int) -> dict[str, Any]:
    """Per pair, the candidate's median step over the baseline's; their median, and each variant's median step."""
    step = {(r["pair"], r["variant"]): r["median_step_s"] for r in launches}
    ratios = [step[(p, CANDIDATE)] / step[(p, BASELINE)] for p in range(pairs)]
    return {
        "pair_ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "median_step_s": {v: statistics.median(step[(p, v)] for p in range(pairs)) for v in (CANDIDATE, BASELINE)},
    }


def steps_markdown(report: dict[str, Any]) -> str:
    rows = [
        f"| ranks | pairs | {VARIANT_NAMES[CANDIDATE]}, median step s | {VARIANT_NAMES[BASELINE]}, median step s "
        "| ratio per pair | median ratio |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    for w in report["worlds"]:
        medians = w["median_step_s"]
        rows.append(
            f"| {w['world']} | {len(w['pair_ratios'])} | {medians[CANDIDATE]:.3f} | {medians[BASELINE]:.3f} "
            f"| {', '.join(f'{r:.2f}' for r in w['pair_ratios'])} | {w['median_ratio']:.2f}x |"
        )
    options = report["config"].get("fsdp_options")
    return (f"fsdp_custom with {options}\n\n" if options else "") + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    defaults = StepConfig()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lightning_steps", description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=lambda s: [int(x) for x in s.split(",")], default=defaults.world_sizes)
    for name in ("pairs", "params", "width", "heads", "vocab", "seq", "batch", "steps", "threads"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables of each launch's steps")
    parser.add_argument(
        "--fsdp-options",
        type=json.loads,
        default={},
        help='fsdp_custom arguments as JSON, e.g. {"forward_prefetch": true}',
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: a temporary one)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, help="merge these runs' steps.json into --out")
    args = parser.parse_args(argv)
    if args.merge:
        if args.out is None:
            parser.error("--merge needs --out")
        print(steps_markdown(merge_steps(args.merge, args.out)))
        return
    if args.pairs < 1 or args.steps < 2:
        parser.error(
            f"--pairs must be >= 1 and --steps >= 2 (the first step is not timed); got {args.pairs}, {args.steps}"
        )
    cfg = StepConfig(
        **{name: getattr(args, name) for name in ("world_sizes", "pairs", "params", "width", "heads", "vocab", "seq")},
        **{name: getattr(args, name) for name in ("batch", "steps", "threads", "profile", "fsdp_options")},
    )
    out = args.out or Path(tempfile.mkdtemp(prefix="lfsdp-steps-"))
    report = run_steps(cfg, out, say=lambda text: print(text, file=sys.stderr, flush=True))
    report["command"] = command_line("benchmarks.lightning_steps", argv)
    (out / "steps.json").write_text(json.dumps(report, indent=1))
    print(steps_markdown(report))
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
