"""Pipeline parallelism with sharding: a character GPT cut into 2 stages, each sharded over 2 ranks (4 CPU processes).

    pip install -e .
    python examples/pipeline.py                          # 1F1B, 4 microbatches, about a minute on 2 cores
    python examples/pipeline.py --schedule Interleaved1F1B --max-steps 40

The LightningModule is an ordinary one: its model is ``PipelineGPT`` (embedding, blocks, final norm, head: a forward
that is a chain over those pieces), its steps return ``pipelined_loss(self.model, x, y, loss_fn)``, and its optimizer
is built from ``self.parameters()``. The strategy does the rest: ranks 0-1 hold stage 0 (the embedding and the first
blocks), ranks 2-3 stage 1, each stage sharded over its two ranks; every step's batch is cut into microbatches that
flow through the stages under torch.distributed.pipelining's schedule. See docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the 4 ranks share the cores

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_fsdp import FSDPStrategy, pipelined_loss  # noqa: E402
from lightning_fsdp.demo.data import CharDataModule  # noqa: E402
from lightning_fsdp.demo.gpt import Block, GPTConfig, PipelineGPT, next_token_loss  # noqa: E402


class PipelinedGPTModule(L.LightningModule):
    def __init__(self, vocab_size: int, block_size: int = 64, n_layer: int = 4, n_embd: int = 128) -> None:
        super().__init__()
        config = GPTConfig(vocab_size, block_size, n_layer=n_layer, n_head=4, n_embd=n_embd, tie_weights=False)
        self.model = PipelineGPT(config)
        self.first_loss = float("nan")

    def training_step(self, batch, batch_idx):
        x, y = batch
        # The whole global batch's loss: every microbatch's forward and backward ran inside this call.
        loss = pipelined_loss(self.model, x, y, next_token_loss)
        if batch_idx == 0:
            self.first_loss = loss.item()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", pipelined_loss(self.model, x, y, next_token_loss), prog_bar=True)

    def configure_optimizers(self):
        # This rank's stage only: the other pieces are not this rank's parameters.
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1F1B", choices=["GPipe", "1F1B", "Interleaved1F1B"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)

    data = CharDataModule(block_size=64, batch_size=8, train_samples=2000, val_samples=64)
    strategy = FSDPStrategy(
        auto_wrap_policy={Block},  # each block its own unit within its stage
        pipeline_parallel_size=2,
        pipeline_schedule=args.schedule,
        pipeline_microbatches=args.microbatches,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=args.max_steps,
        limit_val_batches=2,
        gradient_clip_val=1.0,  # by the norm over every stage and shard
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = PipelinedGPTModule(data.vocab_size)
    trainer.fit(module, data)
    if trainer.global_rank == 0:
        layout, metrics = strategy.pipeline.layout, trainer.callback_metrics
        print(
            f"pipeline {layout.size} x data {layout.data_size}, {args.schedule}: first train_loss "
            f"{module.first_loss:.3f}, last {float(metrics['train_loss']):.3f}, "
            f"val_loss {float(metrics['val_loss']):.3f}; "
            f"stage 0 is {strategy.pipeline.stages[0]}"
        )


if __name__ == "__main__":
    main()
