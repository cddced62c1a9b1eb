"""Asynchronous saves (``FSDPStrategy(async_checkpoint=True)``, or ``plugins=[AsyncCheckpointIO()]``), run as users
run scripts, for tests/checkpoint/test_async_checkpoint.py: 2 CPU ranks (Lightning's launcher), checkpoints in
``--dir``.

For each ``--formats`` entry (``state_dict_type``), in one process group:

1. ``fit`` 6 steps with ``ModelCheckpoint(save_top_k=2, every_n_train_steps=1)``, saving asynchronously (``full``
   and ``local``: through Lightning's ``AsyncCheckpointIO`` plugin; ``sharded``: ``async_checkpoint=True``), each
   save's writing on the writing rank delayed by 0.2 s so that training goes on while it is written: the final full
   parameters, the directory listing, the staging memory;
2. ``fit`` 4 steps with ``save_top_k=1`` in which the write of step 3's checkpoint fails in the background (on rank 1,
   or rank 0 for ``full``, which only rank 0 writes): what each rank raised, and the listing;
3. ``fit`` 3 steps in which the write of the last save fails: what each rank raised (at the end of ``fit``).

Each rank saves its results in ``{--out}.rank{r}``.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

GLOBAL_BATCH = 6
SAMPLES = 36


class InjectedWriteFailure(OSError):
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--formats", default="full,sharded,local")
    args = parser.parse_args()

    import threading
    import time
    from datetime import timedelta

    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import lightning_fsdp.checkpoint.local as local_format
    from lightning_fsdp import FSDPStrategy
    from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO
    from lightning_fsdp.checkpoint.full import full_model_state_dict
    from lightning_fsdp.shutdown import destroy_process_group
    from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer
    from tests.toolbox.models import Block, samples

    torch.set_num_threads(1)
    results: dict = {}
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's launcher sets it for the ranks it starts

    def trainer_for(fmt: str, max_steps: int, top_k: int, folder: str):
        # Lightning's AsyncCheckpointIO plugin asks for the same as async_checkpoint=True: a file format and a
        # directory format use the plugin, the other directory format the argument.
        plugin = fmt in ("full", "local")
        strategy = FSDPStrategy(
            auto_wrap_policy={Block},
            state_dict_type=fmt,
            timeout=timedelta(seconds=60),
            async_checkpoint=not plugin,
        )
        checkpointing = ModelCheckpoint(
            dirpath=folder, save_top_k=top_k, monitor="step", mode="max", every_n_train_steps=1
        )
        return quiet_trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            plugins=[AsyncCheckpointIO()] if plugin else None,
            max_steps=max_steps,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            enable_checkpointing=True,
            callbacks=[checkpointing],
            use_distributed_sampler=False,
        )

    def fit(trainer) -> None:
        data = samples(SAMPLES)
        sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
        loader = DataLoader(data, batch_size=GLOBAL_BATCH // trainer.world_size, sampler=sampler)
        trainer.fit(ToyLMModule(), loader)

    def outcome(work) -> tuple[str, str, bool] | None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
            return type(exc).__name__, str(exc), "injected" in str(exc)
        return None

    class PatchedWrite:
        """The format's file writes on ``on_rank`` (the writer thread's) made to wait ``delay`` seconds before each
        save's first write, or to fail after the part of the ``fail_at``-th save (1-based) they wrote."""

        def __init__(self, fmt: str, on_rank: int, *, fail_at: int = 0, delay: float = 0.0) -> None:
            self.fmt, self.on_rank, self.fail_at, self.delay, self.saves = fmt, on_rank, fail_at, delay, 0
            self.threads: set[str] = set()
            self.owner, self.name = {
                "full": (AtomicCheckpointIO, "_write"),
                "sharded": (dcp_filesystem, "_write_item"),
                "local": (local_format, "_write_file"),
            }[fmt]

        def __enter__(self):
            if rank == self.on_rank:
                self.original = getattr(self.owner, self.name)
                setattr(self.owner, self.name, self._wrap(self.original))
            return self

        def _wrap(self, original):
            seen: set[str] = set()

            def write(*a, **k):
                self.threads.add(threading.current_thread().name)
                # One call per file (full, local) or per tensor (sharded): a save is counted by its directory.
                where = os.path.dirname(getattr(a[1], "name", "") or "") if self.fmt != "local" else a[1]
                if self.fmt == "full" or where not in seen:
                    seen.add(where)
                    self.saves += 1
                    time.sleep(self.delay)  # before a save's first write; training goes on meanwhile
                result = original(*a, **k)
                if self.saves == self.fail_at:
                    raise InjectedWriteFailure(f"injected: write {self.fail_at} failed on rank {rank}")
                return result

            return write

        def __exit__(self, *exc):
            if rank == self.on_rank:
                setattr(self.owner, self.name, self.original)

    for fmt in args.formats.split(","):
        res: dict = {}
        folder = os.path.join(args.dir, fmt)
        writer_rank = 0 if fmt == "full" else 1
        trainer = trainer_for(fmt, 6, 2, os.path.join(folder, "ok"))
        with PatchedWrite(fmt, writer_rank, delay=0.2):
            fit(trainer)
        res["end"] = full_model_state_dict(trainer.strategy.engine)
        res["listing"] = sorted(os.listdir(os.path.join(folder, "ok")))
        saves = trainer.strategy._checkpoints.async_saves
        res["staging_bytes"] = saves.staging.nbytes if saves else None

        trainer = trainer_for(fmt, 4, 1, os.path.join(folder, "fail_next"))
        with PatchedWrite(fmt, writer_rank, fail_at=3) as failing:
            res["fail_next"] = outcome(lambda: fit(trainer))  # noqa: B023 - called at once
        res["fail_next_threads"] = sorted(failing.threads)
        res["fail_next_listing"] = sorted(n for n in os.listdir(os.path.join(folder, "fail_next")) if n[0] != ".")
        res["fail_next_step"] = trainer.global_step

        trainer = trainer_for(fmt, 3, 1, os.path.join(folder, "fail_last"))
        with PatchedWrite(fmt, writer_rank, fail_at=3):
            res["fail_last"] = outcome(lambda: fit(trainer))  # noqa: B023 - called at once
        res["fail_last_step"] = trainer.global_step
        results[fmt] = res

    torch.save(results, f"{args.out}.rank{rank}")
    torch.distributed.barrier()
    destroy_process_group()


if __name__ == "__main__":
    main()
