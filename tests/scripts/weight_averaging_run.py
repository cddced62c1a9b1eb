"""Weight-averaging callbacks under Lightning, every case in one process (group): a fresh Trainer and module each.

Run with ``--devices 1`` (``strategy="auto"``: the single-device reference) or ``--devices 2`` (``fsdp_custom`` with
``auto_wrap_policy={Block}``). Rank r takes samples r, r+N, ... so every step's global batch is the reference's.
Cases (in this order; a resume case reads the checkpoint its case before wrote):

* ``swa``: StochasticWeightAveraging over epochs 1-3 of 4 (3 averaged models; an epoch StepLR that SWA swaps for its
  SWALR), a full checkpoint saved at the end of epoch 2; ``swa_resume`` resumes from it.
* ``ema``: EMAWeightAveraging(decay=0.9) with validation every epoch (the callback swaps the average in for it), a
  checkpoint at the end of epoch 0, then ``trainer.validate``; ``ema_resume`` resumes from the checkpoint.
* ``user_ema``: a hand-written EMA callback taking shard copies in on_fit_start, checkpointed with full_tensors.
* (2 ranks) ``swa_local`` / ``ema_sharded``: the same with state_dict_type "local" / "sharded", saved and resumed.
* (2 ranks) ``user_ema_setup``: copies taken in setup: refused before the first step (the error is recorded).

Rank 0 writes ``{case: {...}}`` to ``--out``: final parameters, the average, the shapes each rank held, the checkpoints.
"""

import argparse
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.shutdown import destroy_process_group  # noqa: E402
from lightning_fsdp.weight_averaging import full_tensors, local_tensors  # noqa: E402
from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, loss_fn, samples  # noqa: E402

GLOBAL_BATCH = 6
SAMPLES = 24  # 4 steps per epoch


class Module(ToyLMModule):
    def __init__(self, scheduler: bool = False) -> None:
        super().__init__()
        self.scheduler = scheduler

    def training_step(self, b, i):
        return loss_fn(self.model(b[0]), b[1])

    def validation_step(self, b, i):
        self.log("val_loss", loss_fn(self.model(b[0]), b[1]), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        if self.scheduler:
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}
        return opt


class SaveAt(L.Callback):
    """trainer.save_checkpoint(path) at the end of training epoch ``epoch`` (on every rank, as Lightning requires)."""

    def __init__(self, epoch: int, path: str) -> None:
        self.epoch, self.path = epoch, path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


class UserEMA(L.Callback):
    """The usual hand-written EMA: one copy per parameter, updated after every step."""

    def __init__(self, decay: float = 0.8, when: str = "fit_start") -> None:
        self.decay, self.when = decay, when
        self.ema = None
        self.strategy = None

    def setup(self, trainer, pl_module, stage):
        self.strategy = trainer.strategy
        if self.when == "setup":
            self.ema = [p.detach().clone() for p in pl_module.parameters()]

    def on_fit_start(self, trainer, pl_module):
        if self.ema is None:  # a restored EMA (one device restores before this hook) is kept
            self.ema = [p.detach().clone() for p in pl_module.parameters()]

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for e, p in zip(self.ema, pl_module.parameters()):
            e.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def on_train_end(self, trainer, pl_module):
        self.full = full_tensors(self.strategy, self.ema)  # while the stage runs: the shards can still be gathered

    def state_dict(self):
        return {"ema": full_tensors(self.strategy, self.ema)}  # collective: every rank calls state_dict

    def load_state_dict(self, state):
        self.ema = local_tensors(self.strategy, state["ema"])


def _average_of(cb):
    if isinstance(cb, StochasticWeightAveraging):
        return cb._average_model
    if isinstance(cb, EMAWeightAveraging):
        return cb._average_model.module
    return None


class Probe(L.Callback):
    """Last in the list, at the end of training (before the stage ends): the shapes each rank holds."""

    def on_train_end(self, trainer, pl_module):
        self.local_shapes = [tuple(p.shape) for p in pl_module.parameters()]
        self.average_shapes = None
        for cb in trainer.callbacks:
            average = _average_of(cb)
            if average is not None:
                self.average_shapes = [tuple(p.shape) for p in average.parameters()]
            elif isinstance(cb, UserEMA):
                self.average_shapes = [tuple(t.shape) for t in cb.ema]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sharded = args.devices > 1
    results = {}
    rank = 0

    def run(
        name,
        callbacks,
        epochs,
        *,
        scheduler=False,
        val=False,
        ckpt_path=None,
        state_dict_type="full",
        validate_after=False,
    ):
        nonlocal rank
        strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type=state_dict_type) if sharded else "auto"
        probe = Probe()
        callbacks = [*callbacks, probe]
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=strategy,
            max_epochs=epochs,
            limit_val_batches=1 if val else 0,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            callbacks=callbacks,
        )
        module = Module(scheduler)
        sampler = DistributedSampler(
            samples(SAMPLES), num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False
        )
        loader = DataLoader(samples(SAMPLES), batch_size=GLOBAL_BATCH // trainer.world_size, sampler=sampler)
        trainer.fit(module, loader, loader if val else None, ckpt_path=ckpt_path)
        rank = trainer.global_rank
        if validate_after:  # a second stage: the average is sharded again, swapped in for validation, given back
            results[f"{name}_validate"] = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
        # Once the stage has ended, the model and the averages are whole again on every strategy: read them as they are.
        out = {
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "local_shapes": probe.local_shapes,
            "average_shapes": probe.average_shapes,
            "val_loss": float(trainer.callback_metrics["val_loss"]) if val else None,
        }
        names = [n for n, _ in module.named_parameters()]
        for cb in callbacks:
            average = _average_of(cb)
            if isinstance(cb, StochasticWeightAveraging):
                out["n_averaged"] = int(cb.n_averaged)
            elif isinstance(cb, EMAWeightAveraging):
                out["n_averaged"] = int(cb._average_model.n_averaged)
            elif isinstance(cb, UserEMA):
                out["average"] = dict(zip(names, cb.full))
            if average is not None:
                assert [n for n, _ in average.named_parameters()] == names
                out["average"] = {n: p.detach().clone() for n, p in average.named_parameters()}
        results[name] = out
        return trainer

    d = args.dir
    full_ckpt = os.path.join(d, "swa.ckpt")
    run(
        "swa",
        [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1), SaveAt(2, full_ckpt)],
        4,
        scheduler=True,
    )
    run(
        "swa_resume",
        [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1)],
        4,
        scheduler=True,
        ckpt_path=full_ckpt,
    )
    ema_ckpt = os.path.join(d, "ema.ckpt")
    run("ema", [EMAWeightAveraging(decay=0.9), SaveAt(0, ema_ckpt)], 2, val=True, validate_after=True)
    run("ema_resume", [EMAWeightAveraging(decay=0.9)], 2, val=True, ckpt_path=ema_ckpt)
    user_ckpt = os.path.join(d, "user.ckpt")
    run("user_ema", [UserEMA(), SaveAt(1, user_ckpt)], 2)
    if sharded:
        local_ckpt = os.path.join(d, "swa_local.ckpt")
        run(
            "swa_local",
            [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1), SaveAt(2, local_ckpt)],
            4,
            scheduler=True,
            state_dict_type="local",
        )
        run(
            "swa_local_resume",
            [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1)],
            4,
            scheduler=True,
            ckpt_path=local_ckpt,
            state_dict_type="local",
        )
        sharded_ckpt = os.path.join(d, "ema_sharded.ckpt")
        run(
            "ema_sharded",
            [EMAWeightAveraging(decay=0.9), SaveAt(0, sharded_ckpt)],
            1,
            val=True,
            state_dict_type="sharded",
        )
        run(
            "ema_sharded_resume",
            [EMAWeightAveraging(decay=0.9)],
            2,
            val=True,
            ckpt_path=sharded_ckpt,
            state_dict_type="sharded",
        )
        try:
            run("user_ema_setup", [UserEMA(when="setup")], 1)
        except ValueError as exc:
            results["user_ema_setup"] = {"error": str(exc)}
    if rank == 0:
        # What the checkpoint files hold (full format, written by rank 0; directory formats: their meta.pt).
        results["files"] = {
            "swa": torch.load(full_ckpt, weights_only=False),
            "ema": torch.load(ema_ckpt, weights_only=False),
            "user": torch.load(user_ckpt, weights_only=False),
        }
        if sharded:
            results["files"]["swa_local_meta"] = torch.load(os.path.join(local_ckpt, "meta.pt"), weights_only=False)
            results["files"]["ema_sharded_meta"] = torch.load(os.path.join(sharded_ckpt, "meta.pt"), weights_only=False)
        torch.save(results, args.out)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        destroy_process_group()


if __name__ == "__main__":
    main()
