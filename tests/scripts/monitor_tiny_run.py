"""Train a two-Linear model whose byte counts fit in a comment, with ShardingMonitor and a CSVLogger.

    python tests/scripts/monitor_tiny_run.py --out DIR --strategies FULL_SHARD SHARD_GRAD_OP NO_SHARD

Two CPU processes (Lightning's launcher re-runs this script for rank 1), each nn.Linear its own unit, SGD with
momentum; each strategy logs to DIR/<strategy>/metrics.csv. tests/strategy/test_monitor.py holds the hand-computed
bytes.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.monitor import ShardingMonitor  # noqa: E402
from tests.toolbox.lightning_scripts import quiet_trainer  # noqa: E402

STEPS = 2
BATCH = 2  # per rank


class TwoLinears(L.LightningModule):
    """a: Linear(4, 3) (weight 3x4, bias 3); b: Linear(3, 2) (weight 2x3, bias 2). 23 floats, all trainable."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategies", nargs="+", default=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for sharding in args.strategies:
        L.seed_everything(0, verbose=False)
        data = TensorDataset(torch.randn(2 * BATCH * STEPS, 4), torch.randn(2 * BATCH * STEPS, 2))
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=2,
            strategy=FSDPStrategy(sharding_strategy=sharding, auto_wrap_policy={nn.Linear}),
            max_steps=STEPS,
            logger=CSVLogger(os.path.join(args.out, sharding), name="", version=""),
            log_every_n_steps=1,
            callbacks=[ShardingMonitor()],
        )
        trainer.fit(TwoLinears(), DataLoader(data, batch_size=BATCH))


if __name__ == "__main__":
    main()
