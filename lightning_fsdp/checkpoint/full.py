"""The full format: one file in Lightning's usual layout. Saving gathers one unit at a time to rank 0's host memory;
loading reads the whole file on every rank, which copies its own rows in."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_fsdp.checkpoint import Checkpoint, StateDict, remote
from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO, CheckpointLoadError
from lightning_fsdp.checkpoint.common import (
    CheckpointFormat,
    CheckpointRun,
    check_group_sizes,
    is_slot_rows,
    load_full_model_state_dict,  # noqa: F401 - callers import it from here
    managed_keys,
    optimizer_params,
    to_index_keyed,
)
from lightning_fsdp.checkpoint.paths import FULL, remove_checkpoint_path
from lightning_fsdp.collective import Collective
from lightning_fsdp.engine import ShardingEngine
from lightning_fsdp.engine.comm import gather_rows
from lightning_fsdp.engine.records import ParamSlot

if TYPE_CHECKING:
    from lightning.fabric.utilities.types import _PATH


def global_rank() -> int:
    # Rank 0 of the world writes; with hybrid sharding every replica group has its own shard-group rank 0.
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@torch.no_grad()
def full_model_state_dict(engine: ShardingEngine, *, rank0_only: bool = True, keep: bool | None = None) -> StateDict:
    """The model's state dict with full tensors on CPU (empty on other ranks if ``rank0_only``). ``keep`` overrides
    which ranks keep it (under pipeline parallelism: each stage's data-parallel rank 0)."""
    managed = managed_keys(engine)  # first: it puts the user's parameters back where a forward left stand-ins
    if keep is None:
        keep = not rank0_only or global_rank() == 0
    state = engine.root.state_dict()  # shards for managed parameters; buffers and unmanaged parameters as they are
    # Once the stage has ended the module holds its full parameters again (ShardingEngine.restore_unsharded), copied
    # below with its buffers; until then each unit's are gathered.
    if not engine.closed:
        keys: dict[int, list[str]] = {}
        for key, slot in managed.items():
            keys.setdefault(id(slot), []).append(key)
        for unit in engine.units:
            fulls = unit.full_tensors()  # one unit at a time, in the master dtype
            for slot, full in zip(unit.slots, fulls):
                if slot.tensor_parallel is not None:  # the unsplit model's tensor: every TP rank's piece joined
                    full = slot.tensor_parallel.full_tensor(full)
                if keep:
                    full = full.to("cpu", copy=True)
                    for key in keys.get(id(slot), []):
                        if key in state:
                            state[key] = full
            del fulls
    # After a stage a tensor-parallel module holds DTensor parameters again: the unsplit ones are saved.
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    if not keep:
        return {}
    return {
        k: (v.detach().to("cpu", copy=engine.closed) if isinstance(v, torch.Tensor) else v) for k, v in state.items()
    }


def _per_parameter(name: str, value: torch.Tensor, slot: ParamSlot) -> bool:
    """Whether a full optimizer-state tensor has one value per parameter element (so each rank takes its rows). A
    0-dim parameter's state is 0-dim too, like the ``step`` counter, the one 0-dim entry that is not per element."""
    if tuple(value.shape) != tuple(slot.unsplit_shape):
        return False
    return value.dim() > 0 or name != "step"


@torch.no_grad()
def full_optimizer_state_dict(
    engine: ShardingEngine, optimizer: Optimizer, *, rank0_only: bool = True, keep: bool | None = None
) -> StateDict:
    """``optimizer.state_dict()`` with full tensors on CPU; ``keep`` as for :func:`full_model_state_dict`."""
    state_dict = optimizer.state_dict()
    if keep is None:
        keep = not rank0_only or global_rank() == 0
    params = optimizer_params(optimizer)
    full_state: dict[int, StateDict] = {}
    # Parameter order is the same on every rank, so every rank issues the same gathers in the same order.
    for index, param in enumerate(params):
        slot = engine.slot_of(param)
        entry = state_dict["state"].get(index, {})
        new_entry: StateDict = {}
        for name in sorted(entry):
            value = entry[name]
            if slot is not None and is_slot_rows(value, slot):
                # Unsharded, only a 0-dim parameter's state (held as one row) needs its shape back.
                if slot.layout.world_size > 1:
                    value = gather_rows(value, slot.layout, engine.shard_comm)
                else:
                    value = value.reshape(slot.layout.shape)
                if slot.tensor_parallel is not None:  # the unsplit model's: every TP rank's piece joined
                    value = slot.tensor_parallel.full_tensor(value)
            if keep:
                new_entry[name] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        if keep and entry:
            full_state[index] = new_entry
    if not keep:
        return {}
    return {"state": full_state, "param_groups": state_dict["param_groups"]}


def load_full_optimizer_state_dict(engine: ShardingEngine, optimizer: Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load a plain ``torch.optim`` state dict (the same on every rank) into an optimizer over shards (over full
    parameters once the stage has ended and the module holds them again: then the state is loaded whole)."""
    state_dict = to_index_keyed(state_dict)  # checks it is a torch.optim state dict
    sizes = [len(g["params"]) for g in state_dict["param_groups"]]
    here = [len(g["params"]) for g in optimizer.param_groups]
    check_group_sizes(f"The checkpoint's {type(optimizer).__name__} state", sizes, here)
    params = optimizer_params(optimizer)
    local_state: dict[int, StateDict] = {}
    for index, entry in state_dict["state"].items():
        param = params[int(index)]
        slot = None if engine.closed else engine.slot_of(param)
        new_entry: StateDict = {}
        for name, value in entry.items():
            if slot is not None and isinstance(value, torch.Tensor) and _per_parameter(name, value, slot):
                value = slot.rows_of_unsplit(value).clone()
            new_entry[name] = value
        local_state[index] = new_entry
    optimizer.load_state_dict({"state": local_state, "param_groups": state_dict["param_groups"]})


def model_weights(checkpoint: object, path: str) -> Mapping[str, Any]:
    """The ``state_dict`` entry of a Lightning checkpoint read from ``path``; raises naming the file if it has none."""
    state = checkpoint.get("state_dict") if isinstance(checkpoint, Mapping) else None
    if not isinstance(state, Mapping):
        found = sorted(map(str, checkpoint)) if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise CheckpointLoadError(
            f"{path!r} is not a Lightning checkpoint: it has no 'state_dict' entry with the model's weights (its "
            f"entries: {found}).",
            path,
        )
    return state


class FullFormat(CheckpointFormat):
    """One file in Lightning's layout; plain Lightning (single device, DDP) loads it too."""

    kind = FULL
    writes_offline = True

    model_state_dict = staticmethod(full_model_state_dict)
    optimizer_state = staticmethod(full_optimizer_state_dict)

    def prepare_save(
        self, checkpoint: Checkpoint, path: _PATH, run: CheckpointRun, storage_options: object = None
    ) -> Callable[[], None]:
        # The rank the full state was gathered to writes it (the others' state dicts are empty), as Lightning's
        # Strategy.save_checkpoint does with is_global_zero.
        io = run.checkpoint_io
        assert io is not None
        if global_rank() != 0:
            return lambda: None
        return partial(io.save_checkpoint, checkpoint, path, storage_options=storage_options)

    def load(
        self, path: _PATH, run: CheckpointRun, *, weights_only: bool | None = None, coll: Collective | None = None
    ) -> Checkpoint:
        # Every rank reads the whole file (the CheckpointIO also reports remote and missing paths), as Lightning's
        # Strategy.load_checkpoint does, cached GPU memory released first.
        torch.cuda.empty_cache()
        assert run.checkpoint_io is not None
        return run.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def read_as_full(self, path: str, weights_only: bool | None = None) -> Checkpoint:
        checkpoint = AtomicCheckpointIO().load_checkpoint(path, weights_only=weights_only)
        model_weights(checkpoint, path)
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [to_index_keyed(s) for s in checkpoint["optimizer_states"]]
        return checkpoint

    def write_full(self, checkpoint: Mapping[str, object], path: str) -> None:
        if remote.is_remote(path):
            remote.remove_remote_directory(path)  # a directory checkpoint being replaced by one object
        elif os.path.isdir(path):  # a directory checkpoint being replaced by a file
            remove_checkpoint_path(path)
        AtomicCheckpointIO().save_checkpoint(dict(checkpoint), path)
