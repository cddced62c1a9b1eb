"""The strategy's checkpoint methods (:class:`CheckpointHooks`, inherited by ``FSDPStrategy``), routed to one of the
three format objects: the one ``state_dict_type`` names for saving (:func:`format_for_saving`), the one on disk for
loading (:func:`format_on_disk`). Under pipeline parallelism the strategy's pipeline role (``pipeline``) supplies what
describes the unsplit model; without it, the plain format's."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

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
from lightning_fsdp.weight_averaging import gather_averages_for_save, slice_loaded_averages

__all__ = [
    "FORMATS",
    "FULL_FORMAT",
    "CheckpointHooks",
    "StateDictType",
    "format_for_saving",
    "format_on_disk",
    "load_model_state",
    "parse_state_dict_type",
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


def _directory_format(path: str, engine: ShardingEngine | None, pipeline: Any) -> CheckpointFormat:
    fmt = format_on_disk(path)
    if engine is None:
        raise RuntimeError(
            f"Cannot load the {fmt.kind} checkpoint directory {path!r} before the model is sharded; the Trainer "
            "loads it after setup (ckpt_path=...)."
        )
    pipeline.check_format(fmt.kind)
    return fmt


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


def _load_optimizer_state(engine: ShardingEngine, optimizer: Optimizer, state: Any, info: Any, index: int) -> None:
    if isinstance(state, ShardedOptimizerState):  # from a sharded/local directory: already this rank's rows
        optimizer.load_state_dict(state)
        return
    state = to_index_keyed(state)  # plain torch.optim layout, or keyed by parameter name (consolidate_checkpoint)
    if info is not None:  # the unsplit optimizer's state: this rank's positions of it
        state = info.local_optimizer_state(index, state, optimizer, "The checkpoint")
    load_full_optimizer_state_dict(engine, optimizer, state)


class CheckpointHooks:
    """The strategy's checkpoint methods, mixed into ``FSDPStrategy`` ahead of Lightning's ``ParallelStrategy``, whose
    methods these replace. Reads the strategy's ``engine``, ``state_dict_type``, ``optimizers`` and pipeline role."""

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        # Set lazily, not in __init__, so a user's plugins=[SomeCheckpointIO()] takes precedence without a conflict.
        # Atomic writes unless the user chose a CheckpointIO; an empty wrapper is filled (its setter fills only that).
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Checkpoints hold full tensors; they can only be split into shards once the model is sharded.
        return True

    @property
    def _checkpoint_format(self) -> CheckpointFormat:
        return format_for_saving(self.state_dict_type)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.engine is not None
        return self._pipeline_role.model_state_dict(self._checkpoint_format, self.engine)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        assert self.engine is not None
        load_model_state(self.engine, checkpoint, strict, self._pipeline_role)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        assert self.engine is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self._pipeline_role.optimizer_state(self._checkpoint_format, self.engine, optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        assert self.engine is not None
        states = checkpoint["optimizer_states"]
        check_optimizer_count("The checkpoint", len(states), len(self.optimizers))
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        info = self._pipeline_role.checkpoint_info(self.engine, optimizers)
        for index, (optimizer, state) in enumerate(zip(optimizers, states)):
            _agreed(info, lambda o=optimizer, s=state, i=index: _load_optimizer_state(self.engine, o, s, info, i))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        gather_averages_for_save(self, checkpoint)  # SWA / EMA averages: full tensors, not rank 0's rows only
        fmt = self._checkpoint_format
        info = self._pipeline_role.checkpoint_info(self.engine) if fmt is not FULL_FORMAT else None
        run = CheckpointRun(self.engine, self.optimizers, self.checkpoint_io, info)
        fmt.save(checkpoint, filepath, run, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read rank 0's ``checkpoint_path`` on every rank, in the format on disk (optimizer state when fitting)."""
        coll = Collective()
        path = coll.broadcast(checkpoint_path)
        trainer = self._trainer()
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers] if fitting else None
        if not is_local_path(path) or not os.path.exists(path) or os.path.isfile(path):
            fmt = FULL_FORMAT  # a file, or a path only the CheckpointIO can tell about (remote, missing)
        else:
            # A directory (sharded or local checkpoint), or a special file that must not be opened (a FIFO would
            # block): every rank checks it, and all raise, before any other collective, if one finds a problem.
            path = os.fspath(path)
            fmt = coll.run_agreed(lambda: _directory_format(path, self.engine, self._pipeline_role))
        info = self._pipeline_role.checkpoint_info(self.engine, optimizers) if fmt is not FULL_FORMAT else None
        run = CheckpointRun(self.engine, optimizers, self.checkpoint_io, info)
        checkpoint = fmt.load(path, run, weights_only=weights_only, coll=coll)
        return slice_loaded_averages(self, checkpoint)  # each rank's rows of the SWA / EMA averages

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.is_global_zero:
            return
        if is_local_path(filepath) and os.path.isdir(filepath):  # a sharded/local checkpoint directory
            remove_checkpoint_path(os.fspath(filepath))
        else:
            self.checkpoint_io.remove_checkpoint(filepath)
