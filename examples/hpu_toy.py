"""A toy model trained with FSDP on Intel Gaudi (HPU), as a LightningModule with ``strategy="fsdp_custom"``.

This is the classic "FSDP toy example" for Gaudi (a two-layer MLP, random data, SGD, one process per HPU started
with ``torch.multiprocessing`` and wrapped in torch's ``FullyShardedDataParallel``), rewritten for Lightning: the
Trainer starts the processes, picks the HCCL backend and shards the model with this project's engine.

On a Gaudi machine (eager mode is required; this script sets PT_HPU_LAZY_MODE=0 unless you set it yourself)::

    python examples/hpu_toy.py                     # all HPUs of the machine
    python examples/hpu_toy.py --devices 2
    PT_HPU_EAGER_PIPELINE_ENABLE=0 python examples/hpu_toy.py   # if eager mode shows stability problems

Anywhere else (two CPU processes, gloo)::

    python examples/hpu_toy.py --cpu

Lightning's launcher starts the other ranks by re-running this script, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import os

# Both must be set before torch is imported: the Gaudi bridge (auto-loaded by `import torch` on recent releases)
# reads PT_HPU_LAZY_MODE once, at import. FSDP needs eager mode; the strategy refuses lazy mode with an error.
os.environ.setdefault("PT_HPU_LAZY_MODE", "0")
# One thread per process: ranks on one machine share its cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_fsdp  # noqa: E402,F401  (registers strategy "fsdp_custom" and accelerator "hpu")
from accelerators import HPUAccelerator, register_hpu_accelerator  # noqa: E402


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class ToyModule(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.model = ToyModel()
        self.num_model_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.losses.append(self.all_gather(loss.detach()).mean().item())  # the global batch's mean loss
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        # Built here, after sharding: the optimizer (and its momentum) sees only this rank's shards.
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def toy_data(samples: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 10, generator=g)
    y = x[:, :5] * 0.5 - x[:, 5:] * 0.25  # a target the MLP can learn, so the loss visibly falls
    return TensorDataset(x, y)


def hpu_accelerator():
    """``"hpu"`` when that name is ours; an explicit instance when another package (e.g. lightning-habana) owns it."""
    return "hpu" if register_hpu_accelerator() else HPUAccelerator()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on 2 CPU processes (gloo) instead of HPUs")
    parser.add_argument("--devices", default=None, help="HPUs to use (default: all; 2 with --cpu)")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    args = parser.parse_args()

    if args.cpu:
        accelerator, devices = "cpu", args.devices or 2
    else:
        accelerator, devices = hpu_accelerator(), args.devices or "auto"
    L.seed_everything(0, verbose=False)  # every rank builds the same initial model
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy="fsdp_custom",
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    module = ToyModule()
    # Lightning adds a DistributedSampler: each rank gets a different part of every epoch.
    trainer.fit(module, DataLoader(toy_data(), batch_size=args.batch_size, shuffle=True))

    engine = trainer.strategy.engine
    held = trainer.strategy.all_gather(torch.tensor([engine.local_param_bytes()])).flatten().tolist()
    if trainer.is_global_zero:
        device = trainer.strategy.root_device if args.cpu else trainer.strategy.device
        print(
            f"\n{trainer.world_size} ranks on {device.type} (backend {trainer.strategy.process_group_backend}), "
            f"{trainer.global_step} steps"
        )
        print(f"loss: first step {module.losses[0]:.4f} -> last step {module.losses[-1]:.4f}")
        print(f"parameter bytes per rank: {held} (full model: {module.num_model_bytes})")


if __name__ == "__main__":
    main()
