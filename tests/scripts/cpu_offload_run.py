"""Train ToyLM with Trainer(strategy=FSDPStrategy(cpu_offload=...)) and record where the model state lives.

    python tests/scripts/cpu_offload_run.py --out DIR --devices 2 --offload 1 [--accelerator gpu]

Lightning's launcher re-runs this script once per extra rank. Each rank writes DIR/rank<r>.pt: the per-step losses,
the device of every parameter shard, of its gradient and of its optimizer state right after the last optimizer step
(before anything is zeroed), and the module's full parameters after fit (the strategy hands them back on the host).
"""

import argparse
import os
import sys

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp import FSDPStrategy  # noqa: E402
from tests.toolbox.lightning_scripts import ToyLMModule, quiet_trainer  # noqa: E402
from tests.toolbox.models import Block, loss_fn, samples  # noqa: E402

GLOBAL_BATCH = 4
SAMPLES = 16


class Module(ToyLMModule):
    def __init__(self) -> None:
        super().__init__()
        self.step_losses: list[float] = []
        self.placement: dict[str, dict[str, str]] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self.model(x), y)
        self.step_losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # After this batch's optimizer step; Lightning zeroes the gradients only at the next step.
        optimizer = self.trainer.optimizers[0]
        self.placement = {
            name: {
                "shard": str(p.device),
                "grad": str(p.grad.device) if p.grad is not None else "none",
                "state": sorted(
                    {str(v.device) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)}
                ),
            }
            for name, p in self.named_parameters()
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--offload", type=int, choices=(0, 1), required=True)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = FSDPStrategy(auto_wrap_policy={Block}, cpu_offload=bool(args.offload))
    trainer = quiet_trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_epochs=1,
        use_distributed_sampler=False,
    )
    module = Module()
    # Rank r takes samples r, r+N, ...: every step's global batch is the same whatever the number of ranks.
    data = samples(SAMPLES)
    sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // args.devices, sampler=sampler))
    state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    torch.save(
        {
            "losses": module.step_losses,
            "placement": module.placement,
            "state": state,
            "root_device": str(trainer.strategy.root_device),
        },
        os.path.join(args.out, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main()
