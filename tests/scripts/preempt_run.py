"""One rank of a 2-rank fsdp_custom run that is preempted, or that resumes after a preemption.

Used by tests/reliability/test_preemption.py; started as torchrun or srun start their ranks (one process per rank,
the environment set by the test). Trains ToyLM (units per Block) with SGD and momentum for ``--max-steps`` optimizer
steps of one epoch on ``samples(COUNT)``: rank r takes rows r, r + 2, ... in order, ``MICRO`` rows per batch, through
a resumable loader (a DataLoader whose sampler has ``state_dict`` / ``load_state_dict``, which Lightning saves and
restores), so a resumed run sees the samples an uninterrupted run would. Callbacks: ``OnExceptionCheckpoint``
(``--on-exception``) and ``ModelCheckpoint(save_last=True, every_n_train_steps=--every)`` into ``ckpts/``.

``--signal RANK:WHERE:N`` (repeatable): rank RANK sends itself ``--signum`` (TERM or USR1) at the start of training
batch N (``step``), of validation batch N of the first validation run (``val``), or inside the save at global step N
(``save``: the LightningModule's ``on_save_checkpoint``); ``RANK:again:0`` re-sends it inside every save made after
the ranks agreed to stop (a second signal must not start a second save). Without ``--signal`` the test sends them.
``--kill RANK:save:N``: under torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT=0``) rank RANK SIGKILLs itself
inside the first save of global step N, before writing its part, while the other rank goes on into the save.

Each rank prints ``FAULT-RUN rank=R event=... t=<time.time()>`` lines: ``fit-start``, ``batch-N`` (training batch N
starts), ``fault-signal`` (it signals itself), ``save-step-N`` (a save of global step N), ``resumed-at-N`` (the
first training batch after a restore, N the global step), ``stopped-at-N`` (the run raised at global step N),
``train-end``; and ``CKPTS attempt=A: names`` (what ``ckpts/`` holds as the run starts). When the run ends normally
rank 0 saves the full trained state dict in ``final.pt``.
"""

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader, Sampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.shutdown import destroy_process_group  # noqa: E402
from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, samples  # noqa: E402

WORLD = 2
MICRO = 2  # rows per rank and batch
COUNT = 96  # rows of the data set: one epoch is 24 batches per rank


def say(event: str) -> None:
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_PROCID", "0")))
    sys.stdout.write(f"FAULT-RUN rank={rank} event={event} pid={os.getpid()} t={time.time():.3f}\n")
    sys.stdout.flush()


class ResumableSampler(Sampler[int]):
    """``indices`` in order; ``state_dict`` is how many were taken, ``load_state_dict`` starts the next pass there."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices
        self.position = 0
        self.start = 0

    def __iter__(self):
        self.position, self.start = self.start, 0
        while self.position < len(self.indices):
            self.position += 1
            yield self.indices[self.position - 1]

    def __len__(self) -> int:
        return len(self.indices)


class ResumableLoader(DataLoader):
    """What Lightning saves and restores with the loops (it looks for ``state_dict`` / ``load_state_dict``)."""

    def state_dict(self) -> dict:
        return {"position": self.sampler.position}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.start = state["position"]


class Module(ToyLMModule):
    def __init__(self, args, rank: int) -> None:
        super().__init__()
        self.args, self.rank = args, rank
        self.signals = [s.split(":") for s in args.signal]
        self.stopping = False
        self.resumed_reported = False

    def _signal(self, where: str, n: int) -> None:
        if any(int(r) == self.rank and w == where and int(k) == n for r, w, k in self.signals):
            say("fault-signal")
            os.kill(os.getpid(), getattr(signal, f"SIG{self.args.signum}"))

    def training_step(self, batch, batch_idx):
        if not self.resumed_reported:
            self.resumed_reported = True
            say(f"resumed-at-{self.trainer.global_step}")
        say(f"batch-{batch_idx}")
        self._signal("step", batch_idx)
        time.sleep(self.args.step_sleep)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.completed < 3:  # the first run only
            self._signal("val", batch_idx)
        return None

    def on_save_checkpoint(self, checkpoint) -> None:
        say(f"save-step-{self.trainer.global_step}")
        if self.stopping:
            self._signal("again", 0)
        self._signal("save", self.trainer.global_step)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and self.args.kill == f"{self.rank}:save:{self.trainer.global_step}":
            say("fault-kill")
            os.kill(os.getpid(), signal.SIGKILL)


class Stopped(Callback):
    """Reports the global step the run stopped at; the module re-signals in the saves that follow (``again``)."""

    def on_exception(self, trainer, module, exception) -> None:
        module.stopping = True
        say(f"stopped-at-{trainer.global_step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="full")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--val-every", type=int, default=0, help="val_check_interval in batches; 0: no validation")
    parser.add_argument("--every", type=int, default=3, help="ModelCheckpoint's every_n_train_steps")
    parser.add_argument("--on-exception", action="store_true")
    parser.add_argument("--signal", action="append", default=[])
    parser.add_argument("--signum", default="TERM")
    parser.add_argument("--kill", default="")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--slurm", action="store_true", help="SLURMEnvironment(auto_requeue=True)")
    parser.add_argument("--resume", default=None, help="ckpt_path for fit (none: Lightning chooses)")
    args = parser.parse_args()

    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_PROCID", "0")))
    dataset = samples(COUNT)
    loader = ResumableLoader(dataset, batch_size=MICRO, sampler=ResumableSampler(list(range(rank, COUNT, WORLD))))
    val_loader = DataLoader(dataset, batch_size=MICRO, sampler=list(range(rank, 12, WORLD)))
    callbacks = [ModelCheckpoint(dirpath="ckpts", save_last=True, every_n_train_steps=args.every, save_top_k=1)]
    if args.on_exception:
        callbacks.append(OnExceptionCheckpoint("ckpts"))
    callbacks.append(Stopped())
    strategy = FSDPStrategy(
        auto_wrap_policy={Block},
        timeout=timedelta(seconds=60),
        state_dict_type=args.format,
        weights_after_stage="full",
    )
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        plugins=[SLURMEnvironment(auto_requeue=True)] if args.slurm else None,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        use_distributed_sampler=False,
        enable_checkpointing=True,
        num_sanity_val_steps=0,
        limit_val_batches=3 if args.val_every else 0,
        val_check_interval=args.val_every or None,
        callbacks=callbacks,
        default_root_dir=".",
    )
    module = Module(args, rank)
    say("fit-start")
    found = sorted(os.listdir("ckpts")) if os.path.isdir("ckpts") else []
    sys.stdout.write(f"CKPTS attempt={os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')}: {' '.join(found)}\n")
    try:
        trainer.fit(module, loader, val_loader if args.val_every else None, ckpt_path=args.resume)
    except SystemExit as exit_:
        sys.stdout.write(f"exit status {exit_.code}\n")
        raise
    say("train-end")
    if rank == 0:
        torch.save({"state": {k: v.detach().clone() for k, v in module.state_dict().items()}}, "final.pt")
    torch.distributed.barrier()
    destroy_process_group()


if __name__ == "__main__":
    main()
