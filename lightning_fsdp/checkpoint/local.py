"""Local checkpoints: ``rank-{r}.pt`` per rank with its raw shards plus ``meta.pt`` recording the layout; they load
only at the world size and shard layout that wrote them (anything else raises ``CheckpointMismatchError`` naming the
difference). Layout: docs/checkpoints.md."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch.distributed.tensor import Shard
from torch.optim import Optimizer
from typing_extensions import NotRequired

from lightning_fsdp.checkpoint import Checkpoint, StateDict, common
from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO, CheckpointLoadError
from lightning_fsdp.checkpoint.common import (
    CheckpointMismatchError,
    CheckpointRun,
    ShardedOptimizerState,
)
from lightning_fsdp.checkpoint.paths import LOCAL, META_FILE, file_problem, local_rank_file
from lightning_fsdp.collective import Collective
from lightning_fsdp.engine import ShardingEngine
from lightning_fsdp.engine.tensor_parallel import TensorParallelSpec

if TYPE_CHECKING:
    from lightning.fabric.utilities.types import _PATH

# Reads one rank's file: ``load(file, weights_only=...)``, by default ``AtomicCheckpointIO().load_checkpoint``.
RankFileLoader = Callable[..., Checkpoint]


class TensorParallelEntry(TypedDict):
    """A tensor-parallel parameter's split: the unsplit shape and the dim its TP pieces split (None: replicated)."""

    shape: tuple[int, ...]
    dim: int | None


class EntryLayout(TypedDict):
    """How one state-dict entry is stored: its full shape (None: not a tensor; a TP piece's for a tensor-parallel
    parameter), dtype, and each shard rank's rows."""

    shape: tuple[int, ...] | None
    dtype: str
    rows: list[tuple[int, int]] | None
    tensor_parallel: NotRequired[TensorParallelEntry]  # absent without TP (and before TP pieces were recorded)


class LocalLayout(TypedDict):
    """``meta.pt``'s ``"lightning_fsdp"`` entry of a local checkpoint: what the run that loads it must match."""

    format: str
    version: int
    world_size: int
    shard_world_size: int
    tensor_parallel_size: int  # 1 without tensor parallelism (and in checkpoints written before it existed)
    entries: dict[str, EntryLayout]
    optimizers: list[list[list[str]]] | None  # each optimizer's param groups, by parameter name


def local_model_state_dict(engine: ShardingEngine) -> StateDict:
    """The module's state dict as it is: this rank's rows (views, no copies)."""
    managed = common.managed_keys(engine)  # first: it puts the user's parameters back where a forward left stand-ins
    state = engine.root.state_dict()
    if engine.closed:  # the stage ended and the module holds full parameters again: save this rank's rows
        for key, slot in managed.items():
            if key in state:
                state[key] = engine.shard_of(slot)
    return state


def local_optimizer_state_dict(optimizer: Optimizer) -> StateDict:
    return optimizer.state_dict()


def layout_info(engine: ShardingEngine, optimizers: Sequence[Optimizer] | None, world_size: int) -> LocalLayout:
    """What a local checkpoint must match to be loaded (``meta.pt``'s ``"lightning_fsdp"`` entry)."""
    managed = common.managed_keys(engine)
    entries: dict[str, EntryLayout] = {}
    for key, value in engine.root.state_dict().items():
        slot = managed.get(key)
        if slot is not None:
            layout = slot.layout
            entries[key] = {
                "shape": tuple(int(s) for s in layout.shape),
                "dtype": str(slot.param.dtype),
                "rows": [layout.rows_of(r) for r in range(layout.world_size)],
            }
            if slot.tensor_parallel is not None:
                entries[key]["tensor_parallel"] = _tensor_parallel_entry(slot.tensor_parallel)
        elif isinstance(value, torch.Tensor):
            entries[key] = {"shape": tuple(int(s) for s in value.shape), "dtype": str(value.dtype), "rows": None}
        else:
            entries[key] = {"shape": None, "dtype": type(value).__name__, "rows": None}
    names = common.engine_param_names(engine)
    optimizer_names = None
    if optimizers is not None:
        optimizer_names = [
            [[names.get(id(p), "?") for p in group["params"]] for group in opt.param_groups] for opt in optimizers
        ]
    return {
        "format": "local",
        "version": common.FORMAT_VERSION,
        "world_size": world_size,
        "shard_world_size": engine.shard_comm.world_size,
        "tensor_parallel_size": _tensor_parallel_size(engine),
        "entries": entries,
        "optimizers": optimizer_names,
    }


def _tensor_parallel_entry(spec: TensorParallelSpec) -> TensorParallelEntry:
    dims = [p.dim for p in spec.placements if isinstance(p, Shard)]
    return {"shape": tuple(int(s) for s in spec.shape), "dim": dims[0] if dims else None}


def _write_file(obj: object, file: str) -> None:
    """``torch.save`` into ``file`` and make it durable (a seam for tests that kill a rank mid-write)."""
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_local_checkpoint(
    checkpoint: Mapping[str, object],
    path: _PATH,
    engine: ShardingEngine,
    optimizers: Sequence[Optimizer] | None,
    coll: Collective | None = None,
    layout: LocalLayout | None = None,
) -> None:
    """Write a checkpoint of :func:`local_model_state_dict` and ``optimizer.state_dict()`` to ``path``, atomically,
    on every rank; ``layout``: :func:`layout_info` taken beforehand (a write in a background thread must not read the
    live engine), else read from ``engine`` here."""
    coll = coll or Collective()
    rest = dict(checkpoint)
    state = rest.pop("state_dict", {})
    optimizer_states = rest.pop("optimizer_states", None)
    shard_rank = engine.shard_comm.rank
    specs = [s.tensor_parallel for u in engine.units for s in u.slots if s.tensor_parallel is not None]
    tensor_parallel_rank = specs[0].mesh.get_local_rank() if specs else 0

    def write_part(tmp: str) -> None:
        part = {
            "format": "local",
            "version": common.FORMAT_VERSION,
            "rank": coll.rank,
            "world_size": coll.world_size,
            "shard_rank": shard_rank,
            "tensor_parallel_rank": tensor_parallel_rank,
            "state_dict": state,
            "optimizer_states": optimizer_states,
        }
        coll.run_agreed(lambda: _write_file(part, os.path.join(tmp, local_rank_file(coll.rank))))

    def meta() -> dict[str, object]:
        described = optimizers if optimizer_states is not None else None
        return {**rest, common.FORMAT_KEY: layout or layout_info(engine, described, coll.world_size)}

    common.write_directory(path, LOCAL, write_part, meta, coll)


def read_local_meta(path: str, weights_only: bool | None = None) -> tuple[Checkpoint, dict[str, Any]]:
    """(Lightning part, ``"lightning_fsdp"`` entry: a ``LocalLayout`` as saved) of a local checkpoint's ``meta.pt``."""
    meta_file = os.path.join(path, META_FILE)
    meta = AtomicCheckpointIO().load_checkpoint(meta_file, weights_only=weights_only)
    info = meta.pop(common.FORMAT_KEY, None)
    if not isinstance(info, Mapping) or info.get("format") != "local":
        raise CheckpointLoadError(
            f"{meta_file!r} does not describe a local checkpoint (no 'lightning_fsdp' entry with format 'local').",
            meta_file,
        )
    if info.get("version") != common.FORMAT_VERSION:
        raise CheckpointLoadError(
            f"Local checkpoint {path!r} has format version {info.get('version')}, this release reads version "
            f"{common.FORMAT_VERSION}.",
            meta_file,
        )
    return meta, dict(info)


def _read_rank_file(
    path: str, rank: int, world_size: int, weights_only: bool | None, load: RankFileLoader | None = None
) -> Checkpoint:
    """``rank``'s file, read by ``load(file, weights_only=...)`` (by default whole, by ``AtomicCheckpointIO``);
    raises unless it holds the shards of ``rank`` of ``world_size``."""
    file = os.path.join(path, local_rank_file(rank))
    problem = file_problem(file)
    if problem is not None:
        raise CheckpointLoadError(f"Local checkpoint {path!r} is damaged: {problem}; rank {rank} needs it.", file)
    data = (load or AtomicCheckpointIO().load_checkpoint)(file, weights_only=weights_only)
    got = (data.get("rank"), data.get("world_size")) if isinstance(data, Mapping) else (None, None)
    if got != (rank, world_size):
        raise CheckpointLoadError(
            f"{file!r} holds the shards of rank {got[0]} of {got[1]}, not of rank {rank} of {world_size}; the "
            "checkpoint directory was assembled from different saves.",
            file,
        )
    return data


def _tensor_parallel_size(engine: ShardingEngine) -> int:
    specs = [s.tensor_parallel for u in engine.units for s in u.slots if s.tensor_parallel is not None]
    return specs[0].mesh.size() if specs else 1


def _check_layout(
    path: str, info: Mapping[str, Any], engine: ShardingEngine, coll: Collective, optimizers: Sequence[Optimizer] | None
) -> tuple[str, ...]:
    """Raise :class:`CheckpointMismatchError` naming the first difference from this run's layout (and
    ``optimizers``); returns the checkpoint keys the model lacks."""
    if info["world_size"] != coll.world_size:
        raise CheckpointMismatchError(
            f"Local checkpoint {path!r} was written by {info['world_size']} ranks, this run has {coll.world_size}. A "
            "local checkpoint loads only at the world size that wrote it; convert it with `lightning-fsdp convert "
            "SRC DST` (a full file loads at any world size) or save with state_dict_type='sharded'."
        )
    entries: Mapping[str, Any] = info["entries"]
    here = layout_info(engine, optimizers, coll.world_size)
    stored_tp = info.get("tensor_parallel_size", 1)
    if stored_tp != here["tensor_parallel_size"]:
        raise CheckpointMismatchError(
            f"Local checkpoint {path!r} was written with tensor_parallel_size={stored_tp}, this run has "
            f"tensor_parallel_size={here['tensor_parallel_size']}. A local checkpoint holds each rank's pieces and "
            "loads only in the layout that wrote it; save with state_dict_type='sharded' (it loads at any layout)."
        )
    params = {name for name, _ in engine.root.named_parameters(remove_duplicate=False)}
    for key, now in here["entries"].items():
        entry = entries.get(key)
        if entry is None:
            continue
        what = "parameter" if key in params else "entry"
        stored = tuple(entry["shape"]) if entry["shape"] is not None else None
        if now["shape"] != stored:
            raise CheckpointMismatchError(
                f"Local checkpoint {path!r}: {what} {key!r} has shape {_shape(stored)} in the checkpoint but "
                f"{_shape(now['shape'])} in the model."
            )
        rows_stored = [tuple(r) for r in entry["rows"]] if entry["rows"] is not None else None
        if now["rows"] != rows_stored:
            raise CheckpointMismatchError(
                f"Local checkpoint {path!r}: {what} {key!r} is split into rows {rows_stored} across ranks in the "
                f"checkpoint but {now['rows']} in this run (another sharding strategy or process group?). A local "
                "checkpoint needs the same shard layout; use a sharded or full checkpoint to change it."
            )
    if optimizers is not None:
        _check_optimizers(path, info.get("optimizers") or [], here["optimizers"] or [])
    return tuple(k for k in entries if k not in here["entries"])


def _shape(shape: tuple[int, ...] | None) -> str:
    return common.shape_str(shape) if shape is not None else "None (not a tensor)"


def _check_optimizers(path: str, stored: Sequence[Sequence[Sequence[str]]], here: list[list[list[str]]]) -> None:
    common.check_optimizer_count(f"Local checkpoint {path!r}", len(stored), len(here))
    for index, (groups, now) in enumerate(zip(stored, here)):
        what = f"Local checkpoint {path!r}: optimizer {index}"
        common.check_group_sizes(what, [len(g) for g in groups], [len(g) for g in now])
        common.check_param_names(what, [n for g in groups for n in g], [n for g in now for n in g])


def load_local_checkpoint(
    path: str, run: CheckpointRun, *, coll: Collective | None = None, weights_only: bool | None = None
) -> Checkpoint:
    """Read this rank's file of a local checkpoint on every rank, as :func:`sharded.load_sharded_checkpoint` does.
    Mismatches and damaged files raise on every rank."""
    engine, optimizers = run.engine, run.optimizers
    assert engine is not None
    coll = coll or Collective()

    def read() -> Checkpoint:
        meta, info = read_local_meta(path, weights_only)
        load_optimizers = optimizers is not None and info.get("optimizers") is not None
        unexpected = _check_layout(path, info, engine, coll, optimizers if load_optimizers else None)
        data = _read_rank_file(path, coll.rank, coll.world_size, weights_only)
        own = engine.root.state_dict()
        checkpoint = dict(meta)
        checkpoint["state_dict"] = common.ShardedStateDict(
            {k: v for k, v in data["state_dict"].items() if k in own}, unexpected_keys=unexpected, source=path
        )
        if load_optimizers:
            checkpoint["optimizer_states"] = [ShardedOptimizerState(s) for s in data["optimizer_states"]]
        return checkpoint

    return coll.run_agreed(read)


def unsplit_shape(entry: Mapping[str, Any]) -> tuple[int, ...]:
    """The full shape of a tensor entry of ``meta.pt``: a tensor-parallel parameter's unsplit shape, not its piece's."""
    split = entry.get("tensor_parallel")
    return tuple(int(s) for s in (split["shape"] if split is not None else entry["shape"]))


def concat_rows(pieces: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    row_numel = common.numel(shape[1:]) if len(shape) > 1 else 1
    return torch.cat([p.reshape(-1, row_numel) for p in pieces], dim=0).reshape(shape)


class RankFiles:
    """Every rank's file of a local checkpoint, read in this process alone (each by ``load``, as for
    :func:`_read_rank_file`), and the full value of each entry assembled from them."""

    def __init__(self, path: str, weights_only: bool | None, load: RankFileLoader | None = None) -> None:
        self.meta, info = read_local_meta(path, weights_only)
        self.entries: Mapping[str, Any] = info["entries"]
        self.optimizers = info.get("optimizers")
        world = info["world_size"]
        self.tensor_parallel_size = int(info.get("tensor_parallel_size", 1))
        self.files = [_read_rank_file(path, r, world, weights_only, load) for r in range(world)]
        # (TP rank, shard rank) -> the first global rank holding its rows (with a subgroup as shard group, or
        # under HYBRID_SHARD, groups repeat)
        self.holders: dict[tuple[int, int], int] = {}
        for rank, data in enumerate(self.files):
            self.holders.setdefault((int(data.get("tensor_parallel_rank", 0)), int(data.get("shard_rank", rank))), rank)

    def holding(self, entry: Mapping[str, Any], tensor_parallel_rank: int = 0) -> list[Checkpoint]:
        """The file holding each shard rank's rows of an entry split as its ``meta.pt`` ``entry`` records (of the
        TP piece of ``tensor_parallel_rank``, for a tensor-parallel parameter)."""
        return [self.files[self.holders[tensor_parallel_rank, r]] for r in range(len(entry["rows"]))]

    def full(self, key: str) -> Any:
        """``key``'s full value in the model's state dict (a tensor, or whatever else the files hold)."""
        entry = self.entries[key]
        if entry["rows"] is None:
            return self.files[0]["state_dict"][key]
        return self.assemble(entry, lambda data: data["state_dict"][key])

    def assemble(self, entry: Mapping[str, Any], value_of: Callable[[Checkpoint], torch.Tensor]) -> torch.Tensor:
        """The unsplit tensor of a split ``entry`` from each file's rows, ``value_of(file)``: the shard ranks' rows
        joined, then, for a tensor-parallel parameter, the TP pieces joined on their dim (``torch.chunk``'s sizes, as
        DTensor's ``Shard`` splits)."""
        split = entry.get("tensor_parallel")
        if split is None or split["dim"] is None:  # not split by TP, or the same on every TP rank
            return concat_rows([value_of(d) for d in self.holding(entry)], tuple(int(s) for s in entry["shape"]))
        shape, dim, size = tuple(split["shape"]), split["dim"], self.tensor_parallel_size
        chunk = -(-shape[dim] // size)
        pieces = []
        for t in range(size):
            piece_shape = (*shape[:dim], max(0, min(shape[dim], (t + 1) * chunk) - t * chunk), *shape[dim + 1 :])
            pieces.append(concat_rows([value_of(d) for d in self.holding(entry, t)], piece_shape))
        return torch.cat(pieces, dim=dim)


def read_local_checkpoint_full(path: str, weights_only: bool | None = None) -> Checkpoint:
    """A local checkpoint directory as one full checkpoint, assembled from every rank's file in this process alone."""
    files = RankFiles(path, weights_only)
    checkpoint = dict(files.meta)
    checkpoint["state_dict"] = {key: files.full(key) for key in files.entries}
    if files.optimizers is not None:
        optimizer_states = []
        for index, groups in enumerate(files.optimizers):
            names = [n for g in groups for n in g]
            first = files.files[0]["optimizer_states"][index]
            full_state: dict[int, StateDict] = {}
            for position, name in enumerate(names):
                entry = files.entries.get(name)
                if position not in first["state"]:
                    continue
                new_entry = {}
                for key, value in first["state"][position].items():
                    rows = entry["rows"] if entry is not None else None
                    if entry is not None and "tensor_parallel" in entry and isinstance(value, torch.Tensor):
                        # a state tensor of the parameter's shape on every rank (momentum, moments): joined as it is
                        if value.shape == files.files[0]["state_dict"][name].shape:
                            value = files.assemble(entry, partial(_state_tensor, index, position, key))
                    elif entry is not None and rows is not None and isinstance(value, torch.Tensor) and value.dim() > 0:
                        pieces = [d["optimizer_states"][index]["state"][position][key] for d in files.holding(entry)]
                        local_rows = [end - start for start, end in rows]
                        if [p.shape[0] for p in pieces] == local_rows:
                            value = concat_rows(pieces, tuple(entry["shape"]))
                    new_entry[key] = value
                full_state[position] = new_entry
            optimizer_states.append({"state": full_state, "param_groups": first["param_groups"]})
        checkpoint["optimizer_states"] = optimizer_states
    return checkpoint


def _state_tensor(index: int, position: int, key: str, data: Checkpoint) -> torch.Tensor:
    """One rank file's optimizer state tensor ``key`` of parameter ``position`` in optimizer ``index``."""
    return data["optimizer_states"][index]["state"][position][key]


class LocalFormat(common.DirectoryFormat):
    """Not a target of ``convert``: its layout is a running engine's, which an offline conversion does not have."""

    kind = LOCAL

    model_state_dict = staticmethod(local_model_state_dict)

    def optimizer_state(self, engine: ShardingEngine, optimizer: Optimizer) -> StateDict:
        return local_optimizer_state_dict(optimizer)

    def write(self, checkpoint: Checkpoint, path: _PATH, run: CheckpointRun) -> None:
        self.prepare_save(checkpoint, path, run)()

    def prepare_save(
        self, checkpoint: Checkpoint, path: _PATH, run: CheckpointRun, storage_options: object = None
    ) -> Callable[[], None]:
        super().prepare_save(checkpoint, path, run, storage_options)  # its checks
        # meta.pt names each optimizer's parameters only when the checkpoint holds their state (not weights-only).
        optimizers = run.optimizers if "optimizer_states" in checkpoint else None
        assert run.engine is not None  # DirectoryFormat.prepare_save checked it
        layout = layout_info(run.engine, optimizers, Collective().world_size)
        return partial(save_local_checkpoint, checkpoint, path, run.engine, optimizers, layout=layout)

    read = staticmethod(load_local_checkpoint)
    read_as_full = staticmethod(read_local_checkpoint_full)
