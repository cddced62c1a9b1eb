"""Giving a module its full parameters back when its engine ends (``ShardingEngine.restore_unsharded``)."""

from __future__ import annotations

import torch

from lightning_fsdp.engine.unit import FlatUnit


@torch.no_grad()
def restore_full_parameters(units: list[FlatUnit], device: torch.device | str) -> None:
    """Every parameter of ``units`` gets its full value on ``device``, back in its modules; the buffers are released.
    One unit at a time (peak: one unit in full). Gradients, which were shards, are dropped."""
    for unit in units:
        unit.reshard()
        fulls = unit.full_tensors()
        for slot, full in zip(unit.slots, fulls):
            slot.param.data = full.to(device)
            slot.param.grad = None
            for module, attr in slot.uses:
                module._parameters[attr] = slot.param
        unit.release_buffers()
