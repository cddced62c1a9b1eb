"""``GPTLightningModule``: the demo GPT as a LightningModule whose ``__init__`` arguments are plain types, so that
``LightningCLI`` exposes each as ``--model.<name>`` and ``--print_config`` writes YAML that parses back unchanged.
"""

from __future__ import annotations

import dataclasses

import lightning as L
import torch
from torch import nn

from lightning_fsdp.demo.gpt import GPT, GPTConfig

__all__ = ["GPTLightningModule"]

# The full tiny-shakespeare text has 65 distinct characters; the excerpt bundled with the package has fewer, and a
# vocabulary that is larger than the data's only leaves a few embedding rows untrained.
DEFAULT_VOCAB_SIZE = 65


class GPTLightningModule(L.LightningModule):
    """A :class:`~lightning_fsdp.demo.gpt.GPT` language model trained with AdamW, for ``CharDataModule`` batches.

    Args:
        vocab_size: number of token ids the model accepts; at least the data module's ``vocab_size``.
        block_size: longest sequence (the data module's ``block_size`` must not exceed it).
        n_layer: transformer blocks (each ``lightning_fsdp.demo.gpt.Block`` is the natural FSDP unit).
        n_head: attention heads; must divide ``n_embd``.
        n_embd: model width.
        dropout: dropout probability.
        bias: biases in Linear and LayerNorm layers.
        tie_weights: share the token embedding with the output projection.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay for matrices (biases, LayerNorms and embeddings are not decayed).
        betas: AdamW betas.
    """

    def __init__(
        self,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        # Plain types only: the checkpoint then loads with torch.load(weights_only=True).
        self.save_hyperparameters()
        self.config = GPTConfig(**{field.name: self.hparams[field.name] for field in dataclasses.fields(GPTConfig)})
        self.model = GPT(self.config)

    def setup(self, stage: str) -> None:
        # Otherwise a mismatch fails deep inside an embedding lookup.
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        data_vocab = getattr(datamodule, "vocab_size", None)
        if data_vocab is not None and data_vocab > self.config.vocab_size:
            raise ValueError(
                f"model.vocab_size={self.config.vocab_size} is smaller than the data's vocabulary ({data_vocab} "
                f"characters); set model.vocab_size to at least {data_vocab}."
            )
        data_block = getattr(datamodule, "block_size", None)
        if data_block is not None and data_block > self.config.block_size:
            raise ValueError(
                f"data.block_size={data_block} exceeds model.block_size={self.config.block_size}; lower the "
                "first or raise the second."
            )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(*batch)[1]
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(*batch)[1], prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.model(*batch)[1], sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The most likely next character at every position."""
        return self(batch).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Groups by parameter name, not shape: under FSDP a rank may hold an empty shard of a matrix, but the
        # strategy keeps the original names.
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for name, param in self.named_parameters():
            if param.requires_grad:
                (no_decay if _is_no_decay(name) else decay).append(param)
        groups = [
            {"params": decay, "weight_decay": self.hparams["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams["lr"], betas=tuple(self.hparams["betas"]))


def _is_no_decay(name: str) -> bool:
    """Biases, LayerNorm weights and embeddings are not decayed (GPT-2 / nanoGPT convention)."""
    *path, leaf = name.split(".")
    owner = path[-1] if path else ""
    return leaf == "bias" or owner.startswith("ln_") or owner in ("wte", "wpe")
