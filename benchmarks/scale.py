"""Scale benchmark: a model of a given size through Lightning, per rank memory against the theory and
``estimate_memory``, step time, init time from meta, sharded save and load time.

    python -m benchmarks.scale --params 0.85B --world-sizes 2 --out docs/scale
    python -m benchmarks.scale --params 2:0.85B,4:0.3B --world-sizes 2,4 --out docs/scale

Each variant runs in processes of its own, started as a user starts a Lightning script
(``benchmarks/scale_rank.py``; Lightning's launcher starts the other ranks), one variant after the other, so that
no variant's memory is seen by another's. The model is the demo GPT (``lightning_fsdp.demo.gpt``) with the shape a
Llama-style model of that size has (width 2048, 16 heads, vocabulary 32000, untied head, no biases; the number of
Blocks picked for the size), each Block a unit, AdamW. What each figure means and how it is measured:
docs/benchmarks.md, "At scale".

A variant that the machine's memory cannot hold (``estimate_memory``'s ``step_peak`` with one activation set plus the
process's base, times the ranks, against ``--memory-gib``) is skipped with that reason instead of run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import command_line, machine
from benchmarks.ranks import clean_env, run_logged
from benchmarks.scale_rank import FSDP_CUSTOM, hybrid_per_node, is_unit

__all__ = [
    "ESTIMATE_TOLERANCE",
    "ScaleConfig",
    "VARIANT_NAMES",
    "activation_bytes",
    "gpt_shape",
    "parse_params",
    "run_scale",
]

VARIANT_NAMES = {
    "fsdp_full": "fsdp_custom FULL_SHARD",
    "fsdp_grad_op": "fsdp_custom SHARD_GRAD_OP",
    "fsdp_hybrid": "fsdp_custom HYBRID_SHARD",
    "fsdp2": "ModelParallelStrategy (FSDP2)",
    "ddp": "Lightning DDP",
}
# Model state per parameter with AdamW in fp32: the parameter, its gradient, exp_avg and exp_avg_sq.
STATE_BYTES_PER_PARAM = 16
# A Lightning rank's resident memory before the model exists (torch, Lightning, gloo), measured here: ~0.45 GiB.
BASE_GIB = 0.5
GIB = 2**30
MIB = 2**20
# estimate_memory's step_peak with one activation set agrees with the measured private peak over base within this
# fraction, or within ESTIMATE_SLACK_BYTES where that is larger: freed heap memory glibc keeps resident (74-99 MiB
# per rank after a backward at 63M, mallinfo2's free bytes), which no estimate from shapes can see (docs/benchmarks.md,
# "At scale"; tests/benchmarks/test_scale_benchmark.py checks it on a small size).
ESTIMATE_TOLERANCE = 0.10
ESTIMATE_SLACK_BYTES = 128 * MIB


@dataclass
class ScaleConfig:
    """What to run. ``params``: the model size per world size (``{world size: parameters}``)."""

    params: dict[int, int] = field(default_factory=lambda: {0: 850_000_000})  # 0: any world size
    world_sizes: list[int] = field(default_factory=lambda: [2])
    variants: list[str] = field(default_factory=lambda: list(VARIANT_NAMES))
    width: int = 2048
    heads: int = 16
    vocab: int = 32000
    seq: int = 256
    batch: int = 1  # sequences per rank per step
    steps: int = 4
    threads: int = 1
    lr: float = 1e-4
    seed: int = 0
    memory_gib: float | None = None  # None: MemAvailable now
    units: str = "blocks"  # "blocks": each Block a unit; "blocks+ends": also the token embedding and the head
    pretrained: bool = False  # fsdp_custom: load_pretrained of a safetensors file of the model at on_fit_start
    trace: bool = False  # sample each rank's RssAnon through training (results.json, "trace")
    monitor: bool = True  # fsdp_custom: a ShardingMonitor logging every step (off for step-time comparisons)
    save: bool = True  # save (and load) after training
    fsdp_options: dict[str, Any] = field(default_factory=dict)  # more FSDPStrategy arguments for fsdp_custom
    profile: bool = False  # torch.profiler over the steps after the first: {run}/profile-rank{r}.txt
    timeout: float = 1500.0  # seconds one variant may take
    collective_timeout: float = 900.0


def parse_params(text: str) -> dict[int, int] | int:
    """``"0.85B"`` (every world size) or ``"2:0.85B,4:0.3B"`` (per world size); suffixes K, M, B."""

    def one(value: str) -> int:
        scale = {"K": 1e3, "M": 1e6, "B": 1e9}.get(value[-1:].upper(), 1.0)
        number = value[:-1] if scale != 1.0 else value
        try:
            result = int(float(number) * scale)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a size such as 0.85B, 300M or 120000") from None
        if result < 1:
            raise argparse.ArgumentTypeError(f"{value!r} is not a positive size")
        return result

    if ":" not in text:
        return one(text)
    sizes: dict[int, int] = {}
    for part in text.split(","):
        world, _, size = part.partition(":")
        if not world.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} is not WORLD:SIZE, e.g. 2:0.85B")
        sizes[int(world)] = one(size.strip())
    return sizes


def gpt_shape(cfg: ScaleConfig, params: int) -> dict[str, Any]:
    """The demo GPT's config whose parameter count is nearest ``params`` at the config's width (at least 1 Block)."""
    d, v, t = cfg.width, cfg.vocab, cfg.seq
    fixed = 2 * v * d + t * d + d  # embeddings, untied head, position embedding, final LayerNorm
    per_block = 12 * d * d + 2 * d
    layers = max(1, round((params - fixed) / per_block))
    return {
        "vocab_size": v,
        "block_size": t,
        "n_layer": layers,
        "n_head": cfg.heads,
        "n_embd": d,
        "dropout": 0.0,
        "bias": False,
        "tie_weights": False,
    }


def _meta_gpt(shape: dict[str, Any]) -> nn.Module:
    from lightning_fsdp.demo.gpt import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(**shape))


def activation_bytes(model: nn.Module, batch: int, seq: int) -> int:
    """Bytes of the tensors autograd keeps from one forward for backward (one activation set), from a forward on the
    meta device: every saved tensor that is not a parameter (or a view of one), each counted once."""
    params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in params and id(base) not in seen:
            seen.add(id(base))
            total += base.numel() * base.element_size()
        return tensor

    vocab = model.config.vocab_size  # type: ignore[union-attr]
    idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx.clamp(max=vocab - 1))
    del loss
    return total


def shard_size(variant: str, world: int) -> int:
    """Ranks one parameter is split over."""
    if variant == "ddp":
        return 1
    if variant == "fsdp_hybrid":
        return hybrid_per_node(world)
    return world


def _estimate(model: nn.Module, variant: str, world: int, units: str) -> Any:
    from lightning_fsdp import estimate_memory

    strategy = {"ddp": "NO_SHARD", "fsdp2": "FULL_SHARD"}.get(variant) or FSDP_CUSTOM[variant]
    if strategy == "HYBRID_SHARD":
        strategy = "FULL_SHARD"  # estimate_memory's world size is one shard group's
    policy = functools.partial(is_unit, model.config.vocab_size, units == "blocks+ends")  # type: ignore[union-attr]
    return estimate_memory(model, shard_size(variant, world), strategy, optimizer="adamw", auto_wrap_policy=policy)


def _available_gib() -> float:
    """MemAvailable less a margin of 2 GiB for the rest of the machine."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) / 2**20 for line in f if line.startswith("MemAvailable:")) - 2.0


def write_pretrained(shape: dict[str, Any], path: Path, seed: int) -> int:
    """A safetensors file with a value for every parameter of the GPT of ``shape`` (N(0, 0.02), from ``seed``), as a
    pretrained checkpoint is; written one tensor at a time. Returns its size in bytes."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.randn(p.shape, generator=generator) * 0.02 for name, p in _meta_gpt(shape).named_parameters()
    }
    save_file(tensors, str(path))
    del tensors
    return path.stat().st_size


def run_variant(
    cfg: ScaleConfig, variant: str, world: int, shape: dict[str, Any], work: Path, load: bool
) -> dict[str, Any]:
    """Launch one variant; returns its ranks' records or a failure with the output's end."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "variant": variant,
        "world": world,
        "model": shape,
        "batch": cfg.batch,
        "steps": cfg.steps,
        "threads": cfg.threads,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "collective_timeout": cfg.collective_timeout,
        "out": str(work),
        "load": load,
        "trace": cfg.trace,
        "monitor": cfg.monitor,
        "save": cfg.save,
        "profile": cfg.profile,
        "fsdp_options": cfg.fsdp_options,
        "units": cfg.units,
        "pretrained": None,
    }
    if cfg.pretrained and variant in FSDP_CUSTOM:
        spec["pretrained"] = str(work / "pretrained.safetensors")
        spec["pretrained_file_bytes"] = write_pretrained(shape, work / "pretrained.safetensors", cfg.seed)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = clean_env(OMP_NUM_THREADS=str(cfg.threads), MKL_NUM_THREADS=str(cfg.threads))
    log = work / "log.txt"
    start = time.perf_counter()
    code = run_logged([sys.executable, "-m", "benchmarks.scale_rank", str(spec_path)], log, env, work, cfg.timeout)
    wall = time.perf_counter() - start
    files = [work / f"rank{r}.json" for r in range(world)]
    ranks = [json.loads(f.read_text()) for f in files if f.exists()]
    if code != 0 or len(ranks) < world or not all(r.get("complete") for r in ranks):
        why = "timed out" if code is None else f"exit status {code}"
        return {"status": "failed", "error": why, "log_tail": log.read_text(errors="replace")[-4000:], "ranks": ranks}
    return {"status": "ok", "ranks": ranks, "wall_s": wall, "pretrained_file_bytes": spec.get("pretrained_file_bytes")}


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one variant from its ranks' records: the largest rank's peaks, the slower rank's steps."""
    steps = [max(r["step_s"][i] for r in ranks) for i in range(min(len(r["step_s"]) for r in ranks))]
    timed = steps[1:] if len(steps) > 1 else steps  # the first step also creates AdamW's state
    phases = ("init", "train", "save", "load", "teardown")
    out: dict[str, Any] = {
        "steps_s": steps,
        "median_step_s": statistics.median(timed),
        "peak_bytes_per_rank": [r["train_peak_bytes"] for r in ranks],
        "base_rss_bytes_per_rank": [r["base_rss_bytes"] for r in ranks],
        "losses": ranks[0].get("losses", []),
    }
    for phase in phases:
        measured = all(f"{phase}_s" in r for r in ranks)  # no load when the machine cannot hold it
        out[f"{phase}_s"] = max(r[f"{phase}_s"] for r in ranks) if measured else None
        out[f"{phase}_peak_bytes"] = max(r[f"{phase}_peak_bytes"] for r in ranks) if measured else None
    out["after_init_bytes"] = max(r["after_init_bytes"] for r in ranks)
    # The training peak less the file pages gained since the base (they only grow here): private memory at the peak,
    # what estimate_memory models.
    out["train_private_peak_bytes"] = max(r["train_peak_bytes"] - r["train_file_bytes"] for r in ranks)
    out["train_file_bytes"] = max(r["train_file_bytes"] for r in ranks)
    if "pretrained_s" in ranks[0]:
        out["pretrained_s"] = max(r["pretrained_s"] for r in ranks)
        out["pretrained_rss_bytes"] = max(r["pretrained_rss_bytes"] for r in ranks)
        out["pretrained_anon_bytes"] = max(r["pretrained_anon_bytes"] for r in ranks)
        out["pretrained_not_loaded"] = max(r["pretrained_not_loaded"] for r in ranks)
    if "trace" in ranks[0]:
        out["trace"] = [r["trace"] for r in ranks]
    if "monitor" in ranks[0]:
        out["monitor"] = [r["monitor"] for r in ranks]
    return out


def run_scale(cfg: ScaleConfig, out: Path, say: Any = print) -> dict[str, Any]:
    """Every variant at every world size of ``cfg``, one after another; returns (and writes) the records."""
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    budget = cfg.memory_gib if cfg.memory_gib is not None else _available_gib()
    for world in cfg.world_sizes:
        params = cfg.params.get(world, cfg.params.get(0))
        if params is None:
            raise ValueError(f"no model size for world size {world}; sizes given for {sorted(cfg.params)}")
        shape = gpt_shape(cfg, params)
        model = _meta_gpt(shape)
        numel = sum(p.numel() for p in model.parameters())
        activations = activation_bytes(model, cfg.batch, cfg.seq)
        for variant in cfg.variants:
            estimate = _estimate(model, variant, world, cfg.units)
            # Lightning zeroes gradients between training_step and backward; fsdp_custom zeroes them before the
            # forward instead (docs/how-it-works.md, "A training step"), so only the peers hold them through it.
            step_peak = estimate.step_peak(activations, gradients_in_forward=variant in ("ddp", "fsdp2"))
            theory = STATE_BYTES_PER_PARAM * numel / shard_size(variant, world)
            need_gib = world * (step_peak / GIB + BASE_GIB)
            record: dict[str, Any] = {
                "variant": variant,
                "name": VARIANT_NAMES[variant],
                "world": world,
                "model": shape,
                "params": numel,
                "theory_bytes": theory,
                "activation_bytes": activations,
                "estimate_peak_bytes": estimate.peak,
                "estimate_model_state_bytes": estimate.model_state,
                "estimate_gathered_bytes": estimate.gathered_params,
                "estimate_training_peak_bytes": estimate.training_peak,
                "estimate_step_peak_bytes": step_peak,
                "units": cfg.units,
                "need_gib": need_gib,
            }
            if need_gib > budget:
                record.update(
                    status="skipped",
                    reason=f"needs ~{need_gib:.1f} GiB over {world} ranks by estimate_memory "
                    f"(+ activations + {BASE_GIB} GiB base per rank); {budget:.1f} GiB available",
                )
                say(f"[scale] {record['name']} ws={world}: skipped, {record['reason']}")
                records.append(record)
                continue
            # Loading after training holds the trained parameters and optimizer state, read into in place (DCP's load
            # under FSDP2, the sharded loader's under fsdp_custom); gradients are dropped first.
            kept = estimate.params + estimate.optimizer_state
            load_gib = world * (1.1 * (kept + activations) / GIB + BASE_GIB)
            load = load_gib <= budget
            if not load:
                record["load_skipped"] = (
                    f"loading needs ~{load_gib:.1f} GiB over {world} ranks (the trained state, read into in place); "
                    f"{budget:.1f} GiB available"
                )
                say(f"[scale] {record['name']} ws={world}: no load, {record['load_skipped']}")
            say(f"[scale] {record['name']} ws={world}, {numel / 1e9:.3f}B parameters ...")
            work = out / "runs" / f"{variant}-ws{world}"
            result = run_variant(cfg, variant, world, shape, work, load)
            shutil.rmtree(work / "checkpoint", ignore_errors=True)
            (work / "checkpoint.ckpt").unlink(missing_ok=True)
            (work / "pretrained.safetensors").unlink(missing_ok=True)
            if result["status"] != "ok":
                record.update(status="failed", error=result["error"], log_tail=result["log_tail"])
                say(f"[scale]   FAILED ({result['error']}):\n{result['log_tail'][-1500:]}")
            else:
                record.update(status="ok", wall_s=result["wall_s"], **summarise(result["ranks"]))
                if result["pretrained_file_bytes"] is not None:
                    record["pretrained_file_bytes"] = result["pretrained_file_bytes"]
                peak = record["train_peak_bytes"]
                say(
                    f"[scale]   peak {peak / MIB:.0f} MiB/rank over base ({peak / theory:.2f}x theory, "
                    f"{peak / step_peak:.2f}x estimate), step {record['median_step_s']:.2f} s, "
                    f"init {record['init_s']:.1f} s, save {record['save_s']:.1f} s, load {_secs(record['load_s'])} s"
                )
            records.append(record)
    report = {"config": asdict(cfg), "machine": machine(), "date": time.strftime("%Y-%m-%d"), "records": records}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(report))
    try:
        plot(report, out / "plot.png")
    except ImportError:
        say("[scale] matplotlib is not installed: no plot")
    return report


def _secs(value: float | None) -> str:
    return "not run" if value is None else f"{value:.1f}"


def markdown(report: dict[str, Any]) -> str:
    """The table of every record. "x (theory + act.)": the measured peak over the theory plus one activation set;
    "x estimate": over ``estimate_memory(...).step_peak(one activation set)``."""
    rows = [
        "| ranks | variant | units | parameters | peak over base, MiB/rank | x theory | x (theory + act.) "
        "| x estimate | median step, s | init, s | init peak, MiB | save, s | load, s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["records"]:
        head = f"| {r['world']} | {r['name']} | {r.get('units', 'blocks')} | {r['params'] / 1e9:.3f}B |"
        if r["status"] != "ok":
            rows.append(head + f" {r['status']}: {r.get('reason') or r.get('error')} ||||||||")
            continue
        peak, act = r["train_peak_bytes"], r["activation_bytes"]
        rows.append(
            head + f" {peak / MIB:.0f} | {peak / r['theory_bytes']:.2f} | {peak / (r['theory_bytes'] + act):.2f} "
            f"| {peak / r['estimate_step_peak_bytes']:.2f} | {r['median_step_s']:.2f} "
            f"| {r['init_s']:.1f} | {r['init_peak_bytes'] / MIB:.0f} | {r['save_s']:.1f} | {_secs(r['load_s'])} |"
        )
    return "\n".join(rows) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in report["records"] if r["status"] == "ok"]
    labels = [f"{r['name']}\n{r['world']} ranks, {r['params'] / 1e9:.2f}B" for r in done]
    fig, (mem, step) = plt.subplots(1, 2, figsize=(13, 0.6 * len(done) + 2.5), sharey=True)
    y = range(len(done))
    mem.barh(y, [r["train_peak_bytes"] / GIB for r in done], label="measured peak over base")
    mem.scatter(
        [r["estimate_step_peak_bytes"] / GIB for r in done],
        y,
        color="black",
        marker="|",
        s=300,
        label="estimate_memory step_peak",
        zorder=3,
    )
    mem.scatter(
        [r["theory_bytes"] / GIB for r in done],
        y,
        color="red",
        marker="x",
        label="theory (16 B/param / shards)",
        zorder=3,
    )
    mem.set_yticks(list(y), labels)
    mem.set_xlabel("GiB per rank")
    mem.legend(loc="lower right", fontsize=8)
    step.barh(y, [r["median_step_s"] for r in done], color="tab:green")
    step.set_xlabel("median step, s")
    fig.suptitle(f"Scale benchmark through Lightning ({report['date']}, {report['machine']['cpus']} CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_traces(report: dict[str, Any], path: Path) -> bool:
    """Rank 0's private memory through training for every record with a trace (``--trace``), over its base;
    False when no record has one."""
    traced = [r for r in report["records"] if r.get("trace")]
    if not traced:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    for r in traced:
        trace = r["trace"][0]
        base = r["base_rss_bytes_per_rank"][0]
        t0 = trace["samples"][0][0]
        ax.plot(
            [t - t0 for t, _ in trace["samples"]],
            [(v - base) / GIB for _, v in trace["samples"]],
            label=f"{r['name']}, {r['units']} units",
            lw=1,
        )
    ax.axhline(traced[0]["theory_bytes"] / GIB, color="red", ls="--", lw=1, label="model-state theory")
    ax.set_xlabel("seconds from the first training step")
    ax.set_ylabel("RssAnon - base RSS, GiB (rank 0)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def merge(folders: list[Path], out: Path) -> dict[str, Any]:
    """One report of several runs' ``results.json`` (each variant run on its own, so that each holds the lock of a
    shared machine briefly): their records in the order given, each with its run's command and date."""
    reports = [json.loads((folder / "results.json").read_text()) for folder in folders]
    # A record merged before keeps its own run's command and date.
    records = [{"command": rep.get("command"), "date": rep["date"], **r} for rep in reports for r in rep["records"]]
    for record in records:
        if "estimate_step_peak_bytes" not in record and "estimate_training_peak_bytes" in record:  # older runs
            grads = record["estimate_training_peak_bytes"] - record["estimate_peak_bytes"]
            record["estimate_step_peak_bytes"] = record["estimate_peak_bytes"] + max(grads, record["activation_bytes"])
    for record in records:  # traces kept at 0.1 s, each bucket's highest sample (the peaks survive)
        for trace in record.get("trace") or []:
            buckets: dict[int, tuple[float, int]] = {}
            for t, v in trace["samples"]:
                key = int(t * 10)
                if key not in buckets or v > buckets[key][1]:
                    buckets[key] = (t, v)
            trace["samples"] = [buckets[k] for k in sorted(buckets)]
    report = {
        "runs": [rep.get("command") for rep in reports],
        "machine": reports[0]["machine"],
        "date": max(rep["date"] for rep in reports),
        "records": records,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(report))
    plot(report, out / "plot.png")
    plot_traces(report, out / "trace.png")
    return report


def main(argv: list[str] | None = None) -> None:
    defaults = ScaleConfig()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--params",
        type=parse_params,
        default="0.85B",
        help="model size, e.g. 0.85B, or per world size 2:0.85B,4:0.3B (default 0.85B)",
    )
    parser.add_argument("--world-sizes", type=lambda s: [int(x) for x in s.split(",")], default=defaults.world_sizes)
    parser.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=defaults.variants,
        help=f"comma-separated, of {','.join(VARIANT_NAMES)} (default all)",
    )
    for name in ("width", "heads", "vocab", "seq", "batch", "steps", "threads"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--memory-gib", type=float, default=None, help="memory the ranks may use (default: available)")
    parser.add_argument(
        "--units",
        choices=["blocks", "blocks+ends"],
        default=defaults.units,
        help="each Block a unit, or also the embedding and the head (default blocks)",
    )
    parser.add_argument("--pretrained", action="store_true", help="fsdp_custom: time load_pretrained of a file")
    parser.add_argument("--trace", action="store_true", help="sample each rank's private memory during training")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: a temporary one)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, help="merge these runs' results into --out")
    args = parser.parse_args(argv)
    if args.merge:
        if args.out is None:
            parser.error("--merge needs --out")
        print(markdown(merge(args.merge, args.out)))
        return
    unknown = [v for v in args.variants if v not in VARIANT_NAMES]
    if unknown:
        parser.error(f"--variants {','.join(unknown)} is not valid; choose from {','.join(VARIANT_NAMES)}")
    params = args.params if isinstance(args.params, dict) else {0: args.params}
    cfg = ScaleConfig(
        params=params,
        world_sizes=args.world_sizes,
        variants=args.variants,
        **{name: getattr(args, name) for name in ("width", "heads", "vocab", "seq", "batch", "steps", "threads")},
        memory_gib=args.memory_gib,
        trace=args.trace,
        units=args.units,
        pretrained=args.pretrained,
    )
    out = args.out or Path(tempfile.mkdtemp(prefix="lfsdp-scale-"))
    report = run_scale(cfg, out, say=lambda text: print(text, file=sys.stderr, flush=True))
    report["command"] = command_line("benchmarks.scale", argv)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    print(markdown(report))
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
