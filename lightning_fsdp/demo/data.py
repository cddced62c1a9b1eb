"""Character-level language-modelling data: a text file (by default the bundled tiny-shakespeare excerpt) cut into
random ``(input, target)`` blocks, deterministic given ``seed``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["CharDataset", "CharDataModule", "default_text_path"]

_DEFAULT_TEXT = "tinyshakespeare.txt"


def default_text_path() -> Path:
    """Path of the tiny-shakespeare excerpt that ships with the package (package data under ``assets/``)."""
    # Next to this file rather than via importlib.resources: the package is always installed unzipped,
    # and a plain path is what users want to print or pass on.
    return Path(__file__).resolve().parent / "assets" / _DEFAULT_TEXT


class CharDataset(Dataset):
    """``num_samples`` random windows of ``block_size + 1`` tokens from ``data``: item ``i`` is ``(window[:-1],
    window[1:])``, or only the first when ``inputs_only``. The offsets are drawn once, from ``seed``, so item ``i`` is
    the same in every process and epoch; the sampler supplies the order.
    """

    def __init__(
        self, data: torch.Tensor, block_size: int, num_samples: int, *, seed: int = 0, inputs_only: bool = False
    ) -> None:
        if data.ndim != 1:
            raise ValueError(f"data must be a 1-D tensor of token ids, got shape {tuple(data.shape)}")
        if len(data) < block_size + 1:
            raise ValueError(f"text of {len(data)} tokens is too short for block_size {block_size} (+1)")
        if num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.data = data
        self.block_size = block_size
        self.inputs_only = inputs_only
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(data) - block_size, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[index])
        window = self.data[start : start + self.block_size + 1]
        if self.inputs_only:
            return window[:-1]
        return window[:-1], window[1:]


class CharDataModule(L.LightningDataModule):
    """Train/val/test/predict loaders of random character blocks from one text file.

    The text is read and the vocabulary built in ``__init__`` (the file is small), so ``vocab_size`` is
    known before a model is built. ``test`` reuses the validation split (there are only two); ``predict``
    yields input blocks only.

    Args:
        path: text file to read; ``None`` for the bundled tiny-shakespeare excerpt.
        block_size: tokens per input sequence.
        batch_size: sequences per batch (per process, under a distributed strategy).
        train_samples: blocks per training epoch (shared among processes by Lightning's sampler).
        val_samples: blocks per validation / test / predict epoch.
        seed: seeds the block offsets and the training order.
        num_workers: DataLoader workers; 0 keeps CPU runs with several ranks light.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        block_size: int = 64,
        batch_size: int = 16,
        train_samples: int = 10_000,
        val_samples: int = 512,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.path = Path(path) if path is not None else default_text_path()
        self.block_size = block_size
        self.batch_size = batch_size
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.seed = seed
        self.num_workers = num_workers

        text = self.path.read_text(encoding="utf-8")
        self.chars: list[str] = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        data = self.encode(text)
        n_train = int(0.9 * len(data))
        self.train_data, self.val_data = data[:n_train], data[n_train:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (int64) of ``text``; raises ``KeyError`` for a character outside the vocabulary."""
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Text of a 1-D sequence of token ids."""
        return "".join(self.chars[int(i)] for i in ids)

    def train_dataset(self) -> CharDataset:
        return CharDataset(self.train_data, self.block_size, self.train_samples, seed=self.seed)

    def val_dataset(self, *, inputs_only: bool = False) -> CharDataset:
        # A different seed from training's so the two draws are unrelated.
        return CharDataset(
            self.val_data, self.block_size, self.val_samples, seed=self.seed + 1, inputs_only=inputs_only
        )

    def train_dataloader(self) -> DataLoader:
        # A seeded generator makes the shuffled order reproducible; under a distributed strategy Lightning
        # swaps in a DistributedSampler, which is seeded and reshuffled per epoch on its own.
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train_dataset(),
            batch_size=self.batch_size,
            shuffle=True,
            generator=generator,
            num_workers=self.num_workers,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_dataset())

    test_dataloader = val_dataloader

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_dataset(inputs_only=True))

    def _eval_loader(self, dataset: CharDataset) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
