"""The strategy's checkpoint calls, routed to one of the three format objects: the one ``state_dict_type`` names for
saving (:func:`format_for_saving`), the one on disk for loading (:func:`format_on_disk`). Under pipeline parallelism
the strategy's pipeline role (``pipeline``) supplies what describes the unsplit model; without it, the plain
format's."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from torch.optim import Optimizer

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
from lightning_fsdp.engine.config import parse_enum
from lightning_fsdp.engine.meta_init import mark_initialised

__all__ = [
    "FORMATS",
    "FULL_FORMAT",
    "StateDictType",
    "atomic_by_default",
    "format_for_saving",
    "format_on_disk",
    "load_checkpoint",
    "load_model_state",
    "load_optimizer_states",
    "parse_state_dict_type",
    "remove_checkpoint",
    "save_checkpoint",
]

_T = TypeVar("_T")


class StateDictType(enum.Enum):
    """The checkpoint format written by the strategy."""

    FULL = "full"
    SHARDED = "sharded"
    LOCAL = "local"


def parse_state_dict_type(value: Any) -> StateDictType:
    return parse_enum(value, StateDictType, "state_dict_type")  # type: ignore[return-value]


FULL_FORMAT = FullFormat()
FORMATS: dict[str, CheckpointFormat] = {f.kind: f for f in (FULL_FORMAT, ShardedFormat(), LocalFormat())}


def format_for_saving(state_dict_type: StateDictType | str) -> CheckpointFormat:
    """The format a run with this ``state_dict_type`` writes (the value is parsed and checked by the strategy)."""
    return FORMATS[StateDictType(state_dict_type).value]


def format_on_disk(path: str) -> CheckpointFormat:
    """The format of the checkpoint at ``path``; raises ``paths.checkpoint_kind``'s error naming the path if it holds
    none (missing, an unrelated directory, a directory missing its shard files or ``meta.pt``)."""
    return FORMATS[checkpoint_kind(path)]


def atomic_by_default(io: CheckpointIO | None) -> CheckpointIO:
    """The strategy's ``CheckpointIO``: atomic writes unless the user chose one (an empty wrapper is filled)."""
    if io is None:
        return AtomicCheckpointIO()
    if isinstance(io, _WrappingCheckpointIO):
        io.checkpoint_io = AtomicCheckpointIO()  # the wrapper's setter fills it only if it is empty
    return io


def save_checkpoint(
    fmt: CheckpointFormat,
    checkpoint: dict[str, Any],
    path: Any,
    run: CheckpointRun,
    pipeline: Any,
    storage_options: Any | None = None,
) -> None:
    """Write ``checkpoint`` (built by the strategy's state-dict calls) in format ``fmt``; call on every rank."""
    info = pipeline.checkpoint_info(run.engine) if fmt.kind != FULL_FORMAT.kind else None
    fmt.save(checkpoint, path, run._replace(pipeline=info), storage_options)


def load_checkpoint(
    path: Any,
    engine: ShardingEngine | None,
    optimizers: list[Optimizer] | None,
    checkpoint_io: CheckpointIO,
    pipeline: Any,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Read the checkpoint at rank 0's ``path`` on every rank, in the format on disk (optimizer state only where
    ``optimizers`` are given)."""
    coll = Collective()
    path = coll.broadcast(path)
    if not is_local_path(path) or not os.path.exists(path) or os.path.isfile(path):
        fmt = FULL_FORMAT  # a file, or a path only the CheckpointIO can tell about (remote, missing)
    else:
        # A directory (sharded or local checkpoint), or a special file that must not be opened (a FIFO would
        # block): every rank checks it, and all raise, before any other collective, if one finds a problem.
        path = os.fspath(path)
        fmt = coll.run_agreed(lambda: _directory_format(path, engine, pipeline))
    info = pipeline.checkpoint_info(engine, optimizers) if fmt is not FULL_FORMAT else None
    run = CheckpointRun(engine, optimizers, checkpoint_io, info)
    return fmt.load(path, run, weights_only=weights_only, coll=coll)


def _directory_format(path: str, engine: ShardingEngine | None, pipeline: Any) -> CheckpointFormat:
    fmt = format_on_disk(path)
    if engine is None:
        raise RuntimeError(
            f"Cannot load the {fmt.kind} checkpoint directory {path!r} before the model is sharded; the Trainer "
            "loads it after setup (ckpt_path=...)."
        )
    pipeline.check_format(fmt.kind)
    return fmt


def remove_checkpoint(path: Any, checkpoint_io: CheckpointIO) -> None:
    if is_local_path(path) and os.path.isdir(path):  # a sharded/local checkpoint directory
        remove_checkpoint_path(os.fspath(path))
    else:
        checkpoint_io.remove_checkpoint(path)


def _agreed(info: Any, work: Callable[[], _T]) -> _T:
    # Under pipelining each stage checks its own part: a problem one stage finds raises on every rank.
    return work() if info is None else Collective().run_agreed(work)


def load_model_state(engine: ShardingEngine, checkpoint: Mapping[str, Any], strict: bool, pipeline: Any) -> None:
    """Copy the checkpoint's ``state_dict`` into the sharded model; call on every rank."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, Mapping):  # the same file on every rank: every rank raises here
        what = "no 'state_dict' entry" if state is None else f"a {type(state).__name__} as 'state_dict'"
        raise CheckpointMismatchError(
            f"The checkpoint holds {what} (its entries: {sorted(map(str, checkpoint))}); a Lightning checkpoint "
            "keeps the model's weights there."
        )
    info = pipeline.checkpoint_info(engine)
    _agreed(info, lambda: _load_model_state(engine, state, strict, info))


def _load_model_state(engine: ShardingEngine, state: Mapping[str, Any], strict: bool, info: Any) -> None:
    if info is not None and not isinstance(state, ShardedStateDict):  # the unsplit model's full state: this part
        state = info.local_model_state(state)
    load_model_state_dict(engine, state, strict=strict)
    # A model built on the meta device: what the checkpoint filled has values now (engine/meta_init.py).
    root = engine.root
    named = {**dict(root.named_parameters(remove_duplicate=False)), **dict(root.named_buffers(remove_duplicate=False))}
    mark_initialised(tensor for name, tensor in named.items() if name in state)


def load_optimizer_states(
    engine: ShardingEngine, optimizers: Sequence[Any], checkpoint: Mapping[str, Any], pipeline: Any
) -> None:
    """Load the checkpoint's ``optimizer_states`` into ``optimizers`` (in order); call on every rank."""
    states = checkpoint["optimizer_states"]
    check_optimizer_count("The checkpoint", len(states), len(optimizers))
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    info = pipeline.checkpoint_info(engine, optimizers)
    for index, (optimizer, state) in enumerate(zip(optimizers, states)):
        _agreed(info, lambda o=optimizer, s=state, i=index: _load_optimizer_state(engine, o, s, info, i))


def _load_optimizer_state(engine: ShardingEngine, optimizer: Optimizer, state: Any, info: Any, index: int) -> None:
    if isinstance(state, ShardedOptimizerState):  # from a sharded/local directory: already this rank's rows
        optimizer.load_state_dict(state)
        return
    state = to_index_keyed(state)  # plain torch.optim layout, or keyed by parameter name (consolidate_checkpoint)
    if info is not None:  # the unsplit optimizer's state: this rank's positions of it
        state = info.local_optimizer_state(index, state, optimizer, "The checkpoint")
    load_full_optimizer_state_dict(engine, optimizer, state)
