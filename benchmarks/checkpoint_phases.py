"""Where a sharded save (and load) through Lightning spends its time, phase by phase, on each rank.

``python -m benchmarks.checkpoint_phases --params 0.85B --variants fsdp_full,fsdp2 --out DIR`` runs the scale
benchmark's rank code (:mod:`benchmarks.scale_rank`: the demo GPT built on the meta device, trained through
Lightning, then ``trainer.save_checkpoint`` of a sharded directory, and with ``--load`` loaded back) once per
variant, with ``time.perf_counter`` spans around the functions a save and a load go through: Lightning's
``Trainer.save_checkpoint`` and ``dump_checkpoint`` (building the checkpoint dict: the strategy's model and
optimizer state dicts, callbacks' state, the module's ``on_save_checkpoint``), the strategy's ``save_checkpoint``
and ``barrier``, DCP's ``save`` and its steps (planning, ``write_data``: taking each tensor, ``torch.save`` into the
file, ``os.fsync``; ``finish``: the ``.metadata`` file), and fsdp_custom's atomic directory protocol (temporary
directory, ``meta.pt``, the commit's fsync and rename, the ranks' agreement).

[Note: what the phase breakdown measures]
Each span is the wall time of one call, inclusive of what it calls; a function called several times in a save
(``os.fsync``, ``torch.save`` per tensor) is summed over the calls, with the count. Per rank; the report lists both
ranks and the slower one's total. Spans are recorded only while ``Trainer.save_checkpoint`` (or the load) runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

# Spans per phase of this process: name -> [total seconds, calls], while a window is open.
_TOTALS: dict[str, dict[str, list[float]]] = {}
_WINDOW: list[str] = []


def _wrap(owner: Any, attr: str, name: str, window: str | None = None) -> None:
    original = getattr(owner, attr)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if window is not None:
            _WINDOW.append(window)
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            if _WINDOW:
                entry = _TOTALS.setdefault(_WINDOW[-1], {}).setdefault(name, [0.0, 0])
                entry[0] += elapsed
                entry[1] += 1
            if window is not None:
                _WINDOW.pop()

    setattr(owner, attr, timed)


def _wrap_generator(owner: Any, attr: str, name: str) -> None:
    """Time each ``next()`` of a generator method (DCP's loader: resolving each tensor, cloning it if needed)."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        iterator = original(*args, **kwargs)
        while True:
            start = time.perf_counter()
            try:
                value = next(iterator)
            except StopIteration:
                return
            finally:
                if _WINDOW:
                    entry = _TOTALS.setdefault(_WINDOW[-1], {}).setdefault(name, [0.0, 0])
                    entry[0] += time.perf_counter() - start
                    entry[1] += 1
            yield value

    setattr(owner, attr, timed)


def install_spans() -> None:
    """Wrap the functions a save and a load go through (in this process)."""
    import lightning.pytorch.trainer.connectors.checkpoint_connector as connector
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as fs
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.trainer.trainer import Trainer
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from lightning_fsdp import strategy as ours
    from lightning_fsdp.checkpoint import checkpointer, common, paths, sharded
    from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO
    from lightning_fsdp.collective import Collective

    _wrap(Trainer, "save_checkpoint", "Trainer.save_checkpoint (all)", window="save")
    _wrap(connector._CheckpointConnector, "dump_checkpoint", "dump_checkpoint (the checkpoint dict)")
    for cls in (ours.FSDPStrategy, ModelParallelStrategy):
        label = "strategy" if cls is ours.FSDPStrategy else "ModelParallelStrategy"
        _wrap(cls, "lightning_module_state_dict", f"{label}.lightning_module_state_dict")
        _wrap(cls, "optimizer_state", f"{label}.optimizer_state")
        _wrap(cls, "save_checkpoint", f"{label}.save_checkpoint")
        _wrap(cls, "load_checkpoint", f"{label}.load_checkpoint", window="load")
        _wrap(cls, "load_model_state_dict", f"{label}.load_model_state_dict", window="load")
        _wrap(cls, "load_optimizer_state_dict", f"{label}.load_optimizer_state_dict", window="load")
        _wrap(cls, "barrier", f"{label}.barrier")
    _wrap(checkpointer, "gather_averages_for_save", "gather_averages_for_save")
    _wrap_generator(fs._SerialCpuLoader, "values", "dcp: take each tensor (clone if a view)")
    # (owner, function, span label): DCP's save and load, then fsdp_custom's checkpoint functions.
    spans = [
        (dcp, "save", "dcp.save"),
        (dcp, "load", "dcp.load"),
        (DefaultSavePlanner, "create_local_plan", "dcp: create_local_plan"),
        (DefaultSavePlanner, "create_global_plan", "dcp: create_global_plan"),
        (fs._FileSystemWriter, "write_data", "dcp: write_data"),
        (fs._FileSystemWriter, "finish", "dcp: finish (.metadata)"),
        (fs, "_write_item", "dcp: torch.save of each item"),
        (fs.FileSystemReader, "read_data", "dcp: read_data"),
        (os, "fsync", "os.fsync"),
        (sharded, "sharded_model_state_dict", "sharded_model_state_dict"),
        (sharded, "sharded_optimizer_state_dict", "sharded_optimizer_state_dict"),
        (common, "write_directory", "write_directory (atomic protocol, all)"),
        (paths, "prepare_temp_dir", "prepare_temp_dir"),
        (paths, "commit_directory", "commit_directory (fsync tree, rename)"),
        (paths, "_fsync_tree", "commit: fsync every file again"),
        (paths, "remove_stale_temps", "remove_stale_temps"),
        (AtomicCheckpointIO, "save_checkpoint", "meta.pt (atomic write)"),
        (Collective, "agree_from_rank0", "Collective.agree_from_rank0"),
        (Collective, "broadcast", "Collective.broadcast"),
        (sharded, "load_sharded_checkpoint", "load_sharded_checkpoint"),
    ]
    for owner, name, label in spans:
        _wrap(owner, name, label)


def _rank_main(spec_path: str) -> None:
    install_spans()
    import torch.distributed as dist

    scale_rank = importlib.import_module("benchmarks.scale_rank")
    rank: list[int] = []
    original_main = scale_rank.main

    # The rank is known while the process group is up; scale_rank.main destroys it at the end.
    import lightning.pytorch as pl

    class _Rank(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            rank.append(dist.get_rank())

    original_trainer = pl.Trainer.__init__

    def trainer_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), _Rank()]
        original_trainer(self, *args, **kwargs)

    pl.Trainer.__init__ = trainer_init  # type: ignore[method-assign]
    import lightning as L

    L.Trainer.__init__ = trainer_init  # type: ignore[method-assign]
    original_main(spec_path)
    with open(spec_path) as f:
        out = json.load(f)["out"]
    Path(out, f"phases{rank[0]}.json").write_text(json.dumps(_TOTALS))


def _run(variant: str, cfg: Any, out: Path, load: bool) -> dict[str, Any]:
    from benchmarks.ranks import clean_env
    from benchmarks.scale import gpt_shape

    work = out / variant
    work.mkdir(parents=True, exist_ok=True)
    params = cfg.params if isinstance(cfg.params, int) else next(iter(cfg.params.values()))
    spec = {
        "variant": variant,
        "world": 2,
        "model": gpt_shape(cfg, params),
        "batch": 1,
        "steps": cfg.steps,
        "threads": 1,
        "lr": 1e-4,
        "seed": 0,
        "collective_timeout": 900.0,
        "out": str(work),
        "load": load,
        "trace": False,
        "units": cfg.units,
        "pretrained": None,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = clean_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    with open(work / "log.txt", "wb") as log:
        code = subprocess.call(
            [sys.executable, "-m", "benchmarks.checkpoint_phases", "--rank-spec", str(work / "spec.json")],
            env=env,
            cwd=work,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if code != 0:
        raise RuntimeError(f"{variant} failed ({code}): {(work / 'log.txt').read_text()[-3000:]}")
    phases = [json.loads((work / f"phases{r}.json").read_text()) for r in range(2)]
    records = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    import shutil

    shutil.rmtree(work / "checkpoint", ignore_errors=True)
    return {"variant": variant, "phases": phases, "records": records}


def table(results: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    for result in results:
        for window in ("save", "load"):
            names: dict[str, None] = {}
            for per_rank in result["phases"]:
                names.update(dict.fromkeys(per_rank.get(window, {})))
            if not names:
                continue
            lines += [f"### {result['variant']}: {window}", "", "| span | rank 0, s (calls) | rank 1, s (calls) |"]
            lines.append("| --- | ---: | ---: |")
            for name in names:
                cells = []
                for per_rank in result["phases"]:
                    total, calls = per_rank.get(window, {}).get(name, [0.0, 0])
                    cells.append(f"{total:.2f} ({int(calls)})")
                lines.append(f"| {name} | {' | '.join(cells)} |")
            peaks = [r.get(f"{window}_peak_bytes", 0) / 2**20 for r in result["records"]]
            lines += ["", f"peak RSS over base during {window}, MiB: {', '.join(f'{p:.0f}' for p in peaks)}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_phases", description=__doc__.split("\n")[0])
    parser.add_argument("--rank-spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--params", default="0.85B")
    parser.add_argument("--variants", default="fsdp_full,fsdp2")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--units", default="blocks")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--load", action="store_true", help="also load the checkpoint back")
    parser.add_argument("--out", default="checkpoint-phases")
    args = parser.parse_args(argv)
    if args.rank_spec:
        _rank_main(args.rank_spec)
        return 0
    from benchmarks.scale import ScaleConfig, parse_params

    cfg = replace(
        ScaleConfig(),
        params=parse_params(args.params),
        steps=args.steps,
        units=args.units,
        width=args.width,
        vocab=args.vocab,
        heads=max(1, args.width // 128),
    )
    out = Path(args.out).absolute()
    results = []
    for variant in args.variants.split(","):
        print(f"[phases] {variant} ...", file=sys.stderr, flush=True)
        results.append(_run(variant, cfg, out, args.load))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
