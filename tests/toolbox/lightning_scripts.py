"""What the Lightning test scripts (tests/scripts/) share: a quiet Trainer, ToyLM as a LightningModule, and each
rank's results written for the test that launched them.

Imports Lightning: the scripts import it, and the tests only through a script they read constants from.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning as L
import torch

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.shutdown import destroy_process_group
from tests.toolbox.models import Block, ToyLM, loss_fn
from tests.toolbox.training import sgd_with_momentum

# No logger, checkpoint callback, progress bar or model summary: a script's output is its traceback, if any.
QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def quiet_trainer(**options: Any) -> L.Trainer:
    """``L.Trainer(**options)`` with :data:`QUIET`'s settings where ``options`` do not say otherwise."""
    return L.Trainer(**{**QUIET, **options})


def one_step_trainer(**strategy_options: Any) -> L.Trainer:
    """2 CPU ranks, one training step, ToyLM's Blocks as units, a 60 s collective timeout, one batch of each of
    validation, test and predict: the Trainer of the scripts that check what a call or a load does on every rank."""
    strategy = FSDPStrategy(auto_wrap_policy={Block}, timeout=timedelta(seconds=60), **strategy_options)
    return quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
    )


class ToyLMModule(L.LightningModule):
    """ToyLM from seed 0 as ``self.model``, trained on ``loss_fn`` with SGD and momentum: the module of most scripts,
    which override what their scenario changes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ToyLM()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return loss_fn(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return sgd_with_momentum(self.parameters())


def save_rank_results(results: object, out: str, rank: int) -> None:
    """This rank's ``results`` in ``{out}.rank{rank}``; then, in a process group, every rank waits for the others
    before the group ends: rank 0 exits (stopping the ranks it launched) once every rank has written."""
    torch.save(results, f"{out}.rank{rank}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        destroy_process_group()
