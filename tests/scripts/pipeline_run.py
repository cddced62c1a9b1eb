"""Train a chain model with pipeline parallelism under Lightning, as a user's script would, and record the result.

    python tests/scripts/pipeline_run.py --out DIR --devices 4 --pp 2 --schedule 1F1B [--accumulate 2 --clip 1]
    python tests/scripts/pipeline_run.py --out DIR --devices 1 --pp 1      # the one-device reference
    python tests/scripts/pipeline_run.py --out A ... --and --out B ...     # several runs, one after another

The LightningModule is the same in both: its steps call ``pipelined_loss``, which is the plain
``loss_fn(model(x), y)`` without pipelining. The data-parallel rank d takes samples d, d+D, ... of each global batch
(``use_distributed_sampler=False``), so every step's global batch is the reference's. Each rank writes
DIR/rank<r>.pt: the losses the steps returned, the logged metrics, and the full values of the pieces it holds.
"""

import argparse
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp import FSDPStrategy, pipelined_loss  # noqa: E402
from tests.toolbox.launch import argument_groups  # noqa: E402
from tests.toolbox.lightning_scripts import quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, ChainLM, loss_fn, samples  # noqa: E402

GLOBAL_BATCH = 8
SAMPLES = 48
VOCAB, DIM = 7, 6


def chain_lm() -> ChainLM:
    """Embedding, four blocks of different widths, a norm and a head."""
    return ChainLM(VOCAB, DIM, lambda: [Block(DIM, 5), Block(DIM, 4), Block(DIM, 6), Block(DIM, 3)])


class Module(L.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = chain_lm()
        self.optimizer_name = optimizer
        self.direct = False
        self.step_losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.direct:  # a user's mistake: the split model called as if it were whole
            return loss_fn(self.model(x), y)
        loss = pipelined_loss(self.model, x, y, loss_fn)
        self.step_losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = pipelined_loss(self.model, x, y, loss_fn)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--wrap", action="store_true")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--checkpointing", action="store_true")  # activation checkpointing of every Block
    parser.add_argument("--direct", action="store_true")  # training_step calls self.model(x) (must be refused)
    parser.add_argument("--split", nargs="*", default=None)  # pipeline_split
    return parser


def main() -> None:
    torch.set_num_threads(1)
    runs = [parser().parse_args(group) for group in argument_groups(sys.argv[1:])]
    assert len({args.devices for args in runs}) == 1, "the runs of one launch share its processes"
    for args in runs:
        run(args)


def run(args: argparse.Namespace) -> None:
    if args.devices == 1:
        strategy = "auto"
    else:
        strategy = FSDPStrategy(
            pipeline_parallel_size=args.pp,
            pipeline_schedule=args.schedule,
            pipeline_microbatches=args.micro,
            pipeline_split=args.split,
            auto_wrap_policy={Block} if args.wrap else None,
            sharding_strategy=args.sharding,
            activation_checkpointing_policy={Block} if args.checkpointing else None,
        )
    clip = {"gradient_clip_val": args.clip, "gradient_clip_algorithm": "norm"} if args.clip else {}
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        accumulate_grad_batches=args.accumulate,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        precision=args.precision,
        **clip,
    )
    module = Module(args.optimizer)
    module.direct = args.direct
    data = args.devices // args.pp
    dp_rank = trainer.global_rank % data
    sampler = DistributedSampler(samples(SAMPLES), num_replicas=data, rank=dp_rank, shuffle=False)
    loader = DataLoader(samples(SAMPLES), batch_size=GLOBAL_BATCH // data, sampler=sampler)
    trainer.fit(module, loader, loader)
    state = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    result = {
        "losses": module.step_losses,
        "val_losses": module.val_losses,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "state": state,
    }
    os.makedirs(args.out, exist_ok=True)
    torch.save(result, os.path.join(args.out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
