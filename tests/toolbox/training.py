"""The training loop the engine tests share, on ranks and on one device: ToyLM-style models, SGD with momentum, each
step on ``batch(step)``'s samples ``rank, rank + N, ...`` (a rank's share of the global batch; the whole batch for
rank 0 of 1).

A rank of a sharded run calls it with its rank and the world size; the one-device reference calls it with the
defaults (or with one rank's share, for a rank that is alone in its process group), so both sides run the same
code and differ only in what they are meant to differ in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tests.toolbox.models import batch, loss_fn


def sgd_with_momentum(params: Iterable[nn.Parameter]) -> torch.optim.SGD:
    """The optimizer of the parity tests: SGD with momentum follows a wrong gradient scale where Adam would hide it."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_on_shares(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    *,
    before_step: Callable[[], object] | None = None,
) -> list[torch.Tensor]:
    """``steps`` optimizer steps on samples ``rank::world_size`` of ``batch(step, size=batch_size)``; ``before_step``
    runs between backward and the optimizer step (gradient clipping). Returns each step's loss (this rank's,
    detached)."""
    losses = []
    for step in range(steps):
        x, y = batch(step, size=batch_size)
        loss = loss_fn(model(x[rank::world_size]), y[rank::world_size])
        loss.backward()
        if before_step is not None:
            before_step()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's named parameters (the tied embedding/head once)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}
