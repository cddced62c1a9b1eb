"""The strategy's checkpoint methods, as functions ``FSDPStrategy``'s delegate to, each routed to one of the three
format objects: the one ``state_dict_type`` names for saving (:func:`format_for_saving`), the one on disk for loading
(:func:`format_on_disk`). Under pipeline parallelism the strategy's pipeline role supplies what describes the unsplit
model (a ``PipelineCheckpoint``); without it, the plain format's."""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from torch.optim import Optimizer

from lightning_fsdp.checkpoint import Checkpoint, remote
from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO, is_local_path
from lightning_fsdp.checkpoint.common import (
    CheckpointFormat,
    CheckpointMismatchError,
    CheckpointRun,
    ShardedOptimizerState,
    ShardedStateDict,
    check_optimizer_count,
    load_model_state_dict,
    to_index_keyed,
)
from lightning_fsdp.checkpoint.full import FullFormat, load_full_optimizer_state_dict
from lightning_fsdp.checkpoint.local import LocalFormat
from lightning_fsdp.checkpoint.paths import checkpoint_kind, remove_checkpoint_path
from lightning_fsdp.checkpoint.sharded import ShardedFormat
from lightning_fsdp.collective import Collective
from lightning_fsdp.engine import ShardingEngine
from lightning_fsdp.engine.meta_init import mark_initialised
from lightning_fsdp.engine.options import parse_enum

if TYPE_CHECKING:
    from lightning_fsdp.pipeline.checkpoint import PipelineCheckpoint
    from lightning_fsdp.pipeline.role import PipelineRole

__all__ = [
    "FORMATS",
    "FULL_FORMAT",
    "StateDictType",
    "format_for_saving",
    "format_on_disk",
    "load_model_state",
    "load_optimizer_states",
    "parse_state_dict_type",
    "prepare_save_as",
    "read_checkpoint",
    "remove_checkpoint_at",
    "save_checkpoint_as",
    "unwrapped_optimizer",
    "with_atomic_default",
]

_T = TypeVar("_T")


class StateDictType(enum.Enum):
    """The checkpoint format written by the strategy."""

    FULL = "full"
    SHARDED = "sharded"
    LOCAL = "local"


def parse_state_dict_type(value: object) -> StateDictType:
    member = parse_enum(value, StateDictType, "state_dict_type")
    assert isinstance(member, StateDictType)  # a member of the class it is given, or a ValueError
    return member


FULL_FORMAT = FullFormat()
FORMATS: dict[str, CheckpointFormat] = {f.kind: f for f in (FULL_FORMAT, ShardedFormat(), LocalFormat())}


def format_for_saving(state_dict_type: StateDictType | str) -> CheckpointFormat:
    """The format a run with this ``state_dict_type`` writes (the value is parsed and checked by the strategy)."""
    return FORMATS[StateDictType(state_dict_type).value]


def format_on_disk(path: str) -> CheckpointFormat:
    """The format of the checkpoint at ``path``; raises ``paths.checkpoint_kind``'s error naming the path if it holds
    none (missing, an unrelated directory, a directory missing its shard files or ``meta.pt``)."""
    return FORMATS[checkpoint_kind(path)]


def _directory_format(path: str, engine: ShardingEngine | None, role: PipelineRole) -> CheckpointFormat:
    fmt = format_on_disk(path)
    if engine is None:
        raise RuntimeError(
            f"Cannot load the {fmt.kind} checkpoint directory {path!r} before the model is sharded; the Trainer "
            "loads it after setup (ckpt_path=...)."
        )
    role.check_format(fmt.kind)
    return fmt


def _agreed(info: PipelineCheckpoint | None, work: Callable[[], _T]) -> _T:
    # Under pipelining each stage checks its own part: a problem one stage finds raises on every rank.
    return work() if info is None else Collective().run_agreed(work)


def load_model_state(
    engine: ShardingEngine, checkpoint: Mapping[str, object], strict: bool, role: PipelineRole
) -> None:
    """Copy the checkpoint's ``state_dict`` into the sharded model; call on every rank."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, Mapping):  # the same file on every rank: every rank raises here
        what = "no 'state_dict' entry" if state is None else f"a {type(state).__name__} as 'state_dict'"
        raise CheckpointMismatchError(
            f"The checkpoint holds {what} (its entries: {sorted(map(str, checkpoint))}); a Lightning checkpoint "
            "keeps the model's weights there."
        )
    info = role.checkpoint_info(engine)
    _agreed(info, lambda: _load_model_state(engine, state, strict, info))


def _load_model_state(
    engine: ShardingEngine, state: Mapping[str, object], strict: bool, info: PipelineCheckpoint | None
) -> None:
    if info is not None and not isinstance(state, ShardedStateDict):  # the unsplit model's full state: this part
        state = info.local_model_state(state)
    load_model_state_dict(engine, state, strict=strict)
    # A model built on the meta device: what the checkpoint filled has values now (engine/meta_init.py).
    root = engine.root
    named = {**dict(root.named_parameters(remove_duplicate=False)), **dict(root.named_buffers(remove_duplicate=False))}
    mark_initialised(tensor for name, tensor in named.items() if name in state)


def _load_optimizer_state(
    engine: ShardingEngine,
    optimizer: Optimizer,
    state: Mapping[str, object],
    info: PipelineCheckpoint | None,
    index: int,
) -> None:
    if isinstance(state, ShardedOptimizerState):  # from a sharded/local directory: already this rank's rows
        optimizer.load_state_dict(state)
        return
    state = to_index_keyed(state)  # plain torch.optim layout, or keyed by parameter name (consolidate_checkpoint)
    if info is not None:  # the unsplit optimizer's state: this rank's positions of it
        state = info.local_optimizer_state(index, state, optimizer, "The checkpoint")
    load_full_optimizer_state_dict(engine, optimizer, state)


def unwrapped_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer itself, also where a ``LightningOptimizer`` wraps it."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def with_atomic_default(checkpoint_io: CheckpointIO | None) -> CheckpointIO:
    """The ``CheckpointIO`` the strategy writes through: the user's, else atomic writes; a Lightning wrapper left
    empty (``plugins=[AsyncCheckpointIO()]``) is filled with atomic writes (its setter fills only an empty one)."""
    if checkpoint_io is None:
        return AtomicCheckpointIO()
    if isinstance(checkpoint_io, _WrappingCheckpointIO):
        checkpoint_io.checkpoint_io = AtomicCheckpointIO()
    return checkpoint_io


def load_optimizer_states(
    engine: ShardingEngine, states: Sequence[Mapping[str, object]], optimizers: Sequence[Optimizer], role: PipelineRole
) -> None:
    """Copy the checkpoint's ``optimizer_states`` into the optimizers of the sharded model; call on every rank."""
    check_optimizer_count("The checkpoint", len(states), len(optimizers))
    info = role.checkpoint_info(engine, optimizers)
    for index, (optimizer, state) in enumerate(zip(optimizers, states)):
        _agreed(info, partial(_load_optimizer_state, engine, optimizer, state, info, index))


def save_checkpoint_as(
    fmt: CheckpointFormat,
    checkpoint: Checkpoint,
    path: _PATH,
    storage_options: object,
    run: CheckpointRun,
    role: PipelineRole,
) -> None:
    """Write ``checkpoint`` in ``fmt`` on every rank; ``run.pipeline`` is filled in here (a collective under
    pipelining) for the directory formats, which record the other stages' keys."""
    prepare_save_as(fmt, checkpoint, path, storage_options, run, role)()


def prepare_save_as(
    fmt: CheckpointFormat,
    checkpoint: Checkpoint,
    path: _PATH,
    storage_options: object,
    run: CheckpointRun,
    role: PipelineRole,
) -> Callable[[], None]:
    """:func:`save_checkpoint_as` in two parts (``CheckpointFormat.prepare_save``): what reads the live run, now;
    the write it returns, which may run in a background thread."""
    info = role.checkpoint_info(run.engine) if fmt is not FULL_FORMAT else None
    return fmt.prepare_save(checkpoint, path, run._replace(pipeline=info), storage_options)


def read_checkpoint(path: _PATH, run: CheckpointRun, role: PipelineRole, weights_only: bool | None) -> Checkpoint:
    """Read rank 0's ``path`` on every rank, in the format on disk (optimizer state if ``run.optimizers``)."""
    coll = Collective()
    path = coll.broadcast(path)
    if remote.is_remote(path):
        # Object storage: one object is a full checkpoint (read through the CheckpointIO); a committed directory is
        # downloaded by every rank and read as on disk. Every rank checks it before any other collective.
        url = os.fspath(path)
        if coll.run_agreed(lambda: remote.remote_kind(url)) == FULL_FORMAT.kind:
            return FULL_FORMAT.load(path, run, weights_only=weights_only, coll=coll)
        with contextlib.ExitStack() as stack:
            local = coll.run_agreed(lambda: stack.enter_context(remote.staged_directory(url)))
            return _read_directory(local, run, role, weights_only, coll)
    if not is_local_path(path) or not os.path.exists(path) or os.path.isfile(path):
        fmt: CheckpointFormat = FULL_FORMAT  # a file, or a path only the CheckpointIO can tell about (missing)
        return fmt.load(path, run, weights_only=weights_only, coll=coll)
    return _read_directory(os.fspath(path), run, role, weights_only, coll)


def _read_directory(
    directory: str, run: CheckpointRun, role: PipelineRole, weights_only: bool | None, coll: Collective
) -> Checkpoint:
    # A directory (sharded or local checkpoint), or a special file that must not be opened (a FIFO would block):
    # every rank checks it, and all raise, before any other collective, if one finds a problem.
    fmt = coll.run_agreed(lambda: _directory_format(directory, run.engine, role))
    info = role.checkpoint_info(run.engine, run.optimizers)
    return fmt.load(directory, run._replace(pipeline=info), weights_only=weights_only, coll=coll)


def remove_checkpoint_at(path: _PATH, checkpoint_io: CheckpointIO) -> None:
    """Remove the checkpoint at ``path``: a directory here, a file through the ``CheckpointIO`` (call on rank 0)."""
    if remote.is_remote(path):  # object storage: the commit object first (remote.py)
        remote.remove_remote_checkpoint(os.fspath(path))
    elif is_local_path(path) and os.path.isdir(path):  # a sharded/local checkpoint directory
        remove_checkpoint_path(os.fspath(path))
    else:
        checkpoint_io.remove_checkpoint(path)
