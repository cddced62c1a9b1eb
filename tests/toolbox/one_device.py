"""One-device references: what the sharded runs must end with, computed without sharding.

In this process (no Lightning): ToyLM from seed 0, SGD with momentum, on the global batches the sharded ranks share,
either ``batch(step)`` at every step (the engine tests, :func:`toy_lm_on_step_batches`) or consecutive rows of
``samples(count)`` (the Lightning scripts with ``use_distributed_sampler=False``, :func:`toy_lm_on_samples`).

Through Lightning: tests/scripts/lightning_parity.py on one device (``strategy="auto"``), once per session for each
set of training flags (:func:`lightning_parity_one_device`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.toolbox.launch import join_configurations, run_configurations, script_output
from tests.toolbox.models import ToyLM, loss_fn, samples
from tests.toolbox.training import parameters_of, sgd_with_momentum, train_on_shares


@dataclass
class OneDeviceRun:
    """The trained model, its optimizer and each step's loss."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[float]

    def parameters(self) -> dict[str, torch.Tensor]:
        return parameters_of(self.model)

    def lightning_state(self) -> dict[str, torch.Tensor]:
        """The state dict as the scripts' LightningModule names it (the model held as ``self.model``)."""
        return {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}


def toy_lm_on_step_batches(
    steps: int,
    batch_size: int,
    *,
    dim: int = 5,
    share: tuple[int, int] = (0, 1),
    clip_norm: float | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = sgd_with_momentum,
) -> OneDeviceRun:
    """ToyLM(dim) trained on ``batch(step, size=batch_size)`` at each step (only samples ``rank::world_size`` with
    ``share=(rank, world_size)``: a rank alone in its group), gradients clipped to ``clip_norm`` if given, stepped by
    ``optimizer(parameters)`` (SGD with momentum by default)."""
    torch.manual_seed(0)
    model = ToyLM(dim=dim)

    def clip() -> None:
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)

    stepper = optimizer(model.parameters())
    losses = train_on_shares(model, stepper, steps, batch_size, *share, before_step=clip)
    return OneDeviceRun(model, stepper, [float(loss) for loss in losses])


def toy_lm_on_samples(
    steps: int,
    global_batch: int,
    count: int,
    *,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> OneDeviceRun:
    """ToyLM trained on rows ``[k * global_batch, (k + 1) * global_batch)`` of ``samples(count)`` at step k, as the
    Lightning scripts' ranks share them; past the last row each epoch starts again at row 0, as the scripts' loaders
    do. ``forward(model, x)``: the module's output where it is not ``model(x)``."""
    torch.manual_seed(0)
    model = ToyLM()
    optimizer = sgd_with_momentum(model.parameters())
    x_all, y_all = samples(count).tensors
    losses = []
    for step in range(steps):
        start = step * global_batch % count
        rows = slice(start, start + global_batch)
        x, y = x_all[rows], y_all[rows]
        optimizer.zero_grad()
        loss = loss_fn(model(x) if forward is None else forward(model, x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return OneDeviceRun(model, optimizer, losses)


_lightning_parity_runs: dict[tuple[str, ...], dict] = {}
LIGHTNING_PARITY_TIMEOUT_S = 600  # one launch, sharing the cores with others running at once; a guard


def lightning_parity_one_device(tmp_path_factory: pytest.TempPathFactory, *args: str) -> dict:
    """tests/scripts/lightning_parity.py's output on one device (``strategy="auto"``) with training flags ``args``,
    once per session for each ``args``."""
    if args not in _lightning_parity_runs:
        out = tmp_path_factory.mktemp("ref") / "ref.pt"
        _lightning_parity_runs[args] = lightning_parity_run(out, "--devices", "1", "--strategy", "auto", *args)
    return _lightning_parity_runs[args]


def lightning_parity_runs(folder: Path, devices: int, configs: Sequence[Sequence[str]]) -> list[dict]:
    """One launch of tests/scripts/lightning_parity.py on ``devices`` processes running ``configs`` (each the
    script's flags) one after another: what each saved."""
    args = join_configurations([["--devices", str(devices), *config] for config in configs])
    outs = run_configurations("lightning_parity.py", folder, args, LIGHTNING_PARITY_TIMEOUT_S)
    return [torch.load(out, weights_only=False) for out in outs]


def lightning_parity_run(out: Path, *args: str) -> dict:
    """One launch of tests/scripts/lightning_parity.py (the one-device reference, or a run compared with it): what
    it saved in ``out``."""
    return script_output("lightning_parity.py", out, *args, timeout=LIGHTNING_PARITY_TIMEOUT_S)
