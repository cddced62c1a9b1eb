"""A 2-rank fsdp_custom Lightning run in which one rank fails in the middle of a training step.

Used by tests/reliability/test_faults.py. The run trains ToyLM (units per Block) with ``FSDPStrategy(timeout=--timeout
s)``; at global step ``--fault-step`` the rank ``--fault-rank`` does ``--fault``:

- ``raise``: raises ``RuntimeError("injected fault ...")``;
- ``exit``: ``os._exit(13)`` (no Python cleanup, no exception handling);
- ``kill``: SIGKILLs itself;
- ``hang``: sleeps forever (``time.sleep`` in a loop);
- ``nan``: adds a term with a finite value and a NaN gradient for ``tiny`` to the loss (run with
  ``--detect-anomaly``: every rank must stop with an error naming the parameter and the rank).

``--where step`` does it at the start of ``training_step``, before the model's forward, so the other rank is
blocked in the forward's all-gathers; ``--where backward`` does it from a gradient hook on the logits, i.e. in the
middle of backward, after the forward's all-gathers and before the units' reduce-scatters.

``--pp 2`` runs ChainLM pipelined over 4 ranks (2 stages x 2 data-parallel ranks, 1F1B, 3 microbatches) instead: the
faulty rank holds one stage; ``--where backward`` fires from the gradient of that rank's block output.

Started plainly (``python fault_run.py ...``) Lightning's launcher re-runs the script for rank 1; started with
``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the environment (torchrun style)
each process is one rank and nothing is launched.

``--devices 4 --global-batch 8`` runs 4 data-parallel ranks (``startup_timeout`` stays the strategy's default);
``--record-step K --out FILE``: after K optimizer steps every rank takes part in gathering the full model state and
rank 0 saves it to FILE (``{"state": ...}``); every rank prints ``event=recorded``, before any fault at a later step.

Each rank prints ``FAULT-RUN rank=R event=... t=<time.time()>`` lines (flushed): ``fit-start`` just before
``trainer.fit`` (whose start is the rendezvous), ``train-start`` once every rank has joined and the model is set up,
``fault-<kind>`` when the fault is injected and ``train-end`` when training ended normally (which must not happen on
any rank).
"""

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import lightning as L
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp import FSDPStrategy, pipelined_loss  # noqa: E402
from lightning_fsdp.pipeline import AbsentPiece  # noqa: E402
from tests.scripts.pipeline_run import chain_lm  # noqa: E402
from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, loss_fn, samples  # noqa: E402

GLOBAL_BATCH = 6


def say(rank: int, event: str) -> None:
    sys.stdout.write(f"FAULT-RUN rank={rank} event={event} pid={os.getpid()} t={time.time():.3f}\n")
    sys.stdout.flush()


def inject(fault: str, rank: int, step: int) -> None:
    say(rank, f"fault-{fault}")
    if fault == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if fault == "exit":
        os._exit(13)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang":
        while True:
            time.sleep(3600)
    raise ValueError(fault)


class Module(ToyLMModule):
    def __init__(self, args) -> None:
        super().__init__()
        self.args = args

    def training_step(self, b, i):
        args = self.args
        faulty = self.global_rank == args.fault_rank and self.global_step == args.fault_step
        if faulty and args.where == "step" and args.fault != "nan":
            inject(args.fault, self.global_rank, self.global_step)
        x, y = b
        logits = self.model(x)
        if faulty and args.fault == "nan":
            say(self.global_rank, "fault-nan")
            # d sqrt(u)/du is inf at u = 0, times du/dtiny = 0: NaN, while the loss stays finite.
            return loss_fn(logits, y) + (self.model.tiny[0, 0] * 0).sqrt()
        if faulty and args.where == "backward":

            def hook(grad):
                inject(args.fault, self.global_rank, self.global_step)
                return grad

            logits.register_hook(hook)
        return loss_fn(logits, y)


class PipelinedModule(L.LightningModule):
    """ChainLM cut into 2 stages over 4 ranks (``--pp 2``): the fault happens on one stage's rank, at the start of
    the step (the others wait in P2P or in the stage's all-gathers) or in the middle of the pipeline's backward."""

    def __init__(self, args) -> None:
        super().__init__()
        self.args = args
        torch.manual_seed(0)
        self.model = chain_lm()

    def _faulty(self) -> bool:
        return self.global_rank == self.args.fault_rank and self.global_step == self.args.fault_step

    def on_fit_start(self) -> None:
        # A hook on whichever block this rank holds: its output's gradient arrives mid-backward.
        held = [b for b in self.model.blocks if not isinstance(b, AbsentPiece)]

        def arm(_module, _args, output):
            if self._faulty() and self.args.where == "backward" and output.requires_grad:
                output.register_hook(lambda grad: inject(self.args.fault, self.global_rank, self.global_step))

        held[-1].register_forward_hook(arm)

    def training_step(self, b, i):
        if self._faulty() and self.args.where == "step":
            inject(self.args.fault, self.global_rank, self.global_step)
        x, y = b
        return pipelined_loss(self.model, x, y, loss_fn)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Started(L.Callback):
    def on_train_start(self, trainer, module):
        say(trainer.global_rank, "train-start")


class Record(L.Callback):
    """After ``step`` optimizer steps: the full model state (a collective on every rank), saved by rank 0."""

    def __init__(self, step: int, out: str) -> None:
        self.step, self.out = step, out

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        state = trainer.strategy.lightning_module_state_dict()  # full tensors on rank 0 ("full" format)
        if trainer.is_global_zero:
            torch.save({"state": {k: v.detach().clone() for k, v in state.items()}}, self.out)
        say(trainer.global_rank, "recorded")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=["raise", "exit", "kill", "hang", "nan"], required=True)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--where", choices=["step", "backward"], default="step")
    parser.add_argument("--timeout", type=float, default=20.0, help="FSDPStrategy(timeout=...) in seconds")
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--detect-anomaly", action="store_true", help="Trainer(detect_anomaly=True)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size (2: ChainLM on 4 ranks)")
    parser.add_argument("--devices", type=int, default=None, help="ranks (default: 2, or 4 with --pp 2)")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--record-step", type=int, default=None, help="save the full state after this many steps")
    parser.add_argument("--out", default=None, help="where --record-step saves it")
    args = parser.parse_args()
    torch.set_num_threads(1)

    pipeline = {"pipeline_parallel_size": args.pp, "pipeline_microbatches": 3} if args.pp > 1 else {}
    strategy = FSDPStrategy(
        auto_wrap_policy={Block},
        sharding_strategy=args.sharding,
        timeout=timedelta(seconds=args.timeout),
        **pipeline,
    )
    callbacks = [Started()]
    if args.record_step is not None:
        callbacks.append(Record(args.record_step, args.out))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=args.devices or 2 * args.pp,
        strategy=strategy,
        max_steps=args.steps,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
        detect_anomaly=args.detect_anomaly,
    )
    with trainer.init_module():
        module = Module(args) if args.pp == 1 else PipelinedModule(args)
    data = samples(args.global_batch * args.steps)
    replicas = trainer.world_size // args.pp  # the data-parallel ranks
    # Rank r takes samples r, r + replicas, ...: every step's global batch is samples [k * B, (k + 1) * B).
    sampler = DistributedSampler(data, num_replicas=replicas, rank=trainer.global_rank % replicas, shuffle=False)
    say(trainer.global_rank, "fit-start")
    trainer.fit(module, DataLoader(data, batch_size=args.global_batch // replicas, sampler=sampler))
    say(trainer.global_rank, "train-end")


if __name__ == "__main__":
    main()
