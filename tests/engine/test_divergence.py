"""Ranks that take different paths through the model, and anomaly checking.

* A parameter used on one rank and not on another (control flow inside a unit that depends on the data) trains
  exactly like a single process that averages the ranks' losses. The blocks have identical shapes, so reductions
  issued in a different order on different ranks would silently mix their gradients instead of failing.
* A parameter no rank used in a step keeps ``grad=None``, so SGD with momentum skips it as a single process does.
* A whole unit that runs on one rank only: with anomaly checking on, every rank raises an error naming the unit
  instead of hanging or mixing tensors.
* With anomaly checking on, a NaN or Inf gradient is reported by parameter name, with the rank that produced it,
  on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_fsdp.engine import fully_shard
from tests.toolbox.distributed import run_distributed

DIM = 4


class GatedBlock(nn.Module):
    """``x + fc(x)``, plus ``extra(x)`` only when asked: the ``extra`` layer is skipped by some ranks or steps."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = x + torch.tanh(self.fc(x))
        return out + self.extra(x) if use_extra else out


class GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(3))
        self.out = nn.Linear(DIM, 1)

    def forward(
        self, x: torch.Tensor, gates: list[bool], skip: int | None = None, poison: bool = False
    ) -> torch.Tensor:
        h = self.inp(x)
        for i, (block, gate) in enumerate(zip(self.blocks, gates)):
            if i != skip:
                h = block(h, gate)
        loss = self.out(h).square().mean()
        if poison:
            # Finite value (0), NaN gradient for one weight: d sqrt(u)/du is inf at 0, times du/dw = 0.
            loss = loss + (self.inp.weight[0, 0] * 0).sqrt()
        return loss


def data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def gates(step: int, rank: int) -> list[bool]:
    # Block 1's extra layer: rank 0 uses it, rank 1 does not (every step). Block 2's: nobody on even steps, both
    # ranks on odd steps. Block 0's: always.
    return [True, rank == 0, step % 2 == 1]


def _train(rank, world_size, strategy, direct):
    from lightning_fsdp.engine.unit import FlatUnit

    if direct:  # every parameter gathered and reduced on its own, in place (4-row layers split evenly)
        FlatUnit.direct_gather_min_numel = 1
    reference = GatedNet()
    model = copy.deepcopy(reference)
    fully_shard(model, sharding_strategy=strategy, auto_wrap_policy={GatedBlock})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    none_grads = []
    for step in range(4):
        model(data(step, rank), gates(step, rank)).backward()
        none_grads.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
        # The reference: one process averaging every rank's loss, each computed on that rank's data and path.
        loss = sum(reference(data(step, r), gates(step, r)) for r in range(world_size)) / world_size
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref_none = []
    for step in range(4):
        ref_none.append(["blocks.2.extra.bias", "blocks.2.extra.weight"] if step % 2 == 0 else [])
    with torch.no_grad():
        from lightning_fsdp.checkpoint.full import full_model_state_dict

        full = full_model_state_dict(get_engine(model), rank0_only=False)
    return none_grads, ref_none, {k: v.clone() for k, v in full.items()}, reference.state_dict()


def get_engine(model):
    from lightning_fsdp.engine.registry import get_engine as lookup

    return lookup(model)


@pytest.mark.parametrize("strategy,direct", [("FULL_SHARD", False), ("SHARD_GRAD_OP", False), ("FULL_SHARD", True)])
def test_parameter_skipped_by_one_rank_trains_like_one_process(strategy, direct):
    for none_grads, ref_none, full, ref in run_distributed(_train, 2, strategy, direct):
        assert none_grads == ref_none  # a parameter no rank used keeps grad=None; one some rank used does not
        assert full.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(full[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
        # Momentum really moved the parameters that were skipped on even steps (not a vacuous comparison).
        assert not torch.equal(full["blocks.2.extra.weight"], GatedNet().state_dict()["blocks.2.extra.weight"])


def _skip_a_unit(rank, world_size):
    model = GatedNet()
    fully_shard(model, auto_wrap_policy={GatedBlock})
    try:
        with torch.autograd.set_detect_anomaly(True, check_nan=False):
            model(data(0, rank), [True, True, True], skip=1 if rank == 1 else None).backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_unit_run_on_one_rank_only_is_named_on_every_rank():
    messages = run_distributed(_skip_a_unit, 2)
    for message in messages:
        assert "different collectives" in message
        assert "rank 0: all-gather of unit 'blocks.1'" in message
        assert "rank 1: all-gather of unit 'blocks.2'" in message
    assert messages[0] == messages[1]


def _nan_gradient(rank, world_size, check_nan):
    model = GatedNet()
    fully_shard(model, auto_wrap_policy={GatedBlock})
    try:
        with torch.autograd.set_detect_anomaly(True, check_nan=check_nan):
            model(data(0, rank), [True] * 3, poison=rank == 1).backward()
    except FloatingPointError as error:
        return str(error)
    return "no error"


def test_nan_gradient_is_named_on_every_rank():
    messages = run_distributed(_nan_gradient, 2, False)
    assert messages[0] == messages[1]
    assert "'inp.weight' (rank 1)" in messages[0]
    assert "'inp.bias'" not in messages[0]  # only the parameter whose gradient went bad
