"""Gradient-reduction precision on the GPT: fp32 reductions, bf16 reductions, and bf16 on the wire summed in fp32.

``python -m benchmarks.reduce_precision --out DIR`` trains the demo GPT with the engine (FULL_SHARD,
each ``Block`` a unit, the root the rest) in a plain torch loop in ``--world-size`` gloo processes on CPU, one thread
each, as six variants in two groups (``MixedPrecision`` fields as passed to ``fully_shard``):

* bf16 compute (``param_dtype=torch.bfloat16``): ``reduce_dtype=float32`` (the group's reference),
  ``reduce_dtype=bfloat16``, and ``reduce_dtype=float32, reduce_wire_dtype=bfloat16`` (each rank's gradient cast to
  bf16, exchanged by an all-to-all, the N chunks of this rank's shard summed in fp32);
* fp32 compute (no ``param_dtype``): the same three reductions.

It writes ``results.json``, ``results.md`` and ``plot.png`` into ``--out``.

[Note: what the reduce-precision benchmark measures]
Every process holds all six variants, built from the same seed (the same initial weights), and every step runs one
step of each on the same batch (``batch`` tiny-shakespeare windows per rank, the main benchmark's ``_batch``), in an
order rotated from step to step, each variant on a process group of its own: load from other processes on a shared
machine then falls on every variant alike. AdamW over the shards (the fp32 master weights in both groups).

* **Reduction bytes / step**: the engine's ``CommStats`` (lightning_fsdp/engine/comm.py), the bytes this rank passes
  into the step's gradient reduction (``reduce_scatter_bytes``: a reduce-scatter's full-size input, or the full-size
  bf16 input of the wire variant's all-to-all), the difference of the counter across the step; its ratio to the
  group's reference.
* **Step time**: ``zero_grad`` + forward + backward + ``optimizer.step()``, ``time.perf_counter`` on each rank; per
  step the slowest rank's time; median over the steps after ``warmup``. Ratio to the group reference: ratio of the
  medians, and (in brackets) the median over steps of the per-step ratio (``report.paired_ratio``).
* **Step-0 gradient error**: after the first backward (identical weights and batch in every variant of a group, so
  the per-rank gradients are the same and only the reduction differs), before any update:
  ``||g_v - g_ref|| / ||g_ref||`` over every parameter's reduced, sharded ``.grad``, the per-rank squared norms
  summed over the ranks (float64 all-reduce).
* **Parameter distance**: every ``distance_every`` steps (and after the last), ``||theta_v - theta_ref|| /
  ||theta_ref||`` over all parameters (the shards; the per-rank squared norms summed over the ranks), against the
  group's reference after the same number of updates. For scale, the bf16-compute reference is also compared with
  the fp32-compute reference (what bf16 compute itself costs).
* **Loss**: the global batch's loss per step (the mean over ranks of each rank's share).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import ConfigOption, add_config_options, command_line, config_fields, gpt_config, machine
from benchmarks.ranks import join_gloo_group, report_rank, run_ranks
from benchmarks.report import fmt_bytes, label_bar, paired_ratio, save_figure, write_outputs
from lightning_fsdp.demo.gpt import GPTConfig

__all__ = ["ReducePrecisionConfig", "VARIANTS", "REFERENCES", "run_reduce_precision_benchmark", "main"]


@dataclass(frozen=True)
class Variant:
    key: str
    name: str
    compute: str  # "bf16" or "fp32": the group, whose reference is REFERENCES[compute]
    reduce_dtype: torch.dtype
    wire_dtype: torch.dtype | None = None

    def mixed_precision_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"reduce_dtype": self.reduce_dtype}
        if self.compute == "bf16":
            kwargs = {"param_dtype": torch.bfloat16, **kwargs}
        if self.wire_dtype is not None:
            kwargs["reduce_wire_dtype"] = self.wire_dtype
        return kwargs

    def mixed_precision_text(self) -> str:
        return "MixedPrecision(" + ", ".join(f"{k}={v}" for k, v in self.mixed_precision_kwargs().items()) + ")"


BF16, FP32 = torch.bfloat16, torch.float32
VARIANTS: dict[str, Variant] = {
    v.key: v
    for v in (
        Variant("bf16c_fp32", "bf16 compute, fp32 reduce (reference)", "bf16", FP32),
        Variant("bf16c_bf16", "bf16 compute, bf16 reduce", "bf16", BF16),
        Variant("bf16c_wire", "bf16 compute, bf16 wire + fp32 sum", "bf16", FP32, BF16),
        Variant("fp32c_fp32", "fp32 compute, fp32 reduce (reference)", "fp32", FP32),
        Variant("fp32c_bf16", "fp32 compute, bf16 reduce", "fp32", BF16),
        Variant("fp32c_wire", "fp32 compute, bf16 wire + fp32 sum", "fp32", FP32, BF16),
    )
}
REFERENCES = {"bf16": "bf16c_fp32", "fp32": "fp32c_fp32"}
# For scale: the bf16-compute reference against the fp32-compute one (bf16 compute's own effect).
SCALE_PAIR = ("bf16c_fp32", "fp32c_fp32")


@dataclass
class ReducePrecisionConfig:
    """What to run. The defaults are the documented run: GPT 4 x 128, seq 64, 4 sequences per rank, 4 ranks."""

    world_size: int = 4
    layers: int = 4
    width: int = 128
    heads: int = 4
    seq: int = 64
    vocab: int = 65
    batch: int = 4  # sequences per rank per step
    steps: int = 300  # training steps, warmup included
    warmup: int = 5  # first steps left out of the step-time median
    distance_every: int = 10
    lr: float = 1e-3
    seed: int = 0
    threads: int = 1
    timeout: float = 1800.0  # seconds the whole run may take before its processes are killed
    collective_timeout: float = 300.0

    def gpt_config(self) -> GPTConfig:
        return gpt_config(self)

    def check(self) -> None:
        for name in ("world_size", "layers", "width", "heads", "seq", "batch", "steps", "distance_every", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.world_size < 2:
            raise ValueError("world_size must be >= 2: with one rank there is nothing to reduce")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup} must be >= 0 and below steps={self.steps}")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")
        if self.vocab < 62:
            raise ValueError(f"vocab={self.vocab} must be >= 62 (the bundled text's characters)")


# ------------------------------------------------------------------------------------------------ worker
def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[reduce-precision] {text}", file=sys.stderr, flush=True)


def _reduction_bytes(stats: Any) -> int:
    """Bytes passed into gradient reductions so far (the wire reduction's all-to-all counts as a reduce-scatter)."""
    return int(stats.reduce_scatter_bytes)


class _Run:
    """One variant on this rank: the sharded GPT, its engine, its optimizer and what it recorded."""

    def __init__(self, key: str, cfg: ReducePrecisionConfig, group: dist.ProcessGroup) -> None:
        from lightning_fsdp import MixedPrecision
        from lightning_fsdp.demo.gpt import GPT, Block
        from lightning_fsdp.engine import fully_shard

        self.key = key
        self.group = group
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg.gpt_config())
        mixed = MixedPrecision(**VARIANTS[key].mixed_precision_kwargs())
        self.engine = fully_shard(
            self.model,
            process_group=group,
            sharding_strategy="FULL_SHARD",
            auto_wrap_policy={Block},
            mixed_precision=mixed,
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.times: list[float] = []
        self.losses: list[float] = []
        self.reduction_bytes: list[int] = []
        self.grads0: dict[str, torch.Tensor] | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor, keep_grads: bool) -> None:
        """One step; the clock covers zero_grad, forward, backward and the optimizer step (not the gradient copy)."""
        stats = self.engine.shard_comm.stats
        before = _reduction_bytes(stats)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = self.model(x, y)
        loss.backward()
        paused = time.perf_counter()
        if keep_grads:
            self.grads0 = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        resumed = time.perf_counter()
        self.optimizer.step()
        self.times.append(time.perf_counter() - start - (resumed - paused))
        self.losses.append(loss.detach().item())
        self.reduction_bytes.append(_reduction_bytes(stats) - before)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}


def _relative_distance(
    mine: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], control: dist.ProcessGroup
) -> float:
    """``||a - b|| / ||b||`` over every named tensor of every rank (each rank holds its shards)."""
    sums = torch.zeros(2, dtype=torch.float64)
    for name, ref in reference.items():
        ref64 = ref.double()
        other = mine.get(name)
        diff = ref64 if other is None else other.double() - ref64
        sums[0] += diff.square().sum()
        sums[1] += ref64.square().sum()
    dist.all_reduce(sums, group=control)
    num, den = sums.tolist()
    return math.sqrt(num) / math.sqrt(den) if den > 0 else float("nan")


def _distances(runs: dict[str, _Run], control: dist.ProcessGroup) -> dict[str, float]:
    out = {}
    for key, run in runs.items():
        reference = runs.get(REFERENCES[VARIANTS[key].compute])
        if reference is not None:
            out[key] = _relative_distance(run.params(), reference.params(), control)
    a, b = SCALE_PAIR
    if a in runs and b in runs:
        out["scale"] = _relative_distance(runs[a].params(), runs[b].params(), control)
    return out


def _train(rank: int, world: int, cfg: ReducePrecisionConfig, tokens: torch.Tensor) -> dict[str, Any]:
    from benchmarks import _batch, _global_losses, _new_group
    from lightning_fsdp.shutdown import destroy_process_group

    control = _new_group(cfg)
    runs: dict[str, _Run] = {}
    unavailable: dict[str, str] = {}
    for key in VARIANTS:
        group = _new_group(cfg)
        try:
            runs[key] = _Run(key, cfg, group)
        except (TypeError, ValueError) as error:
            # Raised while checking the options (the same on every rank, before any collective): e.g. an engine
            # without reduce_wire_dtype. Reported; the other variants go on.
            unavailable[key] = f"{type(error).__name__}: {error}"
            _say(rank, f"{key} unavailable: {unavailable[key]}")
            destroy_process_group(group)
    keys = list(runs)
    distance_steps: list[int] = []
    distances: dict[str, list[float]] = {}
    grad_error: dict[str, float] = {}
    started = time.time()
    for step in range(cfg.steps):
        x, y = _batch(tokens, cfg, step, rank, world)
        shift = step % max(len(keys), 1)
        for key in keys[shift:] + keys[:shift]:
            runs[key].step(x, y, keep_grads=step == 0)
        if step == 0:
            grads = {k: r.grads0 or {} for k, r in runs.items()}
            for key in keys:
                ref = REFERENCES[VARIANTS[key].compute]
                if ref in grads:
                    grad_error[key] = _relative_distance(grads[key], grads[ref], control)
            a, b = SCALE_PAIR
            if a in grads and b in grads:
                grad_error["scale"] = _relative_distance(grads[a], grads[b], control)
            for run in runs.values():
                run.grads0 = None
        if (step + 1) % cfg.distance_every == 0 or step + 1 == cfg.steps:
            distance_steps.append(step + 1)
            for key, value in _distances(runs, control).items():
                distances.setdefault(key, []).append(value)
        if step < 3 or (step + 1) % 25 == 0 or step + 1 == cfg.steps:
            _say(
                rank,
                f"step {step + 1}/{cfg.steps} ({time.time() - started:.0f} s): "
                + ", ".join(f"{k} {runs[k].times[-1] * 1e3:.0f} ms loss {runs[k].losses[-1]:.4f}" for k in keys),
            )
    variants: dict[str, Any] = {}
    for key in VARIANTS:
        if key in unavailable:
            variants[key] = {"status": "unavailable", "error": unavailable[key]}
            continue
        run = runs.pop(key)
        stats = run.engine.shard_comm.stats
        variants[key] = {
            "status": "ok",
            "step_s": run.times,
            "losses": _global_losses(run.losses, control),
            "reduction_bytes": run.reduction_bytes,
            "comm_stats_total": {k: v for k, v in asdict(stats).items() if isinstance(v, int)},
        }
        destroy_process_group(run.group)
        del run
    destroy_process_group(control)
    return {
        "variants": variants,
        "distance_steps": distance_steps,
        "distances": distances,
        "grad_error_step0": grad_error,
    }


def _worker(rank: int, world: int, folder: str, cfg_dict: dict[str, Any]) -> None:
    from benchmarks import _token_stream

    cfg = ReducePrecisionConfig(**cfg_dict)
    join_gloo_group(folder, rank, world, threads=cfg.threads, timeout=cfg.collective_timeout)
    report_rank(folder, rank, lambda: _train(rank, world, cfg, _token_stream(cfg.vocab)))


def _run_processes(cfg: ReducePrecisionConfig) -> list[dict[str, Any]]:
    return run_ranks(
        _worker,
        lambda folder: (cfg.world_size, folder, asdict(cfg)),
        cfg.world_size,
        threads=cfg.threads,
        timeout=cfg.timeout,
        name="reduce-precision benchmark",
    )


# ----------------------------------------------------------------------------------------------- summary
def _summarise(key: str, ranks: list[dict[str, Any]], cfg: ReducePrecisionConfig) -> dict[str, Any]:
    spec = VARIANTS[key]
    row: dict[str, Any] = {
        "key": key,
        "name": spec.name,
        "compute": spec.compute,
        "reference_key": REFERENCES[spec.compute],
        "mixed_precision": spec.mixed_precision_text(),
    }
    parts = [r["variants"][key] for r in ranks]
    if parts[0]["status"] != "ok":
        row.update(status=parts[0]["status"], error=parts[0].get("error"))
        return row
    row["status"] = "ok"
    per_step = [max(ts) for ts in zip(*(p["step_s"] for p in parts))]
    row["step_ms"] = [s * 1e3 for s in per_step[cfg.warmup :]]
    row["warmup_step_ms"] = [s * 1e3 for s in per_step[: cfg.warmup]]
    row["median_step_ms"] = statistics.median(row["step_ms"])
    row["losses"] = parts[0]["losses"]
    row["final_loss"] = row["losses"][-1]
    per_rank_bytes = [p["reduction_bytes"] for p in parts]
    row["reduction_bytes_per_step"] = max(max(b) for b in per_rank_bytes)
    # FULL_SHARD reduces every unit once per step and every rank passes the same full-size input.
    row["reduction_bytes_constant"] = len({b for rank_bytes in per_rank_bytes for b in rank_bytes}) == 1
    steps = len(per_step)
    row["comm_per_step"] = {k: v / steps for k, v in parts[0]["comm_stats_total"].items()}
    row["grad_error_step0"] = ranks[0]["grad_error_step0"].get(key)
    row["param_distance"] = ranks[0]["distances"].get(key)
    row["final_param_distance"] = row["param_distance"][-1] if row["param_distance"] else None
    return row


def _compare(rows: list[dict[str, Any]]) -> None:
    by_key = {r["key"]: r for r in rows}
    for row in rows:
        ref = by_key.get(row["reference_key"])
        if row["status"] != "ok" or ref is None or ref["status"] != "ok":
            continue
        row["reduction_bytes_ratio"] = row["reduction_bytes_per_step"] / ref["reduction_bytes_per_step"]
        row["step_ratio"] = row["median_step_ms"] / ref["median_step_ms"]
        row["paired_step_ratio"] = paired_ratio(row, ref)
        row["final_loss_diff"] = row["final_loss"] - ref["final_loss"]
        diffs = [abs(a - b) for a, b in zip(row["losses"], ref["losses"])]
        tail = diffs[-max(1, len(diffs) // 10) :]
        row["mean_abs_loss_diff_last_10pct"] = statistics.fmean(tail)


def run_reduce_precision_benchmark(
    cfg: ReducePrecisionConfig, out: str | Path | None = None, command: str | None = None
) -> dict[str, Any]:
    """Run the six variants (see the module docstring); write results.json/.md and plot.png into ``out`` if given."""
    from lightning_fsdp.demo.gpt import GPT

    cfg.check()
    with torch.device("meta"):
        num_parameters = GPT(cfg.gpt_config()).num_parameters()
    print(
        f"[reduce-precision] GPT {cfg.layers} x {cfg.width}, {num_parameters:,} parameters; {cfg.world_size} gloo "
        f"processes, batch {cfg.batch} x {cfg.seq} per rank, {cfg.steps} steps; variants {', '.join(VARIANTS)}",
        file=sys.stderr,
        flush=True,
    )
    started = time.time()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ranks = _run_processes(cfg)
    rows = [_summarise(key, ranks, cfg) for key in VARIANTS]
    _compare(rows)
    results = {
        "command": command,
        "date": date,
        "config": asdict(cfg),
        "model": "demo GPT (lightning_fsdp.demo.gpt.GPT, tied lm_head), FULL_SHARD, each Block a unit",
        "num_parameters": num_parameters,
        "world_size": cfg.world_size,
        "references": REFERENCES,
        "variants": rows,
        "distance_steps": ranks[0]["distance_steps"],
        "scale": {
            "pair": list(SCALE_PAIR),
            "grad_error_step0": ranks[0]["grad_error_step0"].get("scale"),
            "param_distance": ranks[0]["distances"].get("scale"),
        },
        "methods": METHODS,
        "environment": machine(),
        "elapsed_s": time.time() - started,
    }
    if out is not None:
        write_report(results, Path(out))
    return results


METHODS = {
    "reduction_bytes": "the engine's CommStats.reduce_scatter_bytes (the bytes this rank passes into the step's "
    "gradient reductions: a reduce-scatter's full-size input, or the wire variant's full-size bf16 all-to-all "
    "input; padding and used-flags included), the counter's difference across each step; ratio to the group's fp32 "
    "reduction",
    "step_time": "zero_grad + forward + backward + optimizer.step, time.perf_counter on each rank; per step the "
    "slowest rank; median over the steps after warmup; all six variants interleaved step by step on the same batch, "
    "order rotated each step, each on its own process group. Ratio: ratio of medians (in brackets: median of the "
    "per-step ratios to the reference's step in the same round)",
    "grad_error_step0": "after the first backward, before any update (identical weights and batch in a group): "
    "||g_v - g_ref|| / ||g_ref|| over every parameter's reduced, sharded .grad (float32), squared norms summed over "
    "the ranks in float64",
    "param_distance": "||theta_v - theta_ref|| / ||theta_ref|| over all parameters (the fp32 shards), squared norms "
    "summed over the ranks in float64, after the same number of updates",
    "loss": "the global batch's loss per step (mean over ranks of each rank's share), computed in float32",
}


# ------------------------------------------------------------------------------------------------ report
def _sci(value: float | None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return "0" if value == 0 else f"{value:.2e}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def markdown(results: dict[str, Any]) -> str:
    cfg, env, rows = results["config"], results["environment"], results["variants"]
    methods = results["methods"]
    steps = results["distance_steps"]
    lines = [
        "# Gradient-reduction precision: fp32, bf16, and bf16 on the wire summed in fp32",
        "",
        *([f"`{results['command']}`", ""] if results.get("command") else []),
        f"{results['model']}: n_layer={cfg['layers']} n_embd={cfg['width']} n_head={cfg['heads']} seq={cfg['seq']} "
        f"vocab={cfg['vocab']}, {results['num_parameters']:,} parameters. {results['world_size']} gloo processes "
        f"on CPU, {cfg['threads']} thread(s) each; batch {cfg['batch']} sequences per rank (tiny-shakespeare "
        f"windows, the same for every variant); AdamW(lr={cfg['lr']}); seed {cfg['seed']}; {cfg['steps']} steps, "
        f"the first {cfg['warmup']} left out of the step-time median. torch {env['torch']}, {env['cpus']} CPUs "
        f"(a machine shared with other work). {results['date']}; elapsed {results['elapsed_s']:.0f} s.",
        "",
        "| Variant | `MixedPrecision` | Reduction bytes / step (vs ref) | Median step ms (vs ref) "
        "| Step-0 gradient error vs ref | Parameter distance vs ref after "
        f"{steps[-1] if steps else 'n/a'} steps | Final loss (minus ref) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row["status"] != "ok":
            error = str(row.get("error", "")).replace("|", "\\|").replace("\n", " ")[:200]
            lines.append(f"| {row['name']} | `{row['mixed_precision']}` | **{row['status']}**: {error} | | | | |")
            continue
        diff = row.get("final_loss_diff")
        lines.append(
            f"| {row['name']} | `{row['mixed_precision']}` "
            f"| {fmt_bytes(row['reduction_bytes_per_step'])} ({_ratio(row.get('reduction_bytes_ratio'))}) "
            f"| {row['median_step_ms']:.1f} ({_ratio(row.get('step_ratio'))}; "
            f"{_ratio(row.get('paired_step_ratio'))}) "
            f"| {_sci(row['grad_error_step0'])} | {_sci(row['final_param_distance'])} "
            f"| {row['final_loss']:.4f} ({'n/a' if diff is None else f'{diff:+.4f}'}) |"
        )
    scale = results["scale"]
    lines += [
        "",
        f"For scale, bf16 compute itself: the bf16-compute reference against the fp32-compute one has step-0 "
        f"gradient error {_sci(scale['grad_error_step0'])} and parameter distance "
        f"{_sci(scale['param_distance'][-1] if scale['param_distance'] else None)} after "
        f"{steps[-1] if steps else 'n/a'} steps.",
        "",
        "## Parameter distance to the group's fp32 reduction, by step",
        "",
    ]
    ok = [r for r in rows if r["status"] == "ok" and r["key"] != r["reference_key"]]
    shown = [i for i, s in enumerate(steps) if s % 50 == 0 or i == len(steps) - 1 or i == 0]
    lines.append("| Step | " + " | ".join(r["name"] for r in ok) + " | bf16 vs fp32 compute (scale) |")
    lines.append("|---:|" + "---:|" * (len(ok) + 1))
    for i in shown:
        scale_cell = _sci(scale["param_distance"][i]) if scale["param_distance"] else "n/a"
        lines.append(f"| {steps[i]} | " + " | ".join(_sci(r["param_distance"][i]) for r in ok) + f" | {scale_cell} |")
    lines += [
        "",
        f"Every {cfg['distance_every']} steps in results.json (`variants[].param_distance`, steps in "
        "`distance_steps`).",
        "",
        "## How each figure is measured",
        "",
        f"- **Reduction bytes / step**: {methods['reduction_bytes']}.",
        f"- **Median step**: {methods['step_time']}.",
        f"- **Step-0 gradient error**: {methods['grad_error_step0']}.",
        f"- **Parameter distance**: {methods['param_distance']}.",
        f"- **Loss**: {methods['loss']}; the final step's, and its difference to the group reference's.",
        "",
    ]
    return "\n".join(lines)


_STYLE = {
    "bf16c_bf16": ("tab:red", "-"),
    "bf16c_wire": ("tab:blue", "-"),
    "fp32c_bf16": ("tab:red", "--"),
    "fp32c_wire": ("tab:blue", "--"),
    "bf16c_fp32": ("tab:gray", "-"),
    "fp32c_fp32": ("black", "--"),
}


def plot(results: dict[str, Any], path: Path) -> None:
    """Parameter distance to the fp32 reduction (log y), loss curves, reduction bytes and step time per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["variants"] if r["status"] == "ok"]
    steps = results["distance_steps"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))

    ax = axes[0][0]
    for row in rows:
        if row["key"] == row["reference_key"]:
            continue
        color, style = _STYLE.get(row["key"], (None, "-"))
        values = [v if v > 0 else float("nan") for v in row["param_distance"]]  # 0 has no place on a log axis
        ax.plot(steps, values, style, color=color, label=row["name"])
    scale = results["scale"]["param_distance"]
    if scale:
        ax.plot(steps, scale, ":", color="tab:green", label="bf16 vs fp32 compute, both fp32 reduce (scale)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("||theta - theta_ref|| / ||theta_ref||")
    ax.set_title("Parameter distance to the same compute's fp32 reduction")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    for row in rows:
        color, style = _STYLE.get(row["key"], (None, "-"))
        ax.plot(range(1, len(row["losses"]) + 1), row["losses"], style, color=color, label=row["name"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("global-batch loss")
    ax.set_title("Loss (same batches for every variant)")
    ax.legend(fontsize=8)

    names = [r["name"].replace(", ", ",\n").replace(" (reference)", "\n(ref)") for r in rows]
    colors = [_STYLE.get(r["key"], ("tab:gray", "-"))[0] for r in rows]
    x = list(range(len(rows)))

    ax = axes[1][0]
    kib = [r["reduction_bytes_per_step"] / 2**10 for r in rows]
    bars = ax.bar(x, kib, color=colors)
    for bar, row in zip(bars, rows):
        label_bar(ax, bar, _ratio(row.get("reduction_bytes_ratio")))
    ax.set_xticks(x, names, fontsize=7)
    ax.set_ylabel("KiB into gradient reductions per rank per step")
    ax.margins(y=0.12)
    ax.set_title("Reduction bytes per step (engine CommStats), vs the group's fp32 reduction")

    ax = axes[1][1]
    ms = [r["median_step_ms"] for r in rows]
    bars = ax.bar(x, ms, color=colors)
    for bar, row in zip(bars, rows):
        label_bar(ax, bar, f"{row['median_step_ms']:.0f}\n{_ratio(row.get('step_ratio'))}")
    ax.set_xticks(x, names, fontsize=7)
    ax.set_ylabel("median step time (ms), slowest rank per step")
    ax.margins(y=0.15)
    ax.set_title("Step time (interleaved, shared 2-core machine)")

    cfg = results["config"]
    save_figure(
        fig,
        f"GPT {cfg['layers']}x{cfg['width']} ({results['num_parameters']:,} parameters), {results['world_size']} "
        f"gloo processes, batch {cfg['batch']}x{cfg['seq']} per rank, {cfg['steps']} steps, torch "
        f"{results['environment']['torch']}",
        path,
    )


def write_report(results: dict[str, Any], out: Path) -> None:
    write_outputs(results, out, markdown(results), plot)


# --------------------------------------------------------------------------------------------------- CLI
_CONFIG_OPTIONS: tuple[ConfigOption, ...] = (
    ("world_size", int, "gloo processes (>= 2)"),
    ("layers", int, "GPT n_layer"),
    ("width", int, "GPT n_embd"),
    ("heads", int, "GPT n_head"),
    ("seq", int, "sequence length (= block_size)"),
    ("vocab", int, "vocabulary size, >= 62"),
    ("batch", int, "sequences per rank per step"),
    ("steps", int, "training steps, warmup included"),
    ("warmup", int, "first steps left out of the step-time median"),
    ("distance_every", int, "steps between parameter-distance measurements"),
    ("lr", float, "AdamW learning rate"),
    ("seed", int, "model and data seed"),
    ("threads", int, "torch threads per process"),
    ("timeout", float, "seconds before the processes are killed"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.reduce_precision",
        description="Train the demo GPT with the engine (FULL_SHARD) in gloo processes on CPU with fp32 gradient "
        "reductions, bf16 reductions, and bf16 on the wire summed in fp32, under bf16 and fp32 compute, interleaved "
        "step by step; report reduction bytes, step time, the step-0 gradient error and the parameter distance to "
        "the fp32 reduction, and losses.",
    )
    add_config_options(parser, ReducePrecisionConfig(), _CONFIG_OPTIONS)
    parser.add_argument("--out", default="reduce-precision-results", help="output folder (default %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = ReducePrecisionConfig(**config_fields(args, _CONFIG_OPTIONS))
    try:
        cfg.check()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    command = command_line("benchmarks.reduce_precision", argv)
    results = run_reduce_precision_benchmark(cfg, out=args.out, command=command)
    missing = [r["name"] for r in results["variants"] if r["status"] != "ok"]
    print(f"results in {args.out}/results.md" + (f"; not run: {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
