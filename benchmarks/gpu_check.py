"""The GPU check: what only an accelerator can show, in one command that finishes in minutes (``make gpu-check``).

    python -m benchmarks.gpu_check --out gpu-check          # on a CUDA machine: nccl, world size 1
    python -m benchmarks.gpu_check --device cpu --tiny      # a dry run of the same code on CPU (gloo)

Checks, each against plain unsharded training of the same model from the same seed, on the same batches:

1. ``engine``: fully_shard with one unit per Block on the device; the losses and final parameters equal plain
   training (fp32; tolerance as the CPU tests), and the engine's peak bytes stay below the full model's. On CUDA every
   check runs the stream path (``lightning_fsdp/engine/streams.py``): ``streams_active`` says so.
2. ``bf16``: ``MixedPrecision(param_dtype=bfloat16)``; the losses stay within bf16 rounding of fp32's.
3. ``checkpointing``: activation checkpointing of every Block; equal to the run without it.
4. ``cpu_offload``: shards, gradients and AdamW state in host memory; equal to the run without offload, and every
   shard is on the host after the step, in pinned memory on CUDA (the copies to and from the GPU are asynchronous).
5. ``sharded_checkpoint``: a Lightning fit with ``state_dict_type="sharded"`` saves, a new Trainer loads it, and the
   loaded parameters equal the saved ones.
6. ``streams``: with prefetching both ways, every all-gather was issued on the all-gather stream and every
   reduce-scatter on the reduce-scatter stream, events were recorded on both (none on the compute stream), and with
   a sleep queued on the side stream before every collective (so that a missing wait shows as wrong numbers rather
   than a lucky race) training still equals plain training. On CPU the streams are inactive: only the training runs.

Then a table for a ~125M-parameter GPT (12 x 768, vocab 50304, 512 tokens): median step time and peak memory
(``torch.cuda.max_memory_allocated``, reset before the timed steps) for plain single-device training, torch's FSDP2
(``torch.distributed.fsdp.fully_shard``) and fsdp_custom, measured in one interleaved run. World size 1: sharding saves
nothing here; the table shows the engine's overhead on one device.

Writes ``results.json`` and ``results.md`` to ``--out``; exits non-zero if a check fails (the table is still
written). ``--device cpu`` runs the same code on CPU with gloo, so the suite can check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp.demo.gpt import GPT, Block, GPTConfig

TINY = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
CHECK = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
TABLE = GPTConfig(vocab_size=50304, block_size=512, n_layer=12, n_head=12, n_embd=768)


def _batches(config: GPTConfig, steps: int, batch: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    shape = (batch, config.block_size)
    return [
        (
            torch.randint(0, config.vocab_size, shape, generator=g).to(device),
            torch.randint(0, config.vocab_size, shape, generator=g).to(device),
        )
        for _ in range(steps)
    ]


def _train(model: nn.Module, batches: list, *, lr: float = 1e-3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _fresh(config: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(config).to(device)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from lightning_fsdp.engine import get_engine

    engine = get_engine(model)
    if engine is None:
        return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    with engine.unsharded():
        return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> tuple[int, float]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    worst = max((x - b[k]).abs().max().item() for k, x in a.items())
    if worst > tol:
        raise AssertionError(f"parameters differ by {worst:.3g} (tolerance {tol:g})")
    return len(a), worst


# ------------------------------------------------------------------------------------------------- checks
def check_engine(config: GPTConfig, device: torch.device, steps: int) -> dict[str, Any]:
    from lightning_fsdp.engine import fully_shard

    batches = _batches(config, steps, 4, device)
    plain = _fresh(config, device)
    ref_losses = _train(plain, batches)
    model = _fresh(config, device)
    engine = fully_shard(model, auto_wrap_policy={Block}, device=device)
    losses = _train(model, batches)
    compared, worst = _close(_full_state(model), _full_state(plain), 1e-4)
    if max(abs(a - b) for a, b in zip(losses, ref_losses)) > 1e-4:
        raise AssertionError(f"losses {losses} differ from plain training's {ref_losses}")
    stats = engine.shard_comm.stats
    return {
        "compared": compared,
        "max_param_diff": worst,
        "peak_gathered_units": stats.peak_gathered_units,
        "streams_active": engine.streams.active,
    }


def check_bf16(config: GPTConfig, device: torch.device, steps: int) -> dict[str, Any]:
    from lightning_fsdp import MixedPrecision
    from lightning_fsdp.engine import fully_shard

    batches = _batches(config, steps, 4, device)
    ref = _train(_fresh(config, device), batches)
    model = _fresh(config, device)
    fully_shard(
        model, auto_wrap_policy={Block}, device=device, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)
    )
    losses = _train(model, batches)
    worst = max(abs(a - b) for a, b in zip(losses, ref))
    if not all(map(torch.isfinite, map(torch.tensor, losses))) or worst > 0.05:
        raise AssertionError(f"bf16 losses {losses} too far from fp32's {ref}")
    return {"max_loss_diff": worst}


def _trained_sharded(config: GPTConfig, device: torch.device, batches: list, **options: Any) -> GPT:
    """The GPT from the usual seed, one unit per Block (``options``: more fully_shard options), trained."""
    from lightning_fsdp.engine import fully_shard

    model = _fresh(config, device)
    fully_shard(model, auto_wrap_policy={Block}, device=device, **options)
    _train(model, batches)
    return model


def check_checkpointing(config: GPTConfig, device: torch.device, steps: int) -> dict[str, Any]:
    from lightning_fsdp.activation_checkpointing import apply_activation_checkpointing, parse_checkpointing_policy
    from lightning_fsdp.engine import fully_shard

    batches = _batches(config, steps, 4, device)
    plain = _trained_sharded(config, device, batches)
    model = _fresh(config, device)
    apply_activation_checkpointing(model, parse_checkpointing_policy({Block}))
    fully_shard(model, auto_wrap_policy={Block}, device=device)
    _train(model, batches)
    compared, worst = _close(_full_state(model), _full_state(plain), 1e-5)
    return {"compared": compared, "max_param_diff": worst}


def check_cpu_offload(config: GPTConfig, device: torch.device, steps: int) -> dict[str, Any]:
    batches = _batches(config, steps, 4, device)
    plain = _trained_sharded(config, device, batches)
    model = _trained_sharded(config, device, batches, cpu_offload=True)
    params = list(model.parameters())
    on_host = sum(1 for p in params if p.device.type == "cpu")
    if on_host != len(params):
        raise AssertionError(f"{on_host} of {len(params)} shards in host memory")
    pinned = sum(1 for p in params if p.is_pinned())
    if device.type == "cuda" and pinned != len(params):
        raise AssertionError(f"{pinned} of {len(params)} host shards pinned")
    compared, worst = _close(_full_state(model), _full_state(plain), 1e-5)
    return {"compared": compared, "max_param_diff": worst, "shards_on_host": on_host, "pinned_shards": pinned}


def check_sharded_checkpoint(config: GPTConfig, device: torch.device, steps: int) -> dict[str, Any]:
    import lightning as L

    from lightning_fsdp import FSDPStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(config)

        def training_step(self, batch, _):
            return self.model(*batch)[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    from torch.utils.data import DataLoader, TensorDataset

    x, y = (torch.cat(t) for t in zip(*_batches(config, steps, 4, torch.device("cpu"))))
    batches = DataLoader(TensorDataset(x, y), batch_size=4)
    accelerator = "gpu" if device.type == "cuda" else "cpu"

    def trainer(max_steps: int) -> L.Trainer:
        return L.Trainer(
            accelerator=accelerator,
            devices=1,
            strategy=FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded"),
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    with tempfile.TemporaryDirectory() as folder:
        first = trainer(steps)
        module = Module()
        first.fit(module, batches)
        path = os.path.join(folder, "ckpt")
        first.save_checkpoint(path)
        saved = {k: v.detach().float().cpu().clone() for k, v in module.model.state_dict().items()}
        second = trainer(steps)
        loaded = Module()
        second.fit(loaded, batches, ckpt_path=path)  # resumes at the saved step: no step is left to run
        compared, worst = _close({k: v.float().cpu() for k, v in loaded.model.state_dict().items()}, saved, 0.0)
    return {"compared": compared, "max_param_diff": worst}


SLEEP_CYCLES = 2_000_000  # about a millisecond of GPU time, queued before each collective by the streams check


def _watch_streams(engine: Any) -> tuple[Any, Any]:
    """Count the stream each of ``engine``'s collectives is issued on (after queueing a sleep there) and the events
    recorded on each stream: two Counters, filled as the engine trains."""
    from collections import Counter

    streams = engine.streams
    issued: Counter = Counter()  # (collective, stream it was issued on)
    events: Counter = Counter()  # stream -> events recorded there

    def name_of(stream: Any) -> str:
        if stream == streams.all_gather_stream:
            return "all_gather"
        return "reduce_scatter" if stream == streams.reduce_scatter_stream else "compute"

    def counted(record_event: Any) -> Any:
        def record() -> Any:
            events[name_of(streams.current_stream())] += 1
            return record_event()

        return record

    def slowed(collective: Any, what: str) -> Any:
        def issue(*args: Any, **kwargs: Any) -> Any:
            issued[(what, name_of(torch.cuda.current_stream()))] += 1
            torch.cuda._sleep(SLEEP_CYCLES)
            return collective(*args, **kwargs)

        return issue

    streams.record_event = counted(streams.record_event)  # the units call it on this object
    for what in ("all_gather", "reduce_scatter"):
        setattr(engine.shard_comm, what, slowed(getattr(engine.shard_comm, what), what))
    return issued, events


def check_streams(config: GPTConfig, device: torch.device, steps: int) -> dict[str, Any]:
    from lightning_fsdp.engine import fully_shard

    batches = _batches(config, steps, 4, device)
    plain = _fresh(config, device)
    ref_losses = _train(plain, batches)
    model = _fresh(config, device)
    engine = fully_shard(model, auto_wrap_policy={Block}, device=device, forward_prefetch=True)
    active = engine.streams.active
    issued, events = _watch_streams(engine) if active else ({}, {})
    losses = _train(model, batches)
    compared, worst = _close(_full_state(model), _full_state(plain), 1e-4)
    if max(abs(a - b) for a, b in zip(losses, ref_losses)) > 1e-4:
        raise AssertionError(f"losses {losses} differ from plain training's {ref_losses}")
    result: dict[str, Any] = {"streams_active": active, "compared": compared, "max_param_diff": worst}
    if active:
        misplaced = any(what != where for what, where in issued)
        if misplaced or events.get("compute") or not events.get("all_gather") or not events.get("reduce_scatter"):
            raise AssertionError(f"collectives {dict(issued)}, events {dict(events)}")
        result.update(
            collectives_on_side_streams=sum(issued.values()),
            all_gather_events=events["all_gather"],
            reduce_scatter_events=events["reduce_scatter"],
        )
    return result


CHECKS: dict[str, Callable[[GPTConfig, torch.device, int], dict[str, Any]]] = {
    "engine": check_engine,
    "bf16": check_bf16,
    "checkpointing": check_checkpointing,
    "cpu_offload": check_cpu_offload,
    "sharded_checkpoint": check_sharded_checkpoint,
    "streams": check_streams,
}


# -------------------------------------------------------------------------------------------------- table
def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_table(config: GPTConfig, device: torch.device, steps: int, warmup: int, batch: int) -> list[dict[str, Any]]:
    """Median step time and peak memory of plain training, torch FSDP2 and fsdp_custom, steps interleaved."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from lightning_fsdp.engine import fully_shard

    def plain(model: nn.Module) -> nn.Module:
        return model

    def fsdp2(model: nn.Module) -> nn.Module:
        for block in model.blocks:
            torch_fully_shard(block)
        torch_fully_shard(model)
        return model

    def custom(model: nn.Module) -> nn.Module:
        fully_shard(model, auto_wrap_policy={Block}, device=device)
        return model

    batches = _batches(config, 1, batch, device)
    rows = []
    for name, wrap in (("plain", plain), ("torch FSDP2", fsdp2), ("fsdp_custom", custom)):
        model = wrap(_fresh(config, device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = batches[0]
        times = []
        _reset_peak(device)
        for i in range(warmup + steps):
            _sync(device)
            start = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        rows.append(
            {
                "variant": name,
                "median_step_s": statistics.median(times),
                "peak_bytes": _peak(device),
                "loss": loss.item(),
            }
        )
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = rows[0]["median_step_s"]
    for row in rows:
        row["time_vs_plain"] = row["median_step_s"] / base
    return rows


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"GPU check, {report['date']}, device: {report['device_name']} (torch {report['torch']})",
        "",
        "| check | result | details |",
        "| --- | --- | --- |",
    ]
    for name, result in report["checks"].items():
        details = ", ".join(f"{k}={v}" for k, v in result.items() if k != "status")
        lines.append(f"| {name} | {result['status']} | {details} |")
    lines += [
        "",
        f"Step time and peak memory, GPT {report['table_config']}, batch {report['table_batch']}, median of "
        f"{report['table_steps']} steps after {report['table_warmup']} warm-up; "
        "peak = torch.cuda.max_memory_allocated:",
        "",
        "| variant | median step (ms) | vs plain | peak memory (MiB) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in report["table"]:
        peak = f"{row['peak_bytes'] / 2**20:.0f}" if row["peak_bytes"] is not None else "n/a"
        lines.append(f"| {row['variant']} | {1000 * row['median_step_s']:.1f} | {row['time_vs_plain']:.2f}x | {peak} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny models (the CPU dry run)")
    parser.add_argument("--steps", type=int, default=4, help="training steps of each check")
    parser.add_argument("--table-steps", type=int, default=10)
    parser.add_argument("--table-warmup", type=int, default=3)
    parser.add_argument("--table-batch", type=int, default=8)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run on a GPU machine, or pass --device cpu for a dry run.")
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rendezvous = tempfile.mkdtemp(prefix="gpu-check-")  # a file store: no port to collide with
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}/store", rank=0, world_size=1)
    check_config, table_config = (TINY, TINY) if args.tiny else (CHECK, TABLE)
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "checks": {},
        "table_config": f"{table_config.n_layer}x{table_config.n_embd}, vocab {table_config.vocab_size}, "
        f"{table_config.block_size} tokens",
        "table_batch": args.table_batch,
        "table_steps": args.table_steps,
        "table_warmup": args.table_warmup,
    }
    failed = 0
    try:
        for name, check in CHECKS.items():
            started = time.perf_counter()
            try:
                result = {"status": "passed", **check(check_config, device, args.steps)}
            except Exception as exc:  # noqa: BLE001 - every check runs and is reported
                failed += 1
                result = {"status": "FAILED", "error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            result["seconds"] = round(time.perf_counter() - started, 1)
            report["checks"][name] = result
            print(f"gpu_check: {name}: {result}", flush=True)
        report["table"] = step_table(table_config, device, args.table_steps, args.table_warmup, args.table_batch)
    finally:
        from lightning_fsdp.shutdown import destroy_process_group

        destroy_process_group()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    (out / "results.md").write_text(_markdown(report))
    print(_markdown(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
