"""One parameter's shard layout (the chunking rule; ``sharding.py`` applies it to a model).

[Note: the chunking rule]
``torch.chunk`` semantics on dim 0, as torch's FSDP shards (docs/how-it-works.md); a 0-dim parameter counts as one
row of one element. Checkpoints of the local format store these rows, so the rule must not change."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardLayout:
    """The layout of a parameter of ``shape`` over ``world_size`` ranks, seen from ``rank``."""

    shape: torch.Size
    world_size: int
    rank: int

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) > 0 else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])  # 1 for a 0-dim or 1-dim parameter

    @property
    def chunk_rows(self) -> int:
        return -(-self.rows // self.world_size)

    @property
    def padded_numel(self) -> int:
        """Elements each rank contributes to a flat collective buffer."""
        return self.chunk_rows * self.row_numel

    def rows_of(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.chunk_rows, self.rows)
        end = min(start + self.chunk_rows, self.rows)
        return start, end

    @property
    def local_rows(self) -> int:
        start, end = self.rows_of(self.rank)
        return end - start

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.local_rows, *self.shape[1:]))

    @property
    def padded_full_shape(self) -> torch.Size:
        return torch.Size((self.chunk_rows * self.world_size, *self.shape[1:]))

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full (unpadded) tensor of ``shape``."""
        start, end = self.rows_of(self.rank)
        return full.reshape(self.rows, self.row_numel)[start:end].reshape(self.local_shape)
