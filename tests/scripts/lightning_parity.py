"""Train ToyLM with Lightning, as a user's script would, and write losses and final parameters to --out.

Run with ``--devices 2 --strategy fsdp_custom`` (Lightning's launcher re-runs this script per rank) or with
``--devices 1 --strategy auto`` for the single-process reference on the same global batches. Several runs in one
launch: their arguments joined by ``--and`` (tests/toolbox/launch.py), each with its own ``--out``.
"""

import argparse
import os
import sys

import lightning as L
import torch
import torchmetrics
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp import FSDPStrategy  # noqa: E402
from tests.toolbox.launch import argument_groups  # noqa: E402
from tests.toolbox.lightning_scripts import quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, ToyLM, loss_fn, samples  # noqa: E402

GLOBAL_BATCH = 6
SAMPLES = 48


class ZeroGradWatcher(L.Callback):
    """A callback with ``on_before_zero_grad``: counts the gradients Lightning's zeroing finds."""

    def __init__(self) -> None:
        self.grads_before_zero = []

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self.grads_before_zero.append(sum(p.grad is not None for p in pl_module.parameters()))


class Module(L.LightningModule):
    def __init__(self, optimizer: str, meta: bool) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.meta = meta
        self.step_losses = []
        self.grads_at_step = []
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=7)
        if not meta:
            torch.manual_seed(0)
            self.model = ToyLM()

    def configure_model(self):
        if self.meta and not hasattr(self, "model"):
            self.model = ToyLM()

    def training_step(self, b, i):
        # How many parameters still hold a gradient when the step starts (the last step's, under Lightning's order).
        self.grads_at_step.append(sum(p.grad is not None for p in self.parameters()))
        x, y = b
        loss = loss_fn(self.model(x), y)
        self.step_losses.append(self.all_gather(loss.detach()).mean().item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_end(self):
        # The fit's engine (validate, test and predict shard the model afresh, with counters of their own).
        engine = getattr(self.trainer.strategy, "engine", None)
        self.fit_reduce_scatter_calls = engine.shard_comm.stats.reduce_scatter_calls if engine is not None else 0

    def validation_step(self, b, i):
        x, y = b
        logits = self.model(x)
        self.val_acc(logits.flatten(0, 1), y.flatten())
        self.log("val_loss", loss_fn(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc)

    def test_step(self, b, i):
        x, y = b
        self.log("test_loss", loss_fn(self.model(x), y), sync_dist=True)

    def predict_step(self, b, i):
        return self.model(b[0]).argmax(-1)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.requires_grad and not n.endswith("bias")]
        no_decay = [p for n, p in self.named_parameters() if p.requires_grad and n.endswith("bias")]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.AdamW(groups, lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp_custom")
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", default="none")  # none | norm | value
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--watch-zero-grad", action="store_true")  # a callback with on_before_zero_grad
    return parser


def main() -> None:
    torch.set_num_threads(1)
    runs = [parser().parse_args(group) for group in argument_groups(sys.argv[1:])]
    assert len({args.devices for args in runs}) == 1, "the runs of one launch share its processes"
    for args in runs:
        run(args)


def run(args: argparse.Namespace) -> None:

    strategy = args.strategy
    if strategy == "fsdp_custom" and (args.sharding != "FULL_SHARD"):
        strategy = FSDPStrategy(sharding_strategy=args.sharding, auto_wrap_policy={Block})
    elif strategy == "fsdp_custom_blocks":
        strategy = FSDPStrategy(auto_wrap_policy={Block})
    elif strategy == "fsdp_custom_deferred_sync":
        strategy = FSDPStrategy(auto_wrap_policy={Block}, sync_gradients_while_accumulating=False)
    elif strategy == "fsdp_custom_checkpointed":
        # Class paths, as a YAML config would give them.
        strategy = FSDPStrategy(
            auto_wrap_policy={"tests.toolbox.models.Block"},
            activation_checkpointing_policy={"tests.toolbox.models.Block"},
        )
    watcher = ZeroGradWatcher() if args.watch_zero_grad else None
    clip = {} if args.clip == "none" else {"gradient_clip_val": 0.05, "gradient_clip_algorithm": args.clip}
    trainer = quiet_trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=6,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        accumulate_grad_batches=args.accumulate,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        precision=args.precision,
        callbacks=[watcher] if watcher else [],
        **clip,
    )
    with trainer.init_module(empty_init=args.meta):
        module = Module(args.optimizer, meta=args.meta)
    per_rank = GLOBAL_BATCH // args.devices
    # Rank r takes samples r, r+N, ...: every step's global batch is the reference's batch.
    sampler = DistributedSampler(
        samples(SAMPLES), num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False
    )
    loader = DataLoader(samples(SAMPLES), batch_size=per_rank, sampler=sampler)
    if args.meta:
        torch.manual_seed(0)
    trainer.fit(module, loader, loader)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    val = trainer.validate(module, loader, verbose=False)[0]
    test = trainer.test(module, loader, verbose=False)[0]
    preds = trainer.predict(module, loader)
    engine = getattr(trainer.strategy, "engine", None)
    # Once a stage ends, fsdp_custom hands back an ordinary module with its full weights: read it like any other.
    assert engine is None or lightning_fsdp.engine.get_engine(module) is None
    full = {k: v.detach().clone() for k, v in module.state_dict().items()}
    strategy = trainer.strategy
    strategy.barrier("after-predict")
    rank = trainer.global_rank
    collectives = {
        "broadcast": strategy.broadcast(f"from rank {rank}", src=0),
        "reduce_sum": float(strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum")),
        "reduce_mean": float(strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="mean")),
        "all_gather": strategy.all_gather(torch.tensor([rank, 10 * rank])).tolist(),
    }
    placement = {
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "device": str(getattr(strategy, "device", strategy.root_device)),
    }
    if trainer.is_global_zero:
        gathered = engine.shard_comm.stats.all_gather_bytes if engine is not None else 0
        torch.save(
            {
                "collectives": collectives,
                "placement": placement,
                "all_gather_bytes": gathered,
                "reduce_scatter_calls": module.fit_reduce_scatter_calls,
                "losses": module.step_losses,
                "grads_at_step": module.grads_at_step,
                "grads_before_zero": watcher.grads_before_zero if watcher else None,
                "state": full,
                "val": val,
                "test": test,
                "fit_metrics": metrics,
                "preds": torch.cat(preds),
                "names": [n for n, _ in module.named_parameters()],
            },
            args.out,
        )


if __name__ == "__main__":
    main()
