"""Giving a module its full parameters back: how an engine ends (``ShardingEngine.restore_unsharded``), after which
the module is an ordinary one."""

from __future__ import annotations

import torch

from lightning_fsdp.engine.unit import FlatUnit


@torch.no_grad()
def restore_full_parameters(units: list[FlatUnit], device: torch.device | str) -> None:
    """Every parameter of ``units`` gets its full value on ``device`` and is put back into the modules using it in
    place of the stand-ins; the units' buffers are released. One unit is unsharded at a time (peak memory on the
    accelerator: one unit in full). Gradients are dropped: they were shards."""
    for unit in units:
        unit.reshard()
        fulls = unit.full_tensors()
        for slot, full in zip(unit.slots, fulls):
            slot.param.data = full.to(device)
            slot.param.grad = None
            for module, attr in slot.uses:
                module._parameters[attr] = slot.param
        unit.release_buffers()
