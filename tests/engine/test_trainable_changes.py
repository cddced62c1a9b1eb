"""Gradient traffic and memory follow what is trainable now, not what was trainable when the model was sharded.

The expected bytes are computed here from the parameter shapes and the chunking rule (each rank sends N chunks of
ceil(rows / N) rows per parameter, plus one used-flag per parameter), not read from the engine."""

from __future__ import annotations

import math

import torch

from lightning_fsdp.engine import fully_shard
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn


def _reduce_input_bytes(shapes: list[torch.Size], world: int) -> int:
    elements = 0
    for shape in shapes:
        rows = shape[0] if len(shape) else 1
        elements += world * math.ceil(rows / world) * math.prod(shape[1:])
    return (elements + world * len(shapes)) * 4  # fp32 gradients and flags


def _step_bytes(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = ToyLM()
    block1_shapes = [p.shape for p in model.block1.parameters()]
    engine = fully_shard(model, auto_wrap_policy={Block})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"block1_shapes": block1_shapes}
    for phase, trainable in (("all", True), ("block1_frozen", False), ("unfrozen_again", True)):
        model.block1.requires_grad_(trainable)
        engine.shard_comm.stats.reset()
        x, y = batch(0)
        loss_fn(model(x[rank::world]), y[rank::world]).backward()
        out[phase] = {
            "reduce_bytes": engine.shard_comm.stats.reduce_scatter_bytes,
            "block1_grads": [p.grad is not None for p in model.block1.parameters()],
            "grad_bytes": engine.local_grad_bytes(),
        }
        optimizer.step()
        optimizer.zero_grad()
    return out


def test_reduction_and_gradient_memory_follow_requires_grad():
    results = run_distributed(_step_bytes, 2)
    for got in results:
        block1 = _reduce_input_bytes(got["block1_shapes"], 2)
        assert block1 > 0
        assert got["all"]["reduce_bytes"] - got["block1_frozen"]["reduce_bytes"] == block1
        assert got["unfrozen_again"]["reduce_bytes"] == got["all"]["reduce_bytes"]
        assert all(got["all"]["block1_grads"]) and not any(got["block1_frozen"]["block1_grads"])
        assert all(got["unfrozen_again"]["block1_grads"])
        assert got["block1_frozen"]["grad_bytes"] < got["all"]["grad_bytes"] == got["unfrozen_again"]["grad_bytes"]
