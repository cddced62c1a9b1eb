"""Tiny models for the tests and the global batches they train on.

``ToyLM``: uneven shapes, a tied weight, a parameter with fewer rows than ranks, a frozen layer. ``ChainLM``: a
forward that is a chain over its pieces, which pipeline stages cut between blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import TensorDataset

VOCAB = 7


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class ToyLM(nn.Module):
    """Embedding (7 rows: uneven over 2 or 3 ranks) tied to the output head; ``tiny`` has one row."""

    def __init__(self, dim: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.tiny = nn.Parameter(torch.randn(1, dim) * 0.1)
        self.block1 = Block(dim, 6)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.block2 = Block(dim, 3)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.tiny
        h = self.block2(self.frozen(self.block1(h)))
        return self.head(self.norm(h))


class ChainLM(nn.Module):
    """Embedding, the blocks ``blocks()`` builds, a norm and a head. The blocks are built after the embedding, so
    that from one seed every piece gets the values it had when each script defined the model itself."""

    def __init__(self, vocab: int, dim: int, blocks: Callable[[], list[nn.Module]]) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(blocks())
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def parallelize_toy_lm(model: ToyLM, tp_mesh: DeviceMesh) -> ToyLM:
    """Tensor parallelism as a user writes it in ``configure_model``: block1's first layer column-wise and its second
    row-wise; block2's first layer column-wise with its output gathered (3 rows split 2 + 1 over 2 ranks: torch's
    row-wise layer assumes even pieces of its input); the rest stays replicated (plain parameters)."""
    parallelize_module(model.block1, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    parallelize_module(model.block2, tp_mesh, {"fc1": ColwiseParallel(output_layouts=Replicate())})
    return model


def batch(step: int, size: int = 6, length: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch for ``step`` (identical in every process)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (size, length), generator=g), torch.randint(0, VOCAB, (size, length), generator=g)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def samples(count: int) -> TensorDataset:
    """``count`` fixed (input, target) rows: the data set the Lightning test scripts train on."""
    return TensorDataset(*batch(0, size=count))
