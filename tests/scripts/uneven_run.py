"""Uneven inputs under Trainer(strategy=FSDPStrategy, devices=2, use_distributed_sampler=False): each rank builds its
own loaders, with its own number of batches, as a user's script would. Used by tests/reliability/test_uneven_batches.py.

``--case NAME`` runs one case and lets its exception end the script (the uneven cases: the job must exit non-zero
within seconds, both ranks naming the rank that ran out). ``--case ok`` runs ``OK_CASES`` in sequence in the same
processes: cases that must train without an error, and uneven cases whose error each rank catches, records and
carries on after (which shows that the error left both ranks in step). Each rank writes ``{case: result}`` to
``--out.rank{N}`` (JSON); a result is ``{"ok": True, "steps": ..., ...}`` or ``{"error": message}``.

Counts are ``rank0,rank1`` batches, e.g. ``3,2``. Each rank prints ``UNEVEN-RUN rank=R event=... t=<time.time()>``
lines (flushed): ``start`` when its first loop starts, ``error`` with the message when it catches the error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.even_batches import UnevenBatchesError  # noqa: E402
from lightning_fsdp.shutdown import destroy_process_group  # noqa: E402
from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, loss_fn, samples  # noqa: E402

BATCH = 3  # rows per rank and batch
TIMEOUT_S = 120  # the process-group timeout: a missed check shows up as the test's own time limit, well before it


def say(rank: int, event: str, **extra) -> None:
    fields = "".join(f" {k}={json.dumps(v)}" for k, v in extra.items())
    sys.stdout.write(f"UNEVEN-RUN rank={rank} event={event} pid={os.getpid()} t={time.time():.3f}{fields}\n")
    sys.stdout.flush()


class Stream(IterableDataset):
    """An IterableDataset without ``__len__`` that yields ``count`` whole batches."""

    def __init__(self, count: int, seed: int) -> None:
        self.count = count
        self.data = samples(BATCH * max(count, 1) + seed).tensors

    def __iter__(self):
        for i in range(self.count):
            yield tuple(t[i * BATCH : (i + 1) * BATCH] for t in self.data)


def loader(kind: str, counts: str, rank: int) -> DataLoader:
    count = int(counts.split(",")[rank])
    if kind == "iterable":
        return DataLoader(Stream(count, seed=rank), batch_size=None)
    x, y = samples(BATCH * count + rank).tensors
    return DataLoader(TensorDataset(x[: BATCH * count], y[: BATCH * count]), batch_size=BATCH)


class Module(ToyLMModule):
    def __init__(self) -> None:
        super().__init__()
        self.batches = {"train": 0, "val": 0, "test": 0, "predict": 0}

    def training_step(self, b, i):
        self.batches["train"] += 1
        return loss_fn(self.model(b[0]), b[1])

    def validation_step(self, b, i):
        self.batches["val"] += 1
        self.log("val_loss", loss_fn(self.model(b[0]), b[1]), sync_dist=True)

    def test_step(self, b, i):
        self.batches["test"] += 1
        self.log("test_loss", loss_fn(self.model(b[0]), b[1]), sync_dist=True)

    def predict_step(self, b, i):
        self.batches["predict"] += 1
        return self.model(b[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ManualModule(Module):
    """Manual optimization: two optimizer steps per batch (Lightning counts both in global_step)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, b, i):
        self.batches["train"] += 1
        opt = self.optimizers()
        for _ in range(2):
            opt.zero_grad()
            self.manual_backward(loss_fn(self.model(b[0]), b[1]))
            opt.step()


class IterModule(Module):
    """A ``dataloader_iter`` step: it fetches its own batches, so nothing is known ahead and no batch is checked."""

    def training_step(self, dataloader_iter):
        b, _, _ = next(dataloader_iter)
        self.batches["train"] += 1
        return loss_fn(self.model(b[0]), b[1])


class ReloadModule(Module):
    """Its own train_dataloader, reloaded every epoch: ``counts`` for the first epoch, ``later`` after it."""

    def __init__(self, counts: str, later: str) -> None:
        super().__init__()
        self.counts, self.later = counts, later

    def train_dataloader(self):
        return loader("map", self.counts if self.trainer.current_epoch == 0 else self.later, self.global_rank)


class Started(L.Callback):
    def __init__(self) -> None:
        self.said = False

    def _say(self, trainer) -> None:
        if not self.said:
            self.said = True
            say(trainer.global_rank, "start")

    def on_train_start(self, trainer, module):
        self._say(trainer)

    def on_validation_start(self, trainer, module):
        self._say(trainer)

    def on_test_start(self, trainer, module):
        self._say(trainer)

    def on_predict_start(self, trainer, module):
        self._say(trainer)


STARTED = Started()


def trainer_for(sharding: str = "FULL_SHARD", **kwargs) -> L.Trainer:
    kwargs = {"max_epochs": 1, "num_sanity_val_steps": 0, **kwargs}
    strategy = FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy=sharding, timeout=timedelta(seconds=TIMEOUT_S))
    return quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        use_distributed_sampler=False,
        callbacks=[STARTED],
        **kwargs,
    )


def fit(kind: str, counts: str, val: tuple[str, str] | None = None, module: type = Module, **kwargs) -> dict:
    trainer = trainer_for(**kwargs)
    model = module()
    rank = trainer.global_rank
    vals = loader(val[0], val[1], rank) if val else None
    trainer.fit(model, loader(kind, counts, rank), vals)
    return {"ok": True, "steps": trainer.global_step, "batches": model.batches}


def fit_reloaded(counts: str, later: str, **kwargs) -> dict:
    trainer = trainer_for(reload_dataloaders_every_n_epochs=1, **kwargs)
    model = ReloadModule(counts, later)
    trainer.fit(model)
    return {"ok": True, "steps": trainer.global_step, "batches": model.batches}


def evaluate(what: str, kind: str, counts: str, sharding: str = "FULL_SHARD") -> dict:
    trainer = trainer_for(sharding)
    model = Module()
    data = loader(kind, counts, trainer.global_rank)
    getattr(trainer, what)(model, data)
    return {"ok": True, "batches": model.batches}


# name: what it runs. Failing cases (their own run each) and the cases of the "ok" run.
CASES = {
    # uneven: each must raise on both ranks
    "train-map": lambda: fit("map", "3,2"),
    "train-iterable": lambda: fit("iterable", "3,2"),
    "val-map": lambda: fit("map", "2,2", val=("map", "3,2")),
    # even: no false alarm
    "even-map": lambda: fit("map", "3,3", val=("map", "2,2"), max_epochs=2),
    "even-iterable": lambda: fit("iterable", "3,3", val=("iterable", "2,2"), max_epochs=2, num_sanity_val_steps=1),
    "even-validate-test-predict": lambda: {
        "ok": True,
        **{what: evaluate(what, "map", "2,2") for what in ("validate", "test", "predict")},
    },
    "even-manual-iterable": lambda: fit("iterable", "3,3", module=ManualModule),
    "even-dataloader-iter": lambda: fit("iterable", "3,3", module=IterModule),
    "even-reloaded": lambda: fit_reloaded("2,2", "3,3", max_epochs=2),
    # uneven, but max_steps ends training on every rank before the shorter one runs out
    "max-steps-map": lambda: fit("map", "3,2", max_steps=2),
    "max-steps-iterable": lambda: fit("iterable", "3,2", max_steps=2),
    "max-steps-manual-map": lambda: fit("map", "3,2", module=ManualModule, max_steps=4),
    # uneven predict under NO_SHARD, whose forward makes no collective: not checked, works as under DDP
    "predict-map-no-shard": lambda: evaluate("predict", "map", "3,2", sharding="NO_SHARD"),
    # uneven and caught: the error must be the same on both ranks, which then carry on together
    "max-steps-late-map": lambda: fit("map", "3,2", max_steps=2, accumulate_grad_batches=2),
    "max-steps-late-iterable": lambda: fit("iterable", "3,2", max_steps=3),
    "manual-iterable": lambda: fit("iterable", "3,2", module=ManualModule),
    "reloaded-uneven": lambda: fit_reloaded("2,2", "3,2", max_epochs=2),
    "val-iterable": lambda: fit("map", "2,2", val=("iterable", "3,2")),
    "test-iterable": lambda: evaluate("test", "iterable", "2,3"),
    "predict-map": lambda: evaluate("predict", "map", "3,2"),
    "predict-iterable-empty": lambda: evaluate("predict", "iterable", "2,0"),
}
OK_CASES = [
    "even-map",
    "even-iterable",
    "even-validate-test-predict",
    "even-manual-iterable",
    "even-dataloader-iter",
    "even-reloaded",
    "max-steps-map",
    "max-steps-iterable",
    "max-steps-manual-map",
    "predict-map-no-shard",
    "max-steps-late-map",
    "max-steps-late-iterable",
    "manual-iterable",
    "reloaded-uneven",
    "val-iterable",
    "test-iterable",
    "predict-map",
    "predict-iterable-empty",
    "even-map",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=[*CASES, "ok"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = OK_CASES if args.case == "ok" else [args.case]
    results: dict = {}
    rank = int(os.environ.get("LOCAL_RANK", 0))
    for n, name in enumerate(names):
        key = f"{n}:{name}" if args.case == "ok" else name
        try:
            results[key] = CASES[name]()
        except UnevenBatchesError as exc:
            say(rank, "error", case=name, message=str(exc))
            results[key] = {"error": str(exc)}
            if args.case != "ok":
                raise
        finally:
            with open(f"{args.out}.rank{rank}", "w") as f:
                json.dump(results, f)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        destroy_process_group()


if __name__ == "__main__":
    main()
