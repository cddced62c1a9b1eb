"""Train the tiny GPT for a few steps under each sharding strategy with ShardingMonitor and a CSVLogger.

Run as a user's script (Lightning's launcher re-runs it once per extra rank):

    python tests/scripts/monitor_run.py --out DIR --devices 2 --strategies FULL_SHARD SHARD_GRAD_OP

Each strategy logs to DIR/<strategy>/ (CSVLogger's metrics.csv). Both trainers share one launch: the second
finds the processes and the process group that the first one started.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.demo.data import CharDataModule  # noqa: E402
from lightning_fsdp.demo.gpt import Block  # noqa: E402
from lightning_fsdp.demo.module import GPTLightningModule  # noqa: E402
from lightning_fsdp.monitor import ShardingMonitor  # noqa: E402
from tests.toolbox.lightning_scripts import quiet_trainer  # noqa: E402

# Shared with tests/strategy/test_monitor.py, which estimates the same model.
MODEL = {"vocab_size": 65, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}
STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=["FULL_SHARD", "SHARD_GRAD_OP"])
    args = parser.parse_args()
    for sharding in args.strategies:
        L.seed_everything(0, verbose=False)
        data = CharDataModule(block_size=32, batch_size=4, train_samples=4 * args.devices * STEPS, seed=0)
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=FSDPStrategy(sharding_strategy=sharding, auto_wrap_policy={Block}),
            max_steps=STEPS,
            limit_val_batches=0,
            logger=CSVLogger(os.path.join(args.out, sharding), name="", version=""),
            log_every_n_steps=1,
            callbacks=[ShardingMonitor()],
        )
        trainer.fit(GPTLightningModule(**MODEL), datamodule=data)


if __name__ == "__main__":
    main()
