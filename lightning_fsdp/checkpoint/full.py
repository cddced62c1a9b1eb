"""The full format: one checkpoint file in Lightning's usual layout, with unsharded state dicts.

Gathering happens one unit at a time with the result moved to host memory on rank 0, so no rank holds more than
one unit's full parameters beyond its shards, apart from rank 0's host copy being assembled. Global rank 0 writes
the file through the strategy's ``CheckpointIO`` (``AtomicCheckpointIO`` by default); every rank reads it whole and
copies its own rows in. :class:`FullFormat` is the format object the strategy and ``convert`` use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO, CheckpointLoadError
from lightning_fsdp.checkpoint.common import (
    CheckpointFormat,
    CheckpointMismatchError,
    CheckpointRun,
    to_index_keyed,
)
from lightning_fsdp.checkpoint.paths import FULL, remove_checkpoint_path
from lightning_fsdp.collective import Collective
from lightning_fsdp.engine import ShardingEngine
from lightning_fsdp.engine.comm import gather_rows
from lightning_fsdp.engine.layout import ShardLayout

if TYPE_CHECKING:
    pass


def global_rank() -> int:
    # Rank 0 of the world writes; with hybrid sharding every replica group has its own shard-group rank 0.
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _param_keys(module: nn.Module) -> dict[int, list[str]]:
    keys: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        keys.setdefault(id(param), []).append(name)
    return keys


@torch.no_grad()
def full_model_state_dict(
    engine: ShardingEngine, *, rank0_only: bool = True, keep: bool | None = None
) -> dict[str, Any]:
    """The unwrapped model's ``state_dict()`` with full tensors on CPU (empty on other ranks if ``rank0_only``).
    ``keep`` overrides which ranks keep it (under pipeline parallelism: each stage's data-parallel rank 0)."""
    engine.reshard_idle()  # a forward whose backward never came may have left full-size stand-ins in the modules
    module = engine.root
    if keep is None:
        keep = not rank0_only or global_rank() == 0
    state = module.state_dict()  # shards for managed parameters; buffers and unmanaged parameters as they are
    if engine.closed:
        # The stage has ended and the module holds its full parameters again (ShardingEngine.restore_unsharded).
        return (
            {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
            if keep
            else {}
        )
    keys = _param_keys(module)
    for unit in engine.units:
        fulls = unit.full_tensors()  # one unit at a time, in the master dtype
        if keep:
            for slot, full in zip(unit.slots, fulls):
                full = full.to("cpu", copy=True)
                for key in keys.get(id(slot.param), []):
                    if key in state:
                        state[key] = full
        del fulls
    if not keep:
        return {}
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


@torch.no_grad()
def load_full_model_state_dict(engine: ShardingEngine, state: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load a full state dict (same on every rank): each rank copies its own rows into its shards."""
    engine.reshard_idle()
    module = engine.root
    keys = _param_keys(module)
    managed = {}
    for unit in engine.units:
        for slot in unit.slots:
            for key in keys.get(id(slot.param), []):
                managed[key] = slot
    rest = {k: v for k, v in state.items() if k not in managed}
    for key, slot in managed.items():
        if key not in state:
            continue
        value = state[key]
        if not isinstance(value, torch.Tensor):
            raise CheckpointMismatchError(
                f"Checkpoint entry {key!r} is a {type(value).__name__}, not a tensor; the model's parameter is a "
                f"tensor of shape {tuple(slot.layout.shape)}. The checkpoint is damaged or belongs to another model."
            )
        if tuple(value.shape) != tuple(slot.layout.shape):
            raise CheckpointMismatchError(
                f"Checkpoint tensor {key!r} has shape {tuple(value.shape)}, the model's parameter has "
                f"{tuple(slot.layout.shape)}; it is a checkpoint of another model."
            )
        slot.param.data.copy_(slot.layout.local_slice(value.to(slot.param.device, slot.param.dtype)))
    # Let nn.Module handle buffers, unmanaged parameters and strictness; managed parameters are already loaded,
    # so hand it their current shards to compare against themselves.
    own = module.state_dict()
    for key in managed:
        if key in own:
            rest[key] = own[key]
    missing_managed = [k for k in managed if k not in state]
    result = module.load_state_dict(rest, strict=False)
    missing = [k for k in result.missing_keys if k not in managed] + missing_managed
    if strict and (missing or result.unexpected_keys):
        raise CheckpointMismatchError(
            f"Error loading state dict into {type(module).__name__}: missing keys {missing}, "
            f"unexpected keys {list(result.unexpected_keys)}. Load with strict=False (LightningModule.strict_loading "
            "= False) to skip them."
        )


def _per_parameter(name: str, value: Any, layout: ShardLayout) -> bool:
    """Whether a full optimizer-state entry has one value per parameter element (so each rank takes its rows).

    A 0-dim parameter's state (``exp_avg``, ``momentum_buffer``) is 0-dim too, like the ``step`` counter every
    torch optimizer keeps; ``step`` is the one 0-dim entry that is not per element."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(layout.shape):
        return False
    return value.dim() > 0 or name != "step"


def _sharded_state_tensor(value: Any, layout: ShardLayout) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(layout.local_shape)


@torch.no_grad()
def full_optimizer_state_dict(
    engine: ShardingEngine, optimizer: Optimizer, *, rank0_only: bool = True, keep: bool | None = None
) -> dict:
    """``optimizer.state_dict()`` in plain ``torch.optim`` layout for the unwrapped model (full tensors, CPU);
    ``keep`` as for :func:`full_model_state_dict`."""
    state_dict = optimizer.state_dict()
    if keep is None:
        keep = not rank0_only or global_rank() == 0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    full_state: dict[int, dict[str, Any]] = {}
    # Parameter order is the same on every rank, so every rank issues the same gathers in the same order.
    for index, param in enumerate(params):
        slot = engine.slot_of(param)
        entry = state_dict["state"].get(index, {})
        new_entry = {}
        for name in sorted(entry):
            value = entry[name]
            if slot is not None and _sharded_state_tensor(value, slot.layout):
                # Unsharded layouts only need the shape back (a 0-dim parameter's state is held as one row).
                if slot.layout.world_size > 1:
                    value = gather_rows(value, slot.layout, engine.shard_comm)
                else:
                    value = value.reshape(slot.layout.shape)
            if keep:
                new_entry[name] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        if keep and entry:
            full_state[index] = new_entry
    if not keep:
        return {}
    return {"state": full_state, "param_groups": state_dict["param_groups"]}


def load_full_optimizer_state_dict(engine: ShardingEngine, optimizer: Optimizer, state_dict: Mapping) -> None:
    """Load a plain ``torch.optim`` state dict (same on every rank) into an optimizer over shards."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(groups, list) or not isinstance(state_dict.get("state"), Mapping):
        found = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise CheckpointMismatchError(
            f"The checkpoint's optimizer state is not a torch.optim state dict (with 'state' and 'param_groups'); "
            f"found {found}."
        )
    sizes = [len(g.get("params", ())) if isinstance(g, Mapping) else None for g in groups]
    here = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != here:
        raise CheckpointMismatchError(
            f"The checkpoint's {type(optimizer).__name__} state has parameter groups of sizes {sizes}, but this run's "
            f"has {here}; resume with the same optimizer configuration."
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local_state = {}
    for index, entry in state_dict["state"].items():
        param = params[int(index)]
        slot = engine.slot_of(param)
        new_entry = {}
        for name, value in entry.items():
            if slot is not None and _per_parameter(name, value, slot.layout):
                value = slot.layout.local_slice(value).clone()
            new_entry[name] = value
        local_state[index] = new_entry
    optimizer.load_state_dict({"state": local_state, "param_groups": state_dict["param_groups"]})


class FullFormat(CheckpointFormat):
    """One file in Lightning's layout; plain Lightning (single device, DDP) loads it too."""

    kind = FULL
    writes_offline = True

    model_state_dict = staticmethod(full_model_state_dict)
    optimizer_state = staticmethod(full_optimizer_state_dict)

    def save(self, checkpoint: dict[str, Any], path: Any, run: CheckpointRun, storage_options: Any = None) -> None:
        # The rank the full state was gathered to writes it (the others' state dicts are empty), as Lightning's
        # Strategy.save_checkpoint does with is_global_zero.
        if global_rank() == 0:
            assert run.checkpoint_io is not None
            run.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load(
        self, path: Any, run: CheckpointRun, *, weights_only: bool | None = None, coll: Collective | None = None
    ) -> dict[str, Any]:
        # Every rank reads the whole file (the CheckpointIO also reports remote and missing paths), as Lightning's
        # Strategy.load_checkpoint does, cached GPU memory released first.
        torch.cuda.empty_cache()
        assert run.checkpoint_io is not None
        return run.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def read_as_full(self, path: str, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = AtomicCheckpointIO().load_checkpoint(path, weights_only=weights_only)
        if not isinstance(checkpoint.get("state_dict"), Mapping):
            raise CheckpointLoadError(
                f"{path!r} is not a Lightning checkpoint: it has no 'state_dict' entry with the model's weights (its "
                f"entries: {sorted(map(str, checkpoint))}).",
                path,
            )
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [to_index_keyed(s) for s in checkpoint["optimizer_states"]]
        return checkpoint

    def write_full(self, checkpoint: Mapping[str, Any], path: str) -> None:
        if os.path.isdir(path):  # a directory checkpoint being replaced by a file
            remove_checkpoint_path(path)
        AtomicCheckpointIO().save_checkpoint(dict(checkpoint), path)
