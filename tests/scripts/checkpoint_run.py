"""Full-checkpoint scenarios for tests/checkpoint/test_checkpoint_full.py, run the way users run scripts.

``--mode train``: train ToyLM with Lightning for ``--epochs`` epochs of 3 steps (global batch 6 on every strategy),
optionally resuming with ``fit(ckpt_path=--resume)`` and saving with ``trainer.save_checkpoint`` after fit
(``--save``) or at the end of the first epoch (``--save-in-fit``, where ``ModelCheckpoint`` would save).
With ``--devices 2`` Lightning's launcher re-runs this script per rank. Rank 0 writes to ``--out``: the per-step
losses and learning rates, the full parameters and optimizer/scheduler state as found at ``on_train_start`` (i.e.
just after a resume restored them) and at the end.

``--state-dict-type sharded|local`` (fsdp_custom) writes directory checkpoints instead; ``--save-at-start`` saves
right after a resume restored the state (to re-save it at another world size); ``--save-weights-only`` saves a
weights-only checkpoint after fit; ``--model-checkpoint DIR`` adds a ``ModelCheckpoint(save_top_k=1,
save_last=True)``; ``--kill-in-second-save RANK`` saves to ``--save-in-fit`` again after fit, and that rank SIGKILLs
itself in the middle of writing its part of that save.

``--mode killsave``: save a large checkpoint to ``--save`` through ``AtomicCheckpointIO``, and SIGKILL this process
once ``--kill-after`` bytes of it have reached the temporary file (``--no-atomic``: write the path directly instead,
as a non-atomic save would).
"""

import argparse
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

STEPS_PER_EPOCH = 3
GLOBAL_BATCH = 6
SAMPLES = 48


# ----------------------------------------------------------------------------------------------- kill mid-save
class _KillingFile:
    """A file wrapper that SIGKILLs the process once ``limit`` bytes were written (and made durable)."""

    def __init__(self, f, limit: int) -> None:
        self._f = f
        self._limit = limit
        self.written = 0

    def write(self, data) -> int:
        n = self._f.write(data)
        self.written += len(memoryview(data).cast("B"))
        if self.written >= self._limit:
            self._f.flush()
            os.fsync(self._f.fileno())
            sys.stdout.write(f"pid {os.getpid()}: killing myself after {self.written} bytes\n")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)


def kill_save(path: str, kill_after: int, atomic: bool) -> None:
    from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO

    g = torch.Generator().manual_seed(123)
    checkpoint = {
        "state_dict": {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(16)},  # 32 MiB
        "epoch": 99,
        "note": "this checkpoint must never appear at the path",
    }

    class KillingIO(AtomicCheckpointIO):
        def _write(self, ckpt, f):
            super()._write(ckpt, _KillingFile(f, kill_after))

    if atomic:
        KillingIO().save_checkpoint(checkpoint, path)
    else:
        with open(path, "wb") as f:
            torch.save(checkpoint, _KillingFile(f, kill_after))
    raise SystemExit("the save finished; the kill did not happen")


def _arm_kill_in_save(state_dict_type: str) -> None:
    """Make this process SIGKILL itself in the middle of writing its part of the next directory checkpoint: after
    the first tensor of its DCP shard file (sharded), or after 1 KiB of its rank file (local)."""

    def die(what: str) -> None:
        sys.stdout.write(f"pid {os.getpid()}: killing myself in the middle of {what}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    if state_dict_type == "sharded":
        import torch.distributed.checkpoint.filesystem as fs

        original = fs._write_item

        def write_item(*a, **k):
            result = original(*a, **k)
            stream = a[1]
            stream.flush()
            os.fsync(stream.fileno())
            die("writing a DCP shard file")
            return result

        fs._write_item = write_item
    else:
        import lightning_fsdp.checkpoint.local as local

        def write_file(obj, file):
            with open(file, "wb") as f:
                torch.save(obj, _KillingFile(f, 1024))

        local._write_file = write_file


# ----------------------------------------------------------------------------------------------------- training
def train(args) -> None:
    import lightning as L
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import lightning_fsdp  # noqa: F401  registers "fsdp_custom"
    from lightning_fsdp import FSDPStrategy
    from lightning_fsdp.checkpoint.full import full_model_state_dict, full_optimizer_state_dict
    from tests.toolbox.lightning_scripts import quiet_trainer
    from tests.toolbox.models import Block, ToyLM, loss_fn, samples

    class Module(L.LightningModule):
        def __init__(self, optimizer: str) -> None:
            super().__init__()
            self.optimizer_name = optimizer
            self.records = []  # (global_step, loss averaged over ranks, lr of group 0)
            torch.manual_seed(0)
            self.model = ToyLM()

        def training_step(self, b, i):
            x, y = b
            loss = loss_fn(self.model(x), y)
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            self.records.append((self.global_step, self.all_gather(loss.detach()).mean().item(), lr))
            return loss

        def validation_step(self, b, i):
            x, y = b
            self.log("val_loss", loss_fn(self.model(x), y), sync_dist=True)

        def configure_optimizers(self):
            decay = [p for n, p in self.named_parameters() if p.requires_grad and not n.endswith("bias")]
            no_decay = [p for n, p in self.named_parameters() if p.requires_grad and n.endswith("bias")]
            groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
            if self.optimizer_name == "sgd":
                return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
            opt = torch.optim.AdamW(groups, lr=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def snapshot(trainer, module) -> dict:
        """Full parameters and optimizer states on rank 0 (collective under fsdp_custom)."""
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            params = full_model_state_dict(engine)
            optim = [full_optimizer_state_dict(engine, opt) for opt in trainer.optimizers]
        else:
            params = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
            optim = [opt.state_dict() for opt in trainer.optimizers]
            optim = [
                {
                    "state": {
                        i: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in e.items()}
                        for i, e in o["state"].items()
                    },
                    "param_groups": o["param_groups"],
                }
                for o in optim
            ]
        return {
            "params": params,
            "optimizer_states": optim,
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
        }

    class Snapshot(L.Callback):
        saved = None

        def on_train_start(self, trainer, module):
            self.start = snapshot(trainer, module)
            if args.save_at_start:
                trainer.save_checkpoint(args.save_at_start)

        def on_train_epoch_end(self, trainer, module):
            # Where ModelCheckpoint saves: a checkpoint taken during fit, at the end of the first epoch.
            if args.save_in_fit and trainer.current_epoch == 0:
                self.saved = snapshot(trainer, module)
                trainer.save_checkpoint(args.save_in_fit)

    torch.set_num_threads(1)
    if args.strategy == "fsdp":
        from datetime import timedelta

        strategy = FSDPStrategy(
            auto_wrap_policy={Block}, state_dict_type=args.state_dict_type, timeout=timedelta(seconds=args.pg_timeout)
        )  # writes atomically by default
    elif args.strategy == "ddp":
        strategy = "ddp"
    else:
        strategy = "auto"
    callback = Snapshot()
    callbacks = [callback]
    if args.model_checkpoint:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=args.model_checkpoint, save_top_k=1, save_last=True))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        limit_train_batches=STEPS_PER_EPOCH,
        limit_val_batches=1,
        enable_checkpointing=bool(args.model_checkpoint),
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    with trainer.init_module():
        module = Module(args.optimizer)
    # Rank r takes samples r, r+N, ...: every step's global batch is the same 6 samples on any number of devices.
    sampler = DistributedSampler(
        samples(SAMPLES), num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False
    )
    loader = DataLoader(samples(SAMPLES), batch_size=GLOBAL_BATCH // trainer.world_size, sampler=sampler)
    trainer.fit(module, loader, ckpt_path=args.resume)
    if args.kill_in_second_save is not None:
        if trainer.global_rank == args.kill_in_second_save:
            _arm_kill_in_save(args.state_dict_type)
        trainer.save_checkpoint(args.save_in_fit)
        raise SystemExit("the second save finished; the kill did not happen")
    if args.save:
        trainer.save_checkpoint(args.save)
    if args.save_weights_only:
        trainer.save_checkpoint(args.save_weights_only, weights_only=True)
    end = snapshot(trainer, module)
    validated = None
    if args.validate_ckpt:
        # validate(ckpt_path=...) restores only the model, into the already sharded module.
        trainer.validate(module, loader, ckpt_path=args.validate_ckpt, verbose=False)
        engine = getattr(trainer.strategy, "engine", None)
        validated = full_model_state_dict(engine) if engine is not None else module.state_dict()
    if trainer.is_global_zero:
        torch.save(
            {
                "records": module.records,
                "start": callback.start,
                "end": end,
                "validated": validated,
                "saved": callback.saved,
                "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__,
            },
            args.out,
        )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="train", choices=["train", "killsave"])
    parser.add_argument("--out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp", "single"])
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume")
    parser.add_argument("--save", help="trainer.save_checkpoint(path) after fit")
    parser.add_argument("--save-in-fit", help="trainer.save_checkpoint(path) at the end of the first epoch")
    parser.add_argument("--validate-ckpt", help="after fit, trainer.validate(ckpt_path=path) and record the params")
    parser.add_argument("--state-dict-type", default="full", choices=["full", "sharded", "local"])
    parser.add_argument("--save-at-start", help="trainer.save_checkpoint(path) at on_train_start (after a resume)")
    parser.add_argument("--save-weights-only", help="trainer.save_checkpoint(path, weights_only=True) after fit")
    parser.add_argument("--model-checkpoint", help="add ModelCheckpoint(dirpath=..., save_top_k=1, save_last=True)")
    parser.add_argument(
        "--kill-in-second-save",
        type=int,
        default=None,
        metavar="RANK",
        help="save to --save-in-fit again after fit; rank RANK SIGKILLs itself in the middle of it",
    )
    parser.add_argument("--pg-timeout", type=float, default=1800.0, help="process group timeout in seconds")
    parser.add_argument("--kill-after", type=int, default=8 << 20)
    parser.add_argument("--no-atomic", action="store_true")
    return parser


def main() -> None:
    from tests.toolbox.launch import argument_groups

    # Several training runs may share the launch (``--and`` between their arguments), one after another.
    for args in [parser().parse_args(group) for group in argument_groups(sys.argv[1:])]:
        if args.mode == "killsave":
            kill_save(args.save, args.kill_after, atomic=not args.no_atomic)
        else:
            train(args)


if __name__ == "__main__":
    main()
