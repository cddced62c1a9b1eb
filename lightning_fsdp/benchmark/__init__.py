"""Benchmark: fsdp_custom against torch's DDP, FSDP1 and FSDP2 on one GPT model, machine and batch.

``python -m lightning_fsdp.benchmark --out results/`` trains the same GPT (same seed, each ``Block`` a unit) with
every variant of :mod:`lightning_fsdp.benchmark.variants` in 2 gloo processes on CPU, each for ``warmup + steps``
timed steps and then for a short separately profiled run that measures memory, and runs fsdp_custom FULL_SHARD at
several world sizes to show how per-rank memory scales. It writes ``results.json``, ``results.md`` and
``plot.png`` into the output folder.

All variants of one world size run in one set of spawned processes (one fresh process group per variant, so a
failure in one cannot leave collectives pending for the next); a variant that raises is reported as failed with
its error; a process that dies or hangs is killed, its variant reported failed, and the rest rerun in new
processes.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_fsdp.benchmark.memory import (
    LIVE_BYTES_METHOD,
    MODEL_STATE_METHOD,
    CollectiveCounter,
    LiveTensorBytes,
    model_state_bytes,
)
from lightning_fsdp.benchmark.variants import REFERENCE, VARIANTS, engine_options, parse_variants

__all__ = ["BenchmarkConfig", "run_benchmark", "VARIANTS", "REFERENCE"]

# The number of processes every variant of the comparison runs with (the world-size scaling run is separate).
COMPARISON_WORLD_SIZE = 2


@dataclass
class BenchmarkConfig:
    """What to run. The defaults are the documented benchmark: GPT 6 x 512, vocab 65, block 128 (about 19M)."""

    layers: int = 6
    width: int = 512
    heads: int = 8
    seq: int = 128
    vocab: int = 65
    batch: int = 8  # sequences per rank per step
    steps: int = 10  # timed steps, after warmup
    warmup: int = 3
    mem_steps: int = 3  # steps of the separate, profiled memory run
    world_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    threads: int = 1  # torch intra-op threads per process
    lr: float = 1e-3
    seed: int = 0
    loss_rtol: float = 1e-4
    variant_timeout: float = 900.0  # seconds one variant may take before its processes are killed
    collective_timeout: float = 300.0  # gloo timeout of each process group

    def gpt_config(self) -> Any:
        from lightning_fsdp.gpt import GPTConfig

        return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers, n_head=self.heads,
                         n_embd=self.width, dropout=0.0)


# ------------------------------------------------------------------------------------------------ data
def _token_stream(vocab: int) -> torch.Tensor:
    """The bundled tiny-shakespeare text as character ids (its 62 characters fit any vocab >= 62)."""
    from lightning_fsdp.text_data import default_text_path

    text = default_text_path().read_text(encoding="utf-8")
    chars = sorted(set(text))
    if len(chars) > vocab:
        raise ValueError(f"vocab {vocab} is smaller than the {len(chars)} characters of the bundled text")
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long)


def _batch(tokens: torch.Tensor, cfg: BenchmarkConfig, step: int, rank: int, world: int):
    """Rank ``rank``'s share of step ``step``'s global batch (``batch * world`` windows drawn from a fixed seed)."""
    generator = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    starts = torch.randint(0, len(tokens) - cfg.seq - 1, (cfg.batch * world,), generator=generator)
    mine = starts[rank * cfg.batch : (rank + 1) * cfg.batch]
    windows = torch.stack([tokens[s : s + cfg.seq + 1] for s in mine.tolist()])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


# ----------------------------------------------------------------------------------------- one variant
def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[benchmark] {text}", file=sys.stderr, flush=True)


def _train(rank: int, world: int, key: str, cfg: BenchmarkConfig, tokens: torch.Tensor, *, steps: int,
           warmup: int, profiled: bool) -> dict[str, Any]:
    """Build, wrap and train one variant; time each step, or (``profiled``) measure live bytes and collectives."""
    from lightning_fsdp.gpt import GPT

    variant = VARIANTS[key]
    phase = "memory" if profiled else "timing"
    # The timed run carries no instrumentation at all; the profiled run measures bytes and counts collectives.
    live = LiveTensorBytes() if profiled else None
    counter = CollectiveCounter() if profiled else None
    result: dict[str, Any] = {}
    times: list[float] = []
    losses: list[float] = []
    with (live or _null()), (counter or _null()):
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.gpt_config())
        prepared = variant.setup(model)
        model = prepared.model
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        engine = prepared.engine
        with live.window() if live else _null():
            for step in range(warmup + steps):
                if step == warmup and engine is not None:
                    engine.shard_comm.stats.reset()
                if counter is not None:
                    counter.counting = step >= warmup
                x, y = _batch(tokens, cfg, step, rank, world)
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                _, loss = model(x, y)
                loss.backward()
                optimizer.step()
                elapsed = time.perf_counter() - start
                times.append(elapsed)
                losses.append(loss.detach().item())
                _say(rank, f"{variant.name} ws={world} {phase} step {step + 1}/{warmup + steps}"
                           f"{' (warmup)' if step < warmup else ''}: {elapsed * 1e3:.1f} ms, loss {losses[-1]:.5f}")
        if counter is not None:
            counter.counting = False
        result["model_state"] = model_state_bytes(model, optimizer)
        n = max(steps, 1)
        if engine is not None:
            stats = engine.shard_comm.stats
            result["comm_per_step"] = {"all_gather": stats.all_gather_bytes / n,
                                       "reduce_scatter": stats.reduce_scatter_bytes / n,
                                       "all_reduce": stats.all_reduce_bytes / n}
            result["comm_calls_per_step"] = {"all_gather": stats.all_gather_calls / n,
                                             "reduce_scatter": stats.reduce_scatter_calls / n,
                                             "all_reduce": stats.all_reduce_calls / n}
            result["peak_gathered_units"] = stats.peak_gathered_units
        elif counter is not None:
            result["comm_per_step"] = {k: v / n for k, v in counter.bytes.items()}
            result["comm_calls_per_step"] = {k: v / n for k, v in counter.calls.items()}
        result["notes"] = prepared.notes
        del model, prepared, optimizer, engine
    result["step_s"] = times[warmup:]
    result["warmup_s"] = times[:warmup]
    # Every rank had an equal share of the global batch, so the mean of the ranks' losses is the global loss.
    loss_tensor = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_tensor)
    result["losses"] = (loss_tensor / world).tolist()
    if live is not None:
        result["peak_live_bytes"] = live.peak
        result["live_at_start_bytes"] = live.at_window_start
        result["peak_live_overall_bytes"] = live.peak_overall
    gc.collect()
    return result


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _run_variant(rank: int, world: int, key: str, cfg: BenchmarkConfig, tokens: torch.Tensor,
                 timing: bool) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if timing:
        result["timing"] = _train(rank, world, key, cfg, tokens, steps=cfg.steps, warmup=cfg.warmup, profiled=False)
        gc.collect()
    result["memory"] = _train(rank, world, key, cfg, tokens, steps=cfg.mem_steps, warmup=0, profiled=True)
    return result


def _worker(rank: int, world: int, folder: str, keys: list[str], cfg_dict: dict[str, Any], timing: bool) -> None:
    cfg = BenchmarkConfig(**cfg_dict)
    torch.set_num_threads(cfg.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    tokens = _token_stream(cfg.vocab)
    for key in keys:
        if rank == 0:
            Path(folder, f"started-{key}").write_text(str(time.time()))
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-{key}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=cfg.collective_timeout))
        try:
            payload = {"status": "ok", **_run_variant(rank, world, key, cfg, tokens, timing)}
        except Exception as error:  # noqa: BLE001 - reported as a failed variant, the others still run
            payload = {"status": "failed", "error": f"{type(error).__name__}: {error}",
                       "traceback": traceback.format_exc()}
            _say(rank, f"{VARIANTS[key].name} ws={world} FAILED: {payload['error']}")
        finally:
            dist.destroy_process_group()
        Path(folder, f"result-{key}-rank{rank}.json").write_text(json.dumps(payload))
        gc.collect()


# ----------------------------------------------------------------------------------------- orchestration
def _run_group(world: int, keys: list[str], cfg: BenchmarkConfig, *, timing: bool) -> dict[str, list[dict]]:
    """Run ``keys`` in ``world`` spawned processes; per key, the per-rank payloads (or one failure payload)."""
    results: dict[str, list[dict]] = {}
    remaining = list(keys)
    env = {"OMP_NUM_THREADS": str(cfg.threads), "MKL_NUM_THREADS": str(cfg.threads), "KINETO_LOG_LEVEL": "5",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned children inherit it at start
    try:
        while remaining:
            with tempfile.TemporaryDirectory(prefix="lfsdp-bench-") as folder:
                context = mp.start_processes(_worker, args=(world, folder, remaining, asdict(cfg), timing),
                                             nprocs=world, start_method="spawn", join=False)
                problem = _wait(context, folder, remaining, cfg.variant_timeout)
                for key in list(remaining):
                    files = [Path(folder, f"result-{key}-rank{r}.json") for r in range(world)]
                    if not all(f.exists() for f in files):
                        break
                    results[key] = [json.loads(f.read_text()) for f in files]
                    remaining.remove(key)
                if remaining:
                    # The first unfinished variant killed or hung its processes: report it, run the rest afresh.
                    key = remaining.pop(0)
                    reason = problem or "processes exited before reporting"
                    results[key] = [{"status": "failed", "error": reason}]
                    print(f"[benchmark] {VARIANTS[key].name} ws={world} FAILED: {reason}", file=sys.stderr)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return results


def _wait(context: Any, folder: str, keys: list[str], variant_timeout: float) -> str | None:
    """Join the processes; kill them if one variant runs past ``variant_timeout``. Returns what went wrong, if."""
    while True:
        try:
            if context.join(timeout=1.0):
                return None
        except Exception as error:  # noqa: BLE001 - a rank died (signal) or raised outside a variant
            _kill(context)
            return f"process failed: {str(error).strip().splitlines()[0]}"
        started = [Path(folder, f"started-{k}") for k in keys]
        current = [p for p in started if p.exists()]
        if current:
            since = float(current[-1].read_text() or time.time())
            if time.time() - since > variant_timeout:
                _kill(context)
                return f"timed out after {variant_timeout:.0f} s"


def _kill(context: Any) -> None:
    for process in context.processes:
        if process.is_alive():
            process.kill()
    for process in context.processes:
        process.join(timeout=10)


def _summarise(key: str, payloads: list[dict], world: int, param_bytes: int) -> dict[str, Any]:
    variant = VARIANTS[key]
    row: dict[str, Any] = {"key": key, "name": variant.name, "world_size": world, "comm_source": variant.comm_source,
                           "theory_per_step": {k: v * param_bytes for k, v in variant.theory.items()}}
    failed = [p for p in payloads if p.get("status") != "ok"]
    if failed:
        row.update(status="failed", error=failed[0].get("error", "unknown error"),
                   traceback=failed[0].get("traceback"))
        return row
    row["status"] = "ok"
    memory = [p["memory"] for p in payloads]
    timing = [p["timing"] for p in payloads if "timing" in p]
    if timing:
        # A step ends for the job when its slowest rank is done: per-step max over ranks, then the median.
        per_step = [max(ts) for ts in zip(*(t["step_s"] for t in timing))]
        row["step_ms"] = [s * 1e3 for s in per_step]
        row["median_step_ms"] = statistics.median(per_step) * 1e3 if per_step else None
        row["min_step_ms"] = min(per_step) * 1e3 if per_step else None
        row["losses"] = timing[0]["losses"]
    else:
        row["losses"] = memory[0]["losses"]
    row["final_loss"] = row["losses"][-1] if row["losses"] else None
    row["model_state"] = [m["model_state"] for m in memory]
    row["peak_live_bytes"] = [m["peak_live_bytes"] for m in memory]
    row["live_at_start_bytes"] = [m["live_at_start_bytes"] for m in memory]
    # Collectives are counted in the profiled run (the timed one carries no instrumentation), per rank: every
    # rank of a symmetric collective moves the same.
    comm = dict(memory[0].get("comm_per_step") or {})
    if variant.comm_source == "theory":
        comm = {}
    # Report what was gathered (full-size output) rather than the shard sent, to compare with P directly.
    if comm:
        comm["all_gathered"] = comm.get("all_gather", 0) * world
    row["comm_per_step"] = comm or None
    row["comm_calls_per_step"] = memory[0].get("comm_calls_per_step") if comm else None
    if "peak_gathered_units" in memory[0]:
        row["peak_gathered_units"] = max(m["peak_gathered_units"] for m in memory)
    row["notes"] = memory[0].get("notes", {})
    return row


def run_benchmark(cfg: BenchmarkConfig, out: str | Path | None = None,
                  progress: Callable[[str], None] | None = None, command: str | None = None) -> dict[str, Any]:
    """Run the comparison and the scaling run; write results.json/.md and plot.png into ``out`` if given."""
    say = progress or (lambda text: print(f"[benchmark] {text}", file=sys.stderr, flush=True))
    from lightning_fsdp.gpt import GPT

    with torch.device("meta"):
        num_parameters = GPT(cfg.gpt_config()).num_parameters()
    param_bytes = num_parameters * 4  # float32
    started = time.time()
    say(f"GPT {cfg.layers} x {cfg.width}, {num_parameters:,} parameters ({param_bytes / 2**20:.1f} MiB); "
        f"variants {', '.join(cfg.variants)} at ws={COMPARISON_WORLD_SIZE}; scaling at ws={cfg.world_sizes}")

    rows = []
    payloads = _run_group(COMPARISON_WORLD_SIZE, cfg.variants, cfg, timing=True)
    for key in cfg.variants:
        row = _summarise(key, payloads[key], COMPARISON_WORLD_SIZE, param_bytes)
        rows.append(row)
        say(f"done {row['name']}: {row['status']}"
            + (f", median {row['median_step_ms']:.1f} ms" if row.get("median_step_ms") else ""))
    _compare(rows, cfg.loss_rtol)

    scaling = []
    for world in cfg.world_sizes:
        if world == COMPARISON_WORLD_SIZE and REFERENCE in payloads:
            row = _summarise(REFERENCE, payloads[REFERENCE], world, param_bytes)
        else:
            say(f"scaling run: {VARIANTS[REFERENCE].name} at ws={world}")
            row = _summarise(REFERENCE, _run_group(world, [REFERENCE], cfg, timing=False)[REFERENCE], world,
                             param_bytes)
        scaling.append(row)

    results = {
        "command": command,
        "config": asdict(cfg),
        "num_parameters": num_parameters,
        "param_bytes": param_bytes,
        "comparison_world_size": COMPARISON_WORLD_SIZE,
        "reference": REFERENCE,
        "variants": rows,
        "scaling": scaling,
        "methods": {"model_state": MODEL_STATE_METHOD, "peak_live": LIVE_BYTES_METHOD},
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "engine_options": engine_options(),
        },
        "elapsed_s": time.time() - started,
    }
    if out is not None:
        from lightning_fsdp.benchmark.report import write_report

        write_report(results, Path(out))
        say(f"wrote {Path(out) / 'results.md'}, results.json, plot.png")
    return results


def _compare(rows: list[dict], rtol: float) -> None:
    """Step-time ratios and final-loss agreement, both against the reference variant."""
    reference = next((r for r in rows if r["key"] == REFERENCE and r["status"] == "ok"), None)
    if reference is None:
        reference = next((r for r in rows if r["status"] == "ok"), None)
    for row in rows:
        if row["status"] != "ok" or reference is None:
            continue
        ref_ms, ms = reference.get("median_step_ms"), row.get("median_step_ms")
        row["ratio_to_reference"] = ms / ref_ms if ms and ref_ms else None
        ref_loss, loss = reference["final_loss"], row["final_loss"]
        diff = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
        row["loss_rel_diff"] = diff
        row["loss_agrees"] = bool(math.isfinite(diff) and diff <= rtol)
        row["reference_key"] = reference["key"]
