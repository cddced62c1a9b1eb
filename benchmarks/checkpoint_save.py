"""How long a checkpoint save blocks training: fsdp_custom's sharded save, synchronous and asynchronous, beside torch
FSDP2's DCP ``save`` and ``async_save`` on the same model.

``python -m benchmarks.checkpoint_save --out DIR`` trains the demo GPT in ``--world-size`` gloo processes on CPU (one
thread each) with AdamW, and saves a sharded checkpoint every ``--steps-between`` steps, ``--saves`` times, in four
variants, each launched on its own (its own processes, so that one variant's memory never weighs on another's):

* ``fsdp_custom sync``: the engine (``fully_shard``, each ``Block`` a unit), ``state_dict_type="sharded"``'s state
  dicts and ``save_sharded_checkpoint`` (DCP files + ``meta.pt``, temporary directory, fsync, rename);
* ``fsdp_custom async``: the same, through ``AsyncCheckpointer`` (``async_checkpoint=True``'s writer): the state
  dicts, the copy into the reused host buffers, and the start of the background write;
* ``FSDP2 DCP save``: torch's ``fully_shard`` on every ``Block`` and the root, ``get_state_dict`` and ``dcp.save``;
* ``FSDP2 DCP async_save``: the same with ``dcp.async_save`` (its default stager, a thread), over a gloo group of its
  own for the background collectives, as torch asks.

[Note: what the checkpoint-save benchmark measures]
*Blocked per save*: ``time.perf_counter`` around everything the training loop waits for at a save: building the
state dicts, and the save call (a synchronous save: all of it; an asynchronous one: the wait for the previous save
still in flight, the copy to host memory, the start of the writer); per save the slowest rank's time; the median
over ``--saves`` saves. *Write*: for the asynchronous variants, the time from the save call to the end of the
background write (the previous save is always waited for before timing the next). Ratios: each variant's median
against ``fsdp_custom sync``'s, measured in the same run. ``--check-async-ratio R`` makes the command fail if
``fsdp_custom async`` blocks more than R times ``fsdp_custom sync``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import ConfigOption, add_config_options, command_line, config_fields, gpt_config, machine
from benchmarks.ranks import join_gloo_group, report_rank, run_ranks, write_json

__all__ = ["VARIANTS", "SaveConfig", "main", "run_checkpoint_save_benchmark"]

VARIANTS = ("custom_sync", "custom_async", "fsdp2_save", "fsdp2_async_save")
NAMES = {
    "custom_sync": "fsdp_custom sync",
    "custom_async": "fsdp_custom async",
    "fsdp2_save": "FSDP2 DCP save",
    "fsdp2_async_save": "FSDP2 DCP async_save",
}


@dataclass
class SaveConfig:
    # The main benchmark's GPT (benchmarks/__init__.py); a smaller batch, which a save does not depend on.
    world_size: int = 2
    layers: int = 6
    width: int = 512
    heads: int = 8
    seq: int = 128
    vocab: int = 65
    batch: int = 2
    saves: int = 5
    steps_between: int = 2
    timeout: float = 1800.0
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))

    def gpt_config(self) -> Any:
        return gpt_config(self)


OPTIONS: list[ConfigOption] = [
    ("world_size", int, "gloo processes"),
    ("layers", int, "GPT blocks"),
    ("width", int, "GPT width"),
    ("heads", int, "attention heads"),
    ("seq", int, "sequence length"),
    ("vocab", int, "vocabulary size"),
    ("batch", int, "sequences per rank and step"),
    ("saves", int, "saves per variant"),
    ("steps_between", int, "training steps between saves"),
    ("timeout", float, "seconds allowed for each variant's processes"),
    ("variants", lambda text: _variants(text), f"comma-separated, among {','.join(VARIANTS)}; custom_sync always runs"),
]


def _variants(text: str) -> list[str]:
    chosen = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown}; choose among {list(VARIANTS)}")
    return [v for v in VARIANTS if v == "custom_sync" or v in chosen]  # the reference first


def _model(cfg: SaveConfig) -> torch.nn.Module:
    from lightning_fsdp.demo.gpt import GPT

    torch.manual_seed(0)
    return GPT(cfg.gpt_config())


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: SaveConfig, step: int) -> None:
    g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _saver(variant: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine: Any) -> Any:
    """(save(path) -> blocked part done, wait() -> the rest done) for the variant."""
    if variant.startswith("custom"):
        from lightning_fsdp.checkpoint.async_save import AsyncCheckpointer
        from lightning_fsdp.checkpoint.sharded import (
            save_sharded_checkpoint,
            sharded_model_state_dict,
            sharded_optimizer_state_dict,
        )

        writer = AsyncCheckpointer(lambda device: False) if variant == "custom_async" else None

        def custom_save(path: str) -> None:
            checkpoint = {
                "state_dict": sharded_model_state_dict(engine),
                "optimizer_states": [sharded_optimizer_state_dict(engine, optimizer)],
            }
            if writer is None:
                save_sharded_checkpoint(checkpoint, path)
            else:
                writer.submit(checkpoint, path, torch.device("cpu"), lambda s: lambda: save_sharded_checkpoint(s, path))

        return custom_save, (writer.wait if writer is not None else lambda: None)

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    pending: list[Any] = []
    group = dist.new_group(backend="gloo") if variant == "fsdp2_async_save" else None

    def fsdp2_save(path: str) -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        if group is None:
            dcp.save(state, checkpoint_id=path)
        else:
            for future in pending:  # one save in flight, as fsdp_custom's
                future.result()
            pending.clear()
            pending.append(dcp.async_save(state, checkpoint_id=path, process_group=group))

    def fsdp2_wait() -> None:
        for future in pending:
            future.result()
        pending.clear()

    return fsdp2_save, fsdp2_wait


def _rank(rank: int, folder: str, variant: str, cfg: SaveConfig) -> None:
    join_gloo_group(folder, rank, cfg.world_size, timeout=cfg.timeout)

    def compute() -> dict[str, Any]:
        from lightning_fsdp.demo.gpt import Block

        model = _model(cfg)
        engine = None
        if variant.startswith("custom"):
            from lightning_fsdp.engine import fully_shard

            engine = fully_shard(model, auto_wrap_policy={Block})
        else:
            from torch.distributed.fsdp import fully_shard as fsdp2_shard

            for module in model.modules():
                if isinstance(module, Block):
                    fsdp2_shard(module)
            fsdp2_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        save, wait = _saver(variant, model, optimizer, engine)
        blocked, written, step = [], [], 0
        for index in range(cfg.saves):
            for _ in range(cfg.steps_between):
                _step(model, optimizer, cfg, step)
                step += 1
            dist.barrier()
            path = os.path.join(folder, f"ckpt-{variant}-{index % 2}")
            start = time.perf_counter()
            save(path)
            blocked.append(time.perf_counter() - start)
            wait()  # not timed as blocking: the next save would wait for it inside its own call
            written.append(time.perf_counter() - start)
        return {"blocked_s": blocked, "written_s": written}

    report_rank(folder, rank, compute)


def _run_variant(cfg: SaveConfig, variant: str) -> dict[str, Any]:
    def args_of(folder: str) -> tuple:  # the checkpoints go into the ranks' temporary folder, removed afterwards
        return (folder, variant, cfg)

    ranks = run_ranks(_rank, args_of, cfg.world_size, threads=1, timeout=cfg.timeout, name=f"checkpoint-save {variant}")
    blocked = [max(r["blocked_s"][i] for r in ranks) for i in range(cfg.saves)]
    written = [max(r["written_s"][i] for r in ranks) for i in range(cfg.saves)]
    return {
        "key": variant,
        "name": NAMES[variant],
        "blocked_s": blocked,
        "written_s": written,
        "median_blocked_s": statistics.median(blocked),
        "median_written_s": statistics.median(written),
    }


def run_checkpoint_save_benchmark(cfg: SaveConfig, out: str | Path | None = None, command: str | None = None) -> dict:
    from lightning_fsdp.demo.gpt import GPT

    with torch.device("meta"):
        num_parameters = GPT(cfg.gpt_config()).num_parameters()
    print(f"[checkpoint-save] GPT {cfg.layers} x {cfg.width}, {num_parameters:,} parameters", file=sys.stderr)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = [_run_variant(cfg, variant) for variant in _variants(",".join(cfg.variants))]
    reference = rows[0]["median_blocked_s"]
    for row in rows:
        row["ratio_to_custom_sync"] = row["median_blocked_s"] / reference
    results = {
        "command": command,
        "date": date,
        "config": asdict(cfg),
        "num_parameters": num_parameters,
        "variants": rows,
        "environment": machine(),
        "method": __doc__.split("[Note: what the checkpoint-save benchmark measures]")[1].strip(),
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "results.json", results)
        (out / "results.md").write_text(_table(results))
    return results


def _table(results: dict) -> str:
    lines = [
        f"# Checkpoint save: time training is blocked ({results['date']})",
        "",
        f"`{results['command']}`; GPT with {results['num_parameters']:,} parameters, "
        f"{results['config']['world_size']} gloo ranks, torch {results['environment']['torch']}.",
        "",
        "| variant | blocked per save, median (s) | x fsdp_custom sync | write done after, median (s) |",
        "| --- | --- | --- | --- |",
    ]
    for row in results["variants"]:
        lines.append(
            f"| {row['name']} | {row['median_blocked_s']:.3f} | {row['ratio_to_custom_sync']:.2f} | "
            f"{row['median_written_s']:.3f} |"
        )
    lines += ["", "## How each figure is measured", "", results["method"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_save", description=__doc__.split("\n")[0])
    add_config_options(parser, SaveConfig(), OPTIONS)
    parser.add_argument("--out", default=None, help="folder for results.json and results.md")
    parser.add_argument(
        "--check-async-ratio", type=float, default=None, help="fail if async blocks more than this x sync"
    )
    args = parser.parse_args(argv)
    cfg = SaveConfig(**config_fields(args, OPTIONS))
    results = run_checkpoint_save_benchmark(cfg, args.out, command_line("benchmarks.checkpoint_save", argv))
    print(_table(results))
    ratios = {row["key"]: row["ratio_to_custom_sync"] for row in results["variants"]}
    ratio = ratios.get("custom_async", 0.0)
    if args.check_async_ratio is not None and ratio > args.check_async_ratio:
        print(
            f"fsdp_custom async blocks {ratio:.2f}x the synchronous save (> {args.check_async_ratio})", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
