"""``python -m benchmarks --compile``: what torch.compile gains under each kind of data parallelism.

The same GPT is trained eager and with each Block compiled (``torch.compile(block)``, inductor by default, before the
model is wrapped: torchtitan's order) under four setups, all eight interleaved in one run of 2 gloo processes, one
step of each per round in rotated order on the same batch: each rank training alone (no communication: one
process's compute), torch DDP, torch FSDP2 (``fully_shard`` per Block, then the root) and fsdp_custom FULL_SHARD.
A step's time is the slowest rank's (zero_grad, forward, backward, optimizer step); the report gives medians over the
timed steps, the first step's time apart (it includes compilation), the speed-up compile gives each setup, and the
ratios the targets name, as ratios of medians.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._inductor.utils import fresh_cache

from benchmarks import BenchmarkConfig, _batch, _global_losses, _new_group, _step, _token_stream
from benchmarks.common import machine
from benchmarks.ranks import join_gloo_group, report_rank, run_ranks, write_json
from lightning_fsdp.shutdown import destroy_process_group

SETUPS = {
    "local": "each rank alone (no communication)",
    "ddp": "torch DDP",
    "fsdp2": "torch FSDP2 fully_shard",
    "custom": "fsdp_custom FULL_SHARD",
}
WORLD = 2
# The targets, as (numerator run, denominator run, bound): a ratio of median step times at most the bound.
TARGETS = (("custom+compiled", "ddp+compiled", 1.05), ("custom+compiled", "fsdp2+compiled", 0.9))
SPEEDUP_SHARE_TARGET = 0.95  # fsdp_custom's speed-up from compiling, at least this share of DDP's


def _wrap(setup: str, model: torch.nn.Module, group: dist.ProcessGroup) -> torch.nn.Module:
    from lightning_fsdp.demo.gpt import Block

    if setup == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=group)
    if setup == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif setup == "custom":
        from lightning_fsdp.engine import fully_shard

        fully_shard(model, process_group=group, auto_wrap_policy={Block})
    return model


def _build(setup: str, compiled: bool, cfg: BenchmarkConfig, backend: str, group: dist.ProcessGroup):
    from lightning_fsdp.demo.gpt import GPT

    torch.manual_seed(cfg.seed)
    model = GPT(cfg.gpt_config())
    if compiled:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = torch.compile(block, backend=backend)
    model = _wrap(setup, model, group)
    return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)


def _worker(rank: int, folder: str, cfg_dict: dict[str, Any], backend: str) -> None:
    import torch._functorch.config
    import torch._inductor.config

    # Compile time means compiling: no graph or kernel from an earlier run's on-disk caches.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    cfg = BenchmarkConfig(**cfg_dict)
    join_gloo_group(folder, rank, WORLD, threads=cfg.threads, timeout=cfg.collective_timeout)
    report_rank(folder, rank, lambda: _interleaved(rank, cfg, backend))


def _interleaved(rank: int, cfg: BenchmarkConfig, backend: str) -> dict[str, Any]:
    tokens = _token_stream(cfg.vocab)
    runs = {}
    for setup in SETUPS:
        for compiled in (False, True):
            group = _new_group(cfg)
            model, optimizer = _build(setup, compiled, cfg, backend, group)
            runs[f"{setup}+{'compiled' if compiled else 'eager'}"] = (model, optimizer, group, [], [])
    keys = list(runs)
    # Dynamo reuses one Block's graph across modules, so in the interleaved rounds only the first compiled run would
    # pay for compiling. Each run's first step is therefore taken alone, the compiled ones from an empty cache: that
    # step's time less the run's median is its compile time. The rounds then start from batch 1 for every run.
    # ``fresh_cache``: an empty on-disk cache and inductor's in-memory ones cleared, so that every compiled run builds
    # its C++ kernels too (without it, the runs after the first reuse the first one's).
    x, y = _batch(tokens, cfg, 0, rank, WORLD)
    for key in keys:
        model, optimizer, _, times, losses = runs[key]
        with fresh_cache() if key.endswith("+compiled") else contextlib.nullcontext():
            torch._dynamo.reset()
            seconds, loss = _step(model, optimizer, x, y)
        times.append(seconds)
        losses.append(loss)
    for step in range(1, 1 + cfg.warmup + cfg.steps):
        # "local" trains on this rank's share only, like the others; it just never communicates.
        x, y = _batch(tokens, cfg, step, rank, WORLD)
        shift = step % len(keys)
        for key in keys[shift:] + keys[:shift]:
            model, optimizer, _, times, losses = runs[key]
            seconds, loss = _step(model, optimizer, x, y)
            times.append(seconds)
            losses.append(loss)
        if rank == 0:
            print(f"[benchmark] compile round {step}/{cfg.warmup + cfg.steps}", file=sys.stderr, flush=True)
    control = _new_group(cfg)
    result = {}
    for key, (_, _, group, times, losses) in runs.items():
        result[key] = {"times": times, "losses": _global_losses(losses, control)}
        destroy_process_group(group)
    destroy_process_group(control)
    return result


def summarise(per_rank: list[dict[str, Any]], cfg: BenchmarkConfig) -> dict[str, Any]:
    """Rows per run (median step, first step, final loss), compile speed-ups per setup, and the targets."""
    rows = {}
    for key in per_rank[0]:
        per_step = [max(ts) for ts in zip(*(r[key]["times"] for r in per_rank))]
        timed = per_step[1 + cfg.warmup :]
        rows[key] = {
            "median_step_ms": statistics.median(timed) * 1e3,
            "first_step_s": per_step[0],
            "final_loss": per_rank[0][key]["losses"][-1],
        }
    speedups = {s: rows[f"{s}+eager"]["median_step_ms"] / rows[f"{s}+compiled"]["median_step_ms"] for s in SETUPS}
    for setup in SETUPS:
        compiled = rows[f"{setup}+compiled"]
        # Compilation's cost: the compiled run's first step beyond a compiled step's usual time.
        compiled["compile_s"] = compiled["first_step_s"] - compiled["median_step_ms"] / 1e3
    targets = [
        {
            "ratio": f"{a} / {b}",
            "value": rows[a]["median_step_ms"] / rows[b]["median_step_ms"],
            "bound": bound,
        }
        for a, b, bound in TARGETS
    ]
    targets.append(
        {"ratio": "custom speed-up / ddp speed-up", "value": speedups["custom"] / speedups["ddp"], "bound": None}
    )
    for target in targets:
        if target["bound"] is None:
            target["met"] = target["value"] >= SPEEDUP_SHARE_TARGET
            target["bound"] = f">= {SPEEDUP_SHARE_TARGET}"
        else:
            target["met"] = target["value"] <= target["bound"]
            target["bound"] = f"<= {target['bound']}"
    return {"rows": rows, "speedups": speedups, "targets": targets}


def markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"# torch.compile: eager and compiled step time ({results['backend']})",
        "",
        f"Command: `{results['command']}`. GPT {cfg['layers']} x {cfg['width']}, seq {cfg['seq']}, batch "
        f"{cfg['batch']} per rank, {WORLD} gloo processes, {cfg['threads']} thread each. Each run's first step "
        "alone (compiled runs from empty compile caches, on-disk ones off), then "
        f"{cfg['warmup']} warm-up and {cfg['steps']} timed rounds of the eight runs interleaved; a step's time is the "
        "slowest rank's; medians over the timed rounds. "
        f"torch {results['environment']['torch']}, {results['environment']['cpus']} CPUs.",
        "",
        "| setup | eager median ms | compiled median ms | speed-up | compiled first step s | compile s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rows = results["rows"]
    for setup, name in SETUPS.items():
        eager, compiled = rows[f"{setup}+eager"], rows[f"{setup}+compiled"]
        lines.append(
            f"| {name} | {eager['median_step_ms']:.1f} | {compiled['median_step_ms']:.1f} | "
            f"{results['speedups'][setup]:.2f}x | {compiled['first_step_s']:.1f} | {compiled['compile_s']:.1f} |"
        )
    lines += ["", "| target | measured | bound | met |", "| --- | --- | --- | --- |"]
    for target in results["targets"]:
        lines.append(f"| {target['ratio']} | {target['value']:.3f} | {target['bound']} | {target['met']} |")
    return "\n".join(lines) + "\n"


def run_compile_benchmark(cfg: BenchmarkConfig, out: str | Path | None, backend: str, command: str) -> dict[str, Any]:
    started = time.time()
    per_rank = run_ranks(
        _worker,
        lambda folder: (folder, asdict(cfg), backend),
        WORLD,
        threads=cfg.threads,
        timeout=cfg.variant_timeout * 4,
        name="compile benchmark",
    )
    results = {
        "command": command,
        "backend": backend,
        "config": asdict(cfg),
        **summarise(per_rank, cfg),
        "environment": machine(),
        "elapsed_s": time.time() - started,
    }
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "compile.json", results)
        (folder / "compile.md").write_text(markdown(results))
    return results
