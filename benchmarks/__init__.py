"""Benchmark: fsdp_custom against torch's DDP, FSDP1 and FSDP2 on one GPT model, machine and batch.

``python -m benchmarks --out results/`` trains the same GPT (same seed, each ``Block`` a unit) with
every variant of :mod:`benchmarks.variants` in 2 gloo processes on CPU, each for ``warmup + steps``
timed steps and then for a short separately profiled run that measures memory. The scaling run then times and
measures ``scaling_variants`` (fsdp_custom FULL_SHARD and its baseline, torch DDP) interleaved in the same way at
each of ``world_sizes``, batch per rank fixed, to show how step time and per-rank memory scale. It writes
``results.json``, ``results.md`` and ``plot.png`` into the output folder.

Timing interleaves the variants: every process builds all of them (same seed, so the same initial weights), then
each step runs one step of every variant on the same batch, in an order rotated from step to step. Other load on a
shared machine then slows every variant alike instead of whichever happened to run at the time, which is what makes
the ratios meaningful here. Each variant has its own process group, so its collectives never meet another's. Memory
is measured afterwards, one variant at a time, in a profiled run of ``mem_steps`` steps.

A variant that raises is reported as failed with its error, and the others go on (the ranks agree after every
step on which variants are still alive); a process that dies or hangs is killed and the rest rerun in new
processes.
"""

from __future__ import annotations

import gc
import json
import math
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

from benchmarks.common import gpt_config, machine
from benchmarks.memory import (
    LIVE_BYTES_METHOD,
    MODEL_STATE_METHOD,
    CollectiveCounter,
    LiveTensorBytes,
    model_state_bytes,
)
from benchmarks.ranks import environment, join_gloo_group, quiet_env, spawn_ranks, wait_ranks, write_json
from benchmarks.report import paired_ratio
from benchmarks.variants import REFERENCE, VARIANTS, engine_options
from lightning_fsdp.shutdown import destroy_process_group

__all__ = ["BenchmarkConfig", "run_benchmark", "VARIANTS", "REFERENCE", "SCALING_BASELINE"]

# The number of processes every variant of the comparison runs with (the world-size scaling run is separate).
COMPARISON_WORLD_SIZE = 2
# The scaling run's step-time ratios are taken against this variant (replicated, so its model state never falls).
SCALING_BASELINE = "ddp"


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
    # Run interleaved at each of world_sizes, whatever ``variants`` holds.
    scaling_variants: list[str] = field(default_factory=lambda: [REFERENCE, SCALING_BASELINE])
    threads: int = 1  # torch intra-op threads per process
    lr: float = 1e-3
    seed: int = 0
    loss_rtol: float = 1e-4
    variant_timeout: float = 900.0  # seconds one variant may take before its processes are killed
    collective_timeout: float = 300.0  # gloo timeout of each process group

    def gpt_config(self) -> Any:
        return gpt_config(self)


# ------------------------------------------------------------------------------------------------ data
def _token_stream(vocab: int) -> torch.Tensor:
    """The bundled tiny-shakespeare text as character ids (its 62 characters fit any vocab >= 62)."""
    from lightning_fsdp.demo.data import default_text_path

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


def _new_group(cfg: BenchmarkConfig) -> dist.ProcessGroup:
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.collective_timeout))


def _build(key: str, cfg: BenchmarkConfig, group: dist.ProcessGroup) -> tuple[Any, torch.optim.Optimizer]:
    from lightning_fsdp.demo.gpt import GPT

    torch.manual_seed(cfg.seed)
    prepared = VARIANTS[key].setup(GPT(cfg.gpt_config()), group)
    return prepared, torch.optim.AdamW(prepared.model.parameters(), lr=cfg.lr)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    """One training step; returns (seconds, loss). The clock covers zero_grad, forward, backward and step."""
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start, loss.detach().item()


def _global_losses(losses: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    # Every rank had an equal share of the global batch, so the mean of the ranks' losses is the global loss.
    # Callers pass a group that outlives the next destroy_process_group: freeing this temporary tensor can fall to
    # a gloo worker thread, which then races the destroy (see lightning_fsdp/shutdown.py).
    tensor = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return (tensor / dist.get_world_size(group)).tolist()


def _failure(error: BaseException) -> dict[str, Any]:
    return {
        "status": "failed",
        "error": f"{type(error).__name__}: {error}".strip(),
        "traceback": traceback.format_exc(),
    }


class _Interleaved:
    """All variants side by side in this process; one step of each per round, rotated order, same batch."""

    def __init__(self, rank: int, world: int, keys: list[str], cfg: BenchmarkConfig) -> None:
        self.rank, self.world, self.keys, self.cfg = rank, world, keys, cfg
        self.control = _new_group(cfg)
        self.runs: dict[str, dict[str, Any]] = {}
        self.results: dict[str, dict[str, Any]] = {}

    def _agree(self) -> None:
        """Drop, on every rank, the variants that failed on any rank (so later steps issue matching collectives)."""
        failed = torch.tensor(
            [1.0 if k in self.results and self.results[k]["status"] == "failed" else 0.0 for k in self.keys]
        )
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.control)
        for key, flag in zip(self.keys, failed.tolist()):
            if flag and key in self.runs:
                run = self.runs.pop(key)
                self.results.setdefault(key, {"status": "failed", "error": "failed on another rank"})
                try:
                    destroy_process_group(run["group"])
                except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly; it is dropped anyway
                    pass

    def run(self, tokens: torch.Tensor) -> dict[str, dict[str, Any]]:
        cfg = self.cfg
        for key in self.keys:
            group = _new_group(cfg)
            try:
                prepared, optimizer = _build(key, cfg, group)
                self.runs[key] = {
                    "prepared": prepared,
                    "optimizer": optimizer,
                    "group": group,
                    "times": [],
                    "losses": [],
                }
            except Exception as error:  # noqa: BLE001 - reported as a failed variant; the others go on
                self.results[key] = _failure(error)
                _say(self.rank, f"{VARIANTS[key].name} ws={self.world} FAILED in setup: {self.results[key]['error']}")
        self._agree()
        total = cfg.warmup + cfg.steps
        for step in range(total):
            x, y = _batch(tokens, cfg, step, self.rank, self.world)
            order = [k for k in self.keys if k in self.runs]
            shift = step % max(len(order), 1)
            for key in order[shift:] + order[:shift]:
                run = self.runs[key]
                try:
                    seconds, loss = _step(run["prepared"].model, run["optimizer"], x, y)
                except Exception as error:  # noqa: BLE001
                    self.results[key] = _failure(error)
                    _say(
                        self.rank,
                        f"{VARIANTS[key].name} ws={self.world} FAILED at step {step + 1}: {self.results[key]['error']}",
                    )
                    continue
                run["times"].append(seconds)
                run["losses"].append(loss)
            self._agree()
            done = ", ".join(f"{k} {self.runs[k]['times'][-1] * 1e3:.0f} ms" for k in self.keys if k in self.runs)
            _say(
                self.rank,
                f"ws={self.world} timing step {step + 1}/{total}{' (warmup)' if step < cfg.warmup else ''}: {done}",
            )
        for key in list(self.runs):
            run = self.runs.pop(key)
            prepared, optimizer = run["prepared"], run["optimizer"]
            self.results[key] = {
                "status": "ok",
                "step_s": run["times"][cfg.warmup :],
                "warmup_s": run["times"][: cfg.warmup],
                "losses": _global_losses(run["losses"], self.control),
                "model_state": model_state_bytes(prepared.model, optimizer),
            }
            destroy_process_group(run["group"])
            del run, prepared, optimizer
        destroy_process_group(self.control)
        gc.collect()
        return self.results


def _memory_run(rank: int, world: int, key: str, cfg: BenchmarkConfig, tokens: torch.Tensor) -> dict[str, Any]:
    """Build, wrap and train one variant for ``mem_steps`` under the profiler and the collective counter."""
    variant = VARIANTS[key]
    group = _new_group(cfg)
    live, counter = LiveTensorBytes(), CollectiveCounter()
    result: dict[str, Any] = {"status": "ok"}
    losses: list[float] = []
    try:
        with live, counter:
            prepared, optimizer = _build(key, cfg, group)  # counted from before the model exists
            engine = prepared.engine
            with live.window():
                counter.counting = True
                for step in range(cfg.mem_steps):
                    x, y = _batch(tokens, cfg, step, rank, world)
                    seconds, loss = _step(prepared.model, optimizer, x, y)
                    losses.append(loss)
                    _say(
                        rank,
                        f"{variant.name} ws={world} memory step {step + 1}/{cfg.mem_steps}: "
                        f"{seconds * 1e3:.0f} ms (profiled), loss {loss:.5f}",
                    )
                counter.counting = False
            result["model_state"] = model_state_bytes(prepared.model, optimizer)
            n = cfg.mem_steps
            if engine is not None:
                # The engine's own counters: exact, and they see what the wrapper cannot (its collectives are bound
                # at import time).
                stats = engine.shard_comm.stats
                result["comm_per_step"] = {
                    "all_gather": stats.all_gather_bytes / n,
                    "reduce_scatter": stats.reduce_scatter_bytes / n,
                    "all_reduce": stats.all_reduce_bytes / n,
                }
                result["comm_calls_per_step"] = {
                    "all_gather": stats.all_gather_calls / n,
                    "reduce_scatter": stats.reduce_scatter_calls / n,
                    "all_reduce": stats.all_reduce_calls / n,
                }
                result["peak_gathered_units"] = stats.peak_gathered_units
            else:
                result["comm_per_step"] = {k: v / n for k, v in counter.bytes.items()}
                result["comm_calls_per_step"] = {k: v / n for k, v in counter.calls.items()}
            result["notes"] = prepared.notes
            del prepared, optimizer, engine
        result["losses"] = _global_losses(losses)  # the default group, destroyed last
        result["peak_live_bytes"] = live.peak
        result["live_at_start_bytes"] = live.at_window_start
        result["peak_live_overall_bytes"] = live.peak_overall
        result["live_bytes_all_threads"] = live.all_threads
    except Exception as error:  # noqa: BLE001 - reported as a failed variant; the others go on
        result = _failure(error)
        _say(rank, f"{variant.name} ws={world} FAILED in the memory run: {result['error']}")
    finally:
        try:
            destroy_process_group(group)
        except Exception:  # noqa: BLE001
            pass
    gc.collect()
    return result


def _mark(folder: str, rank: int, phase: str, budget: float) -> None:
    """Tell the parent which phase started, and how long it may take before the processes count as hung."""
    if rank == 0:
        write_json(Path(folder, "phase.json"), {"phase": phase, "since": time.time(), "budget": budget})


def _worker(rank: int, world: int, folder: str, keys: list[str], cfg_dict: dict[str, Any], timing: bool) -> None:
    cfg = BenchmarkConfig(**cfg_dict)
    join_gloo_group(folder, rank, world, threads=cfg.threads, timeout=cfg.collective_timeout)
    tokens = _token_stream(cfg.vocab)
    try:
        if timing:
            _mark(folder, rank, "timing", cfg.variant_timeout * len(keys))
            for key, payload in _Interleaved(rank, world, keys, cfg).run(tokens).items():
                write_json(Path(folder, f"timing-{key}-rank{rank}.json"), payload)
        for key in keys:
            _mark(folder, rank, f"memory-{key}", cfg.variant_timeout)
            payload = _memory_run(rank, world, key, cfg, tokens)
            write_json(Path(folder, f"memory-{key}-rank{rank}.json"), payload)
    finally:
        destroy_process_group()


# ----------------------------------------------------------------------------------------- orchestration
def _read(folder: str, kind: str, key: str, world: int) -> list[dict] | None:
    files = [Path(folder, f"{kind}-{key}-rank{r}.json") for r in range(world)]
    if not all(f.exists() for f in files):
        return None
    return [json.loads(f.read_text()) for f in files]


def _run_group(world: int, keys: list[str], cfg: BenchmarkConfig, *, timing: bool) -> dict[str, dict[str, list]]:
    """Run ``keys`` in ``world`` spawned processes: ``{key: {"timing": per-rank, "memory": per-rank}}``."""
    results: dict[str, dict[str, list]] = {k: {} for k in keys}
    remaining = list(keys)
    need_timing = timing
    with environment(quiet_env(cfg.threads)):
        while remaining:
            with tempfile.TemporaryDirectory(prefix="lfsdp-bench-") as folder:
                context = spawn_ranks(_worker, (world, folder, remaining, asdict(cfg), need_timing), world)
                expected = [
                    f"{kind}-{k}-rank{r}.json"
                    for k in remaining
                    for r in range(world)
                    for kind in (("timing", "memory") if need_timing else ("memory",))
                ]
                problem = wait_ranks(context, _watch(folder, expected))
                problem = problem.splitlines()[0] if problem else "processes exited before reporting"
                if need_timing:
                    for key in remaining:
                        results[key]["timing"] = _read(folder, "timing", key, world) or [
                            {"status": "failed", "error": f"interleaved timing run: {problem}"}
                        ]
                    need_timing = False
                for key in list(remaining):
                    payloads = _read(folder, "memory", key, world)
                    if payloads is None:
                        break
                    results[key]["memory"] = payloads
                    remaining.remove(key)
                if remaining and Path(folder, "phase.json").exists():
                    phase = json.loads(Path(folder, "phase.json").read_text())["phase"]
                    if phase.startswith("memory-"):
                        # This variant's memory run killed or hung the processes: report it, run the rest afresh.
                        key = phase.removeprefix("memory-")
                        results[key]["memory"] = [{"status": "failed", "error": f"memory run: {problem}"}]
                        remaining.remove(key)
                        print(f"[benchmark] {VARIANTS[key].name} ws={world} FAILED: {problem}", file=sys.stderr)
                elif remaining:
                    for key in remaining:
                        results[key]["memory"] = [{"status": "failed", "error": f"start-up: {problem}"}]
                    remaining = []
    return results


def _watch(folder: str, expected: list[str], grace: float = 60.0) -> Callable[[], str | None]:
    """When to give up on the processes: a phase ran past its budget, or every result is written and they still
    have not exited ``grace`` seconds later (a teardown that hangs)."""
    all_written_at = None

    def stop() -> str | None:
        nonlocal all_written_at
        if all_written_at is None and all(Path(folder, name).exists() for name in expected):
            all_written_at = time.time()
        if all_written_at is not None and time.time() - all_written_at > grace:
            return f"still running {grace:.0f} s after writing every result"
        marker = Path(folder, "phase.json")
        phase = json.loads(marker.read_text()) if marker.exists() else None
        if phase and time.time() - phase["since"] > phase["budget"]:
            return f"timed out after {phase['budget']:.0f} s"
        return None

    return stop


def _summarise(key: str, parts: dict[str, list[dict]], world: int, param_bytes: int) -> dict[str, Any]:
    """One report row from the per-rank payloads of a variant's timing run (if any) and memory run."""
    variant = VARIANTS[key]
    row: dict[str, Any] = {
        "key": key,
        "name": variant.name,
        "world_size": world,
        "comm_source": variant.comm_source,
        "theory_per_step": {k: v * param_bytes for k, v in variant.theory.items()},
    }
    for part in ("timing", "memory"):
        failed = [p for p in parts.get(part, []) if p.get("status") != "ok"]
        if failed:
            row.update(
                status="failed",
                error=failed[0].get("error", "unknown error"),
                traceback=failed[0].get("traceback"),
                failed_in=part,
            )
            return row
    row["status"] = "ok"
    memory = parts["memory"]
    timing = parts.get("timing")
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
    row["live_bytes_all_threads"] = all(m.get("live_bytes_all_threads", False) for m in memory)
    # Collectives are counted in the profiled run (the timed one carries no instrumentation), per rank: every
    # rank of a symmetric collective moves the same. Model state is the same after either run's last step.
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


def run_benchmark(
    cfg: BenchmarkConfig,
    out: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Run the comparison and the scaling run; write results.json/.md and plot.png into ``out`` if given."""
    say = progress or (lambda text: print(f"[benchmark] {text}", file=sys.stderr, flush=True))
    from lightning_fsdp.demo.gpt import GPT

    with torch.device("meta"):
        num_parameters = GPT(cfg.gpt_config()).num_parameters()
    param_bytes = num_parameters * 4  # float32
    started = time.time()
    say(
        f"GPT {cfg.layers} x {cfg.width}, {num_parameters:,} parameters ({param_bytes / 2**20:.1f} MiB); "
        f"variants {', '.join(cfg.variants)} at ws={COMPARISON_WORLD_SIZE}; "
        f"scaling of {', '.join(cfg.scaling_variants)} at ws={cfg.world_sizes}"
    )

    rows = []
    payloads = _run_group(COMPARISON_WORLD_SIZE, cfg.variants, cfg, timing=True)
    for key in cfg.variants:
        row = _summarise(key, payloads[key], COMPARISON_WORLD_SIZE, param_bytes)
        rows.append(row)
        say(
            f"done {row['name']}: {row['status']}"
            + (f", median {row['median_step_ms']:.1f} ms" if row.get("median_step_ms") else "")
        )
    _compare(rows, cfg.loss_rtol)

    # The scaling run: its variants interleaved at every world size (one timed run per world size, so each world
    # size's ratios are paired). The comparison's run serves where it holds them all.
    scaling = []
    keys = [k for k in VARIANTS if k in cfg.scaling_variants]
    for world in cfg.world_sizes:
        if world == COMPARISON_WORLD_SIZE and all(k in payloads for k in keys):
            group, interleaved = payloads, list(cfg.variants)
        else:
            say(f"scaling run: {', '.join(VARIANTS[k].name for k in keys)} at ws={world}")
            group, interleaved = _run_group(world, keys, cfg, timing=True), keys
        at_world = [{**_summarise(k, group[k], world, param_bytes), "interleaved_with": interleaved} for k in keys]
        _compare(at_world, cfg.loss_rtol, SCALING_BASELINE)
        scaling += at_world

    results = {
        "command": command,
        "config": asdict(cfg),
        "num_parameters": num_parameters,
        "param_bytes": param_bytes,
        "comparison_world_size": COMPARISON_WORLD_SIZE,
        "reference": REFERENCE,
        "scaling_baseline": SCALING_BASELINE,
        "variants": rows,
        "scaling": scaling,
        "methods": {"model_state": MODEL_STATE_METHOD, "peak_live": LIVE_BYTES_METHOD},
        "environment": {**machine(), "engine_options": engine_options()},
        "elapsed_s": time.time() - started,
    }
    if out is not None:
        from benchmarks.report import write_report

        write_report(results, Path(out))
        say(f"wrote {Path(out) / 'results.md'}, results.json, plot.png")
    return results


def _compare(rows: list[dict], rtol: float, reference_key: str = REFERENCE) -> None:
    """Step-time ratios and final-loss agreement, both against ``reference_key``'s row (else the first that ran)."""
    reference = next((r for r in rows if r["key"] == reference_key and r["status"] == "ok"), None)
    if reference is None:
        reference = next((r for r in rows if r["status"] == "ok"), None)
    for row in rows:
        if row["status"] != "ok" or reference is None:
            continue
        ref_ms, ms = reference.get("median_step_ms"), row.get("median_step_ms")
        row["ratio_to_reference"] = ms / ref_ms if ms and ref_ms else None
        row["paired_ratio_to_reference"] = paired_ratio(row, reference)
        ref_loss, loss = reference["final_loss"], row["final_loss"]
        diff = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
        row["loss_rel_diff"] = diff
        row["loss_agrees"] = bool(math.isfinite(diff) and diff <= rtol)
        row["reference_key"] = reference["key"]
