"""Checkpoints across pipeline layouts, for tests/pipeline/test_pipeline_checkpoint.py: several jobs per launch (one
process group, a fresh Trainer and LightningModule per job), run the way users run scripts.

    python tests/scripts/pipeline_checkpoint_run.py --out DIR --devices 4 --pp 2 --jobs JSON   # P=2 x D=2
    python tests/scripts/pipeline_checkpoint_run.py --out DIR --devices 4 --pp 2 --schedule Interleaved1F1B ...
    python tests/scripts/pipeline_checkpoint_run.py --out DIR --devices 2 --pp 1 --jobs JSON   # plain fsdp_custom
    python tests/scripts/pipeline_checkpoint_run.py --out DIR --devices 2 --strategy ddp --jobs JSON
    python tests/scripts/pipeline_checkpoint_run.py --out DIR --devices 1 --strategy single --jobs JSON

The LightningModule is tests/scripts/pipeline_run.py's (ChainLM; its steps call ``pipelined_loss``), with SGD +
momentum over two param groups (matrices with weight decay, the rest without) or over ``self.parameters()``
(``"groups": 1``). An epoch is 2 steps of the same global batches of 8 samples on every layout (data-parallel rank
d of D takes samples d, d+D, ...). A job is ``{"name", "epochs", "groups", "resume", "save_full", "save_sharded",
"save_local"}``: ``fit(ckpt_path=resume)`` for ``epochs`` epochs, saving at the end of the first epoch (where
ModelCheckpoint saves) in each format named. Each rank writes DIR/rank<r>.pt: per job either ``{"error": (type,
message)}`` or the per-step losses (this rank's), the save errors, and at ``on_train_end`` (before teardown) the
full values of the parameters and momentum buffers of the pieces this rank holds, by parameter name, gathered over
the rank's data-parallel group with the P=1 full-state functions (not the pipeline checkpoint code).
"""

import argparse
import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.checkpoint.full import full_model_state_dict, full_optimizer_state_dict  # noqa: E402
from lightning_fsdp.checkpoint.routing import parse_state_dict_type  # noqa: E402
from tests.scripts.pipeline_run import GLOBAL_BATCH, SAMPLES, Module  # noqa: E402
from tests.toolbox.lightning_scripts import quiet_trainer  # noqa: E402
from tests.toolbox.models import samples  # noqa: E402

STEPS_PER_EPOCH = 2


class CheckpointModule(Module):
    def __init__(self, groups: int) -> None:
        super().__init__("sgd")
        self.groups = groups

    def configure_optimizers(self):
        if self.groups == 1:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        matrices = [p for _, p in self.named_parameters() if p.dim() >= 2]
        rest = [p for _, p in self.named_parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def held_state(trainer: L.Trainer, module: L.LightningModule) -> dict:
    """This rank's pieces: full parameters and momentum buffers by parameter name (collective under fsdp_custom)."""
    engine = getattr(trainer.strategy, "engine", None)
    (optimizer,) = trainer.optimizers
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    if engine is not None:
        params = full_model_state_dict(engine, rank0_only=False)
        optim = full_optimizer_state_dict(engine, optimizer, rank0_only=False)
        momentum = {order[int(i)]: e["momentum_buffer"] for i, e in optim["state"].items()}
    else:
        params = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        momentum = {names[id(p)]: s["momentum_buffer"].detach().cpu().clone() for p, s in optimizer.state.items()}
    return {
        "params": {k: v for k, v in params.items() if k in set(names.values())},
        "momentum": momentum,
        "names": [n for n, _ in module.named_parameters()],
        "groups": [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups],
    }


class Record(L.Callback):
    def __init__(self, job: dict) -> None:
        self.job = job
        self.result: dict = {"save_errors": {}}

    def on_train_start(self, trainer, module):
        self.result["start_step"] = trainer.global_step

    def on_train_epoch_end(self, trainer, module):
        if trainer.current_epoch != 0:
            return
        for kind in ("full", "sharded", "local"):
            path = self.job.get(f"save_{kind}")
            if not path:
                continue
            if isinstance(trainer.strategy, FSDPStrategy):
                trainer.strategy.state_dict_type = parse_state_dict_type(kind)
            try:
                trainer.save_checkpoint(path)
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                self.result["save_errors"][kind] = (type(exc).__name__, str(exc))

    def on_train_end(self, trainer, module):
        self.result.update(held_state(trainer, module), end_step=trainer.global_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp", "single"])
    parser.add_argument("--schedule", default="1F1B")  # Interleaved1F1B: pipeline rank 0 holds stages 0 and 2
    parser.add_argument("--jobs", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    results, rank = {}, 0
    for job in json.loads(args.jobs):
        if args.strategy == "fsdp":
            strategy = FSDPStrategy(
                pipeline_parallel_size=args.pp, pipeline_schedule=args.schedule, pipeline_microbatches=2
            )
        else:
            strategy = "ddp" if args.strategy == "ddp" else "auto"
        record = Record(job)
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=strategy,
            max_epochs=job.get("epochs", 2),
            limit_train_batches=STEPS_PER_EPOCH,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            callbacks=[record],
        )
        module = CheckpointModule(job.get("groups", 2))
        data = args.devices // (args.pp if args.strategy == "fsdp" else 1)
        sampler = DistributedSampler(
            samples(SAMPLES), num_replicas=data, rank=trainer.global_rank % data, shuffle=False
        )
        loader = DataLoader(samples(SAMPLES), batch_size=GLOBAL_BATCH // data, sampler=sampler)
        try:
            trainer.fit(module, loader, ckpt_path=job.get("resume"))
            results[job["name"]] = {"ok": True, "losses": module.step_losses, **record.result}
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            results[job["name"]] = {"error": (type(exc).__name__, str(exc))}
        rank = trainer.global_rank
    os.makedirs(args.out, exist_ok=True)
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank's results are written before rank 0 exits (and stops the others)


if __name__ == "__main__":
    main()
