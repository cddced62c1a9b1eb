"""What the checkpoint formats share: the format interface, the atomic directory write, the state dicts that hold
this rank's rows, and the names of state-dict keys and optimizer parameters in the engine's slots."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_fsdp.checkpoint import Checkpoint, StateDict, paths, remote
from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO
from lightning_fsdp.collective import Collective, raised_alike_on_every_rank
from lightning_fsdp.engine import ShardingEngine
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.records import ParamSlot

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.fabric.utilities.types import _PATH

    from lightning_fsdp.pipeline.checkpoint import PipelineCheckpoint

FORMAT_KEY = "lightning_fsdp"  # meta.pt entry describing the directory (format, version, world size, layout)
FORMAT_VERSION = 1


@raised_alike_on_every_rank
class CheckpointMismatchError(ValueError, RuntimeError):
    """The checkpoint does not fit this run: another world size, shard layout, parameter shape, key set or number of
    optimizers. A ``ValueError`` (and a ``RuntimeError``, like ``nn.Module.load_state_dict``'s key errors)."""


class ShardedStateDict(StateDict):
    """A model state dict whose sharded parameters hold only this rank's rows, read from a directory checkpoint (so
    loading copies them in without slicing). ``unexpected_keys``: checkpoint keys the model lacks; ``source``: the
    path."""

    def __init__(
        self, entries: Mapping[str, object] | None = None, *, unexpected_keys: tuple[str, ...] = (), source: str = ""
    ) -> None:
        super().__init__(entries or {})
        self.unexpected_keys = tuple(unexpected_keys)
        self.source = source


class ShardedOptimizerState(StateDict):
    """``optimizer.state_dict()`` for this rank, state tensors holding its rows: ``load_state_dict`` takes it as is."""


def engine_param_names(engine: ShardingEngine) -> dict[int, str]:
    """The canonical (first) name of every parameter of the engine's module, by ``id``."""
    engine.reshard_idle()  # names are read past the stand-ins a forward without backward left
    return {id(p): n for n, p in engine.root.named_parameters()}


def managed_keys(engine: ShardingEngine) -> dict[str, ParamSlot]:
    """State-dict key -> slot for every key naming a managed parameter (a tied parameter has several keys)."""
    # A forward whose backward never came leaves full-size stand-ins in the modules; names are read past them.
    engine.reshard_idle()
    keys: dict[str, ParamSlot] = {}
    for name, param in engine.root.named_parameters(remove_duplicate=False):
        slot = engine.slot_of(param)
        if slot is not None:
            keys[name] = slot
    return keys


def optimizer_params(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def is_sharded(layout: ShardLayout) -> bool:
    return layout.world_size > 1


def is_local_rows(value: object, layout: ShardLayout) -> bool:
    """Whether ``value`` is a per-row tensor holding this rank's rows of a sharded parameter (its shard, or optimizer
    state shaped like it). A 0-dim parameter is stored as one row (shape ``(1,)`` or ``(0,)``) at any world size."""
    return (
        (is_sharded(layout) or len(layout.shape) == 0)
        and isinstance(value, torch.Tensor)
        and value.dim() > 0
        and tuple(value.shape) == tuple(layout.local_shape)
    )


def is_slot_rows(value: object, slot: ParamSlot) -> bool:
    """``is_local_rows`` for a managed parameter: also a DTensor parameter's piece on a single data-parallel rank
    (its state is then the TP piece, not the unsplit tensor)."""
    if slot.tensor_parallel is not None and isinstance(value, torch.Tensor) and value.dim() > 0:
        return tuple(value.shape) == tuple(slot.layout.local_shape)
    return is_local_rows(value, slot.layout)


def shape_str(shape: Sequence[int]) -> str:
    return str(tuple(int(s) for s in shape))


def _check_keys(strict: bool, what: str, missing: list[str], unexpected: list[str]) -> None:
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"{what}: missing keys {missing}, unexpected keys {unexpected}. Load with strict=False "
            "(LightningModule.strict_loading = False) to skip them."
        )


@torch.no_grad()
def load_model_state_dict(engine: ShardingEngine, state: Mapping[str, object], *, strict: bool = True) -> None:
    """Copy a state dict into the sharded module on every rank: full tensors (each rank copies its rows), or a
    :class:`ShardedStateDict` (this rank's rows already). Once the stage has ended and the module holds its full
    parameters again (``weights_after_stage``), full tensors are copied in whole."""
    module = engine.root
    if engine.closed:
        result = module.load_state_dict(state, strict=False)
        what = f"Error loading state dict into {type(module).__name__}"
        _check_keys(strict, what, result.missing_keys, result.unexpected_keys)
        return
    managed = managed_keys(engine)
    own = module.state_dict()
    rows = state if isinstance(state, ShardedStateDict) else None  # this rank's rows, read from a directory
    if rows is not None:
        unexpected = list(rows.unexpected_keys) + [k for k in rows if k not in own and k not in rows.unexpected_keys]
        what = f"Checkpoint {rows.source!r} does not match {type(module).__name__}"
        _check_keys(strict, what, [k for k in own if k not in rows], unexpected)
    for key, slot in managed.items():
        if key not in state:
            continue
        value = state[key]
        if rows is not None:
            local_shape = tuple(slot.layout.local_shape)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != local_shape:
                got = shape_str(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise CheckpointMismatchError(
                    f"Checkpoint {rows.source!r}: this rank's part of {key!r} has shape {got}, but its shard here "
                    f"is {shape_str(local_shape)}."
                )
            if not _same_memory(value, slot.param.data):  # a sharded load reads into the shards themselves
                slot.param.data.copy_(value)
            continue
        if not isinstance(value, torch.Tensor):
            raise CheckpointMismatchError(
                f"Checkpoint entry {key!r} is a {type(value).__name__}, not a tensor; the model's parameter is a "
                f"tensor of shape {tuple(slot.unsplit_shape)}. The checkpoint is damaged or belongs to another model."
            )
        if tuple(value.shape) != tuple(slot.unsplit_shape):
            raise CheckpointMismatchError(
                f"Checkpoint tensor {key!r} has shape {tuple(value.shape)}, the model's parameter has "
                f"{tuple(slot.unsplit_shape)}; it is a checkpoint of another model."
            )
        slot.param.data.copy_(slot.rows_of_unsplit(value.to(slot.param.device, slot.param.dtype)))
    # Buffers and unmanaged parameters through nn.Module; managed ones get their current shards (a no-op).
    rest = {k: v for k, v in state.items() if k not in managed}
    rest.update({key: own[key] for key in managed if key in own})
    result = module.load_state_dict(rest, strict=False)
    missing = [k for k in result.missing_keys if k not in managed] + [k for k in managed if k not in state]
    if rows is None:
        _check_keys(strict, f"Error loading state dict into {type(module).__name__}", missing, result.unexpected_keys)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()


# The names the formats' loaders had before they shared one.
load_sharded_model_state_dict = load_full_model_state_dict = load_model_state_dict


def to_index_keyed(state_dict: Mapping[str, Any]) -> StateDict:
    """An optimizer state dict keyed by parameter name (Lightning's consolidation of a sharded checkpoint) re-keyed
    by position, the plain ``torch.optim`` layout; index-keyed input passes through."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if (
        not isinstance(groups, list)
        or not all(isinstance(g, Mapping) and "params" in g for g in groups)
        or not isinstance(state_dict.get("state"), Mapping)
    ):
        found = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise CheckpointMismatchError(
            "The checkpoint's optimizer state is not a torch.optim state dict ('state' and 'param_groups' with their "
            f"'params'); found {found}."
        )
    order = [p for g in groups for p in g["params"]]
    if all(isinstance(p, int) for p in order):
        return dict(state_dict)
    position = {p: i for i, p in enumerate(order)}
    state = {}
    for key, entry in state_dict["state"].items():
        if key in position:
            state[position[key]] = entry
        elif isinstance(key, str) and key.isdigit():
            state[int(key)] = entry
    new_groups = [{**g, "params": [position[p] for p in g["params"]]} for g in groups]
    return {**state_dict, "state": state, "param_groups": new_groups}


def check_optimizer_count(source: str, saved: int, here: int) -> None:
    if saved != here:  # zip() would silently skip the difference
        raise CheckpointMismatchError(
            f"{source} holds the state of {saved} optimizer(s), but this run configured {here}; resume with the same "
            "optimizers."
        )


def check_group_sizes(what: str, sizes: Sequence[int | None], here: Sequence[int], over: str = "") -> None:
    """Raise naming ``what`` (the checkpoint's optimizer) if its parameter groups' sizes are not this run's."""
    if list(sizes) != list(here):
        raise CheckpointMismatchError(
            f"{what} has parameter groups of sizes {sizes}, but this run's has {here}{over}; resume with the same "
            "optimizer configuration."
        )


def check_param_names(what: str, names: Sequence[object], here: Sequence[object]) -> None:
    """Raise naming ``what`` (the checkpoint's optimizer) at the first position whose parameter is another one."""
    for position, (saved, current) in enumerate(zip(names, here)):
        if saved != current:
            raise CheckpointMismatchError(
                f"{what}'s parameter {position} is {saved!r} in the checkpoint but {current!r} in this run; it is a "
                "checkpoint of another model."
            )


def numbered_groups(groups: Sequence[Mapping[str, object]], sizes: Sequence[int]) -> list[dict[str, object]]:
    """``groups`` listing ``sizes`` parameters each, numbered one group after another as ``torch.optim`` does."""
    numbered: list[dict[str, object]] = []
    start = 0
    for group, size in zip(groups, sizes):
        numbered.append({**group, "params": list(range(start, start + size))})
        start += size
    return numbered


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


class CheckpointRun(NamedTuple):
    """What a format takes from the run that saves or loads a checkpoint."""

    engine: ShardingEngine | None  # None before the model is sharded (only a full file can be read then)
    optimizers: Sequence[Optimizer] | None = None  # a load restores optimizer state only where these are given
    checkpoint_io: CheckpointIO | None = None  # Lightning's: the full format's file goes through it
    # Under pipeline parallelism: the other stages' keys and the unsplit optimizers' param groups (see [Note:
    # checkpoints across pipeline layouts] in lightning_fsdp/pipeline/checkpoint.py).
    pipeline: PipelineCheckpoint | None = None


class CheckpointFormat:
    """One checkpoint format: how the strategy's state is taken, written, read back, and read whole by ``convert``.
    The three formats differ in every step, so the strategy never asks which one it holds. A load returns full
    tensors (each rank slices its rows) or a :class:`ShardedStateDict` / :class:`ShardedOptimizerState` (its rows)."""

    kind: ClassVar[str]  # "full", "sharded" or "local": the state_dict_type value and paths.checkpoint_kind's answer
    writes_offline: ClassVar[bool] = False  # whether ``write_full`` works (a target of ``lightning-fsdp convert``)

    # Each of these is called on every rank of the run.
    def model_state_dict(self, engine: ShardingEngine) -> StateDict:
        raise NotImplementedError

    def optimizer_state(self, engine: ShardingEngine, optimizer: Optimizer) -> StateDict:
        raise NotImplementedError

    def save(self, checkpoint: Checkpoint, path: _PATH, run: CheckpointRun, storage_options: object = None) -> None:
        self.prepare_save(checkpoint, path, run, storage_options)()

    def prepare_save(
        self, checkpoint: Checkpoint, path: _PATH, run: CheckpointRun, storage_options: object = None
    ) -> Callable[[], None]:
        """A save in two parts: what reads the live model or checks the arguments, done now on every rank, and the
        write it returns, which reads only ``checkpoint`` (and the run's fixed layout), so that it may run in a
        background thread while training goes on (``async_checkpoint``, checkpoint/async_save.py)."""
        raise NotImplementedError

    def load(
        self, path: _PATH, run: CheckpointRun, *, weights_only: bool | None = None, coll: Collective | None = None
    ) -> Checkpoint:
        """``path`` as a Lightning checkpoint dict (optimizer state only if ``run.optimizers``)."""
        raise NotImplementedError

    # ``convert`` and ``export``: in this process alone, in Lightning's full layout.
    def read_as_full(self, path: str, weights_only: bool | None = None) -> Checkpoint:
        raise NotImplementedError

    def write_full(self, checkpoint: Mapping[str, object], path: str) -> None:
        raise ValueError(f"A {self.kind} checkpoint cannot be written from a full one outside a run.")


class DirectoryFormat(CheckpointFormat):
    """A directory every rank writes its part of and reads its rows from, not through the ``CheckpointIO``: on a
    local (or network-mounted) file system, or on object storage (``remote.py``: staged locally, then uploaded)."""

    def write(self, checkpoint: Checkpoint, path: _PATH, run: CheckpointRun) -> None:
        raise NotImplementedError

    def read(
        self, path: str, run: CheckpointRun, *, coll: Collective | None = None, weights_only: bool | None = None
    ) -> Checkpoint:
        """The checkpoint dict with this rank's rows."""
        raise NotImplementedError

    def prepare_save(
        self, checkpoint: Checkpoint, path: _PATH, run: CheckpointRun, storage_options: object = None
    ) -> Callable[[], None]:
        # Refused: what only a CheckpointIO could do, storage options (every rank writes here).
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported with "
                f"state_dict_type={self.kind!r}: sharded and local checkpoints are written by every rank directly, "
                "not through the CheckpointIO."
            )
        assert run.engine is not None
        return partial(self.write, checkpoint, path, run)

    def load(
        self, path: _PATH, run: CheckpointRun, *, weights_only: bool | None = None, coll: Collective | None = None
    ) -> Checkpoint:
        assert run.engine is not None
        coll = coll or Collective()
        if run.engine.closed:
            # The stage has ended and the module holds its full parameters again (weights_after_stage): every rank
            # reads the whole directory, as it would a full file.
            return coll.run_agreed(lambda: self.read_as_full(os.fspath(path), weights_only=weights_only))
        return self.read(os.fspath(path), run, coll=coll, weights_only=weights_only)


def write_directory(
    path: _PATH,
    kind: str,
    write_part: Callable[[str], None],
    meta: Callable[[], Mapping[str, object]],
    coll: Collective,
) -> None:
    """Write a directory checkpoint of format ``kind`` atomically, on every rank: each writes its part into rank 0's
    temporary directory (``write_part(tmp)`` must raise on every rank if it fails on one), then rank 0 writes
    ``meta()`` and renames it into place. A failure leaves what was at ``path`` untouched and raises on every rank.
    On object storage (an fsspec URL), each rank's part is uploaded and committed instead (``remote.py``)."""
    if remote.is_remote(coll.broadcast(os.fspath(path))):
        remote.write_remote_directory(os.fspath(path), kind, write_part, meta, coll)
        return
    target = coll.broadcast(os.path.abspath(os.fspath(path)))
    problem: Exception | None = None
    tmp = ""  # rank 0's, broadcast below
    if coll.is_rank0:
        try:
            tmp = paths.prepare_temp_dir(target)
        except Exception as exc:  # noqa: BLE001 - shared with every rank below
            problem = exc
    coll.agree_from_rank0(problem)
    tmp = coll.broadcast(tmp)
    try:
        write_part(tmp)
    except BaseException:
        if coll.is_rank0:
            try:
                paths.remove_path(tmp)
            except OSError:  # the write's own error is the one to report
                pass
        raise
    problem = None
    if coll.is_rank0:
        try:
            AtomicCheckpointIO().save_checkpoint(dict(meta()), os.path.join(tmp, paths.META_FILE))
            paths.commit_directory(tmp, target)
            paths.remove_stale_temps(target)
        except Exception as exc:  # noqa: BLE001
            problem = exc
            paths.remove_path(tmp)
    coll.agree_from_rank0(problem)
