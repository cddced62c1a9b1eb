"""Giving a module its full parameters back when its engine ends (``ShardingEngine.restore_unsharded``)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_fsdp.engine.unit import FlatUnit


@torch.no_grad()
def restore_full_parameters(units: list[FlatUnit], device: torch.device | str) -> None:
    """Every parameter of ``units`` gets its full value on ``device``, one unit at a time; gradients are dropped.
    ``device="meta"`` keeps no values but still joins the gathers (another rank may keep them); ties stay shared."""
    on_meta = torch.device(device).type == "meta"
    for unit in units:
        unit.reshard()
        fulls = unit.full_tensors()
        for slot, full in zip(unit.slots, fulls):
            param = slot.param
            param.grad = None
            if on_meta:  # a parameter's data cannot be swapped for a meta tensor (set_data refuses it)
                param = nn.Parameter(full.to(device), requires_grad=param.requires_grad)
                slot.param.data = slot.param.data.new_empty(0)  # the old object (the optimizer's) lets its shard go
            else:
                param.data = full.to(device)
            for module, attr in slot.uses:
                module._parameters[attr] = param
        unit.release_buffers()
