"""Train a small character-level GPT on tiny shakespeare with the FSDP strategy, on 2 CPU processes.

    pip install -e .                             # once, so every rank can import lightning_fsdp
    python examples/demo.py                      # ~0.8M parameters, 2 ranks, about 2 minutes on 2 cores
    python examples/demo.py --max-steps 50 --n-layer 2 --n-embd 64

Each ``Block`` of the model is its own FSDP unit: every rank keeps only its shard of each unit's
parameters, gradients and AdamW state, and gathers a unit's full parameters just for its forward and
backward. At the end rank 0 prints how the training loss fell and how many parameter bytes each rank holds
against the full model's.

Lightning's launcher starts the other ranks by re-running this script, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings

# One thread per process: the ranks share the machine's cores, and oversubscribing them makes every
# collective wait on the slowest rank. Set before torch is imported so OpenMP picks it up.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402

import lightning_fsdp  # noqa: E402,F401  (registers the strategy with Lightning)
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.demo.data import CharDataModule  # noqa: E402
from lightning_fsdp.demo.gpt import GPT, Block, GPTConfig  # noqa: E402

# Number of steps averaged for the "loss at the start" and "loss at the end" figures.
_WINDOW = 10


class GPTLightningModule(L.LightningModule):
    """Wraps :class:`GPT` for Lightning and records the training loss of every step."""

    def __init__(
        self,
        config: GPTConfig | dict,
        *,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        if isinstance(config, dict):  # as restored by load_from_checkpoint
            config = GPTConfig(**config)
        # Plain types only, so a checkpoint loads with torch.load(weights_only=True).
        self.save_hyperparameters(
            {"config": dataclasses.asdict(config), "lr": lr, "weight_decay": weight_decay, "betas": list(betas)}
        )
        self.model = GPT(config)
        # Counted now: once sharded, parameters() yields only this rank's shards.
        self.num_model_parameters = self.model.num_parameters()
        self.train_losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True)
        self.train_losses.append(loss.item())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Groups are chosen by parameter name, not by shape: under FSDP a rank may hold a flattened or an
        # empty shard of a matrix, but the strategy keeps the original names.
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            (no_decay if _is_no_decay(name) else decay).append(param)
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas))


def _is_no_decay(name: str) -> bool:
    """Biases, LayerNorm weights and embeddings are not decayed (GPT-2 / nanoGPT convention).

    ``lm_head.weight`` is tied to ``wte.weight`` and listed once, under ``wte``.
    """
    *path, leaf = name.split(".")
    owner = path[-1] if path else ""
    return leaf == "bias" or owner.startswith("ln_") or owner in ("wte", "wpe")


class FSDPReport(L.Callback):
    """Prints, on rank 0, the loss at the start vs the end and each rank's parameter-shard bytes."""

    def on_train_end(self, trainer: L.Trainer, pl_module: GPTLightningModule) -> None:
        strategy = trainer.strategy
        # Every rank takes part in the gathers (collectives); only rank 0 prints.
        losses = strategy.all_gather(torch.tensor(pl_module.train_losses, dtype=torch.float64))
        losses = losses.reshape(trainer.world_size, -1).mean(dim=0)  # mean over ranks, per step
        engine = strategy.engine
        local = strategy.all_gather(torch.tensor([engine.local_param_bytes()], dtype=torch.int64))
        full = engine.full_param_bytes()
        if not trainer.is_global_zero:
            return
        n = min(_WINDOW, len(losses))
        print()
        print(f"steps: {len(losses)}, model: {pl_module.num_model_parameters:,} parameters")
        print(f"train loss, mean of first {n} steps: {losses[:n].mean():.4f}")
        print(f"train loss, mean of last  {n} steps: {losses[-n:].mean():.4f}")
        print(f"full model parameters: {full:,} bytes")
        for rank, nbytes in enumerate(local.reshape(-1).tolist()):
            print(f"  rank {rank} holds {nbytes:,} bytes of parameter shards ({nbytes / full:.1%} of full)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=400, help="optimizer steps (default: 400)")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default: 2)")
    parser.add_argument("--n-layer", type=int, default=4, help="transformer blocks (default: 4)")
    parser.add_argument("--n-embd", type=int, default=128, help="model width (default: 128)")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads (default: 4)")
    parser.add_argument("--block-size", type=int, default=64, help="characters per sequence (default: 64)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step (default: 16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--val-every", type=int, default=100, help="steps between validations (default: 100)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # Lightning's all_gather still calls a torch API that torch now flags as deprecated; not ours to fix.
    warnings.filterwarnings("ignore", message=".*all_gather is deprecated")
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)

    data = CharDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        # Exactly one epoch of max_steps, so the run ends on the step budget with a final validation.
        train_samples=args.max_steps * args.batch_size * args.devices,
        val_samples=8 * args.batch_size * args.devices,
        seed=args.seed,
    )
    config = GPTConfig(
        vocab_size=data.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    module = GPTLightningModule(config, lr=args.lr)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=FSDPStrategy(auto_wrap_policy={Block}),
        # The data is one epoch of max_steps. Without max_epochs Lightning sets it to -1 and its progress bar
        # prints "Epoch 0/-2".
        max_epochs=1,
        max_steps=args.max_steps,
        val_check_interval=min(args.val_every, args.max_steps),
        num_sanity_val_steps=0,  # the first validation comes soon enough; save the start-up time
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
        callbacks=[FSDPReport()],
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
