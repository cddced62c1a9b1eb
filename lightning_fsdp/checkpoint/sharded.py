"""Sharded checkpoints: DCP files plus ``meta.pt``, the layout of Lightning's own ``state_dict_type="sharded"``
(so its ``consolidate_checkpoint`` reads them), loadable at any world size. Layout: docs/checkpoints.md."""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim import Optimizer

from lightning_fsdp.checkpoint import Checkpoint, StateDict, common
from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO
from lightning_fsdp.checkpoint.common import (
    FORMAT_KEY,
    CheckpointMismatchError,
    CheckpointRun,
    ShardedOptimizerState,
    ShardedStateDict,
    is_sharded,
    is_slot_rows,
    managed_keys,
    shape_str,
)
from lightning_fsdp.checkpoint.dcp_writing import with_exact_storages, without_crc32
from lightning_fsdp.checkpoint.paths import META_FILE, SHARDED
from lightning_fsdp.checkpoint.safe_load import alone_on_purpose, check_shard_files, dcp_load, read_dcp_metadata
from lightning_fsdp.collective import Collective
from lightning_fsdp.engine import ShardingEngine
from lightning_fsdp.engine.comm import gather_rows
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.records import ParamSlot
from lightning_fsdp.engine.tensor_parallel import TensorParallelSpec

if TYPE_CHECKING:
    from lightning.fabric.utilities.types import _PATH

    from lightning_fsdp.pipeline.checkpoint import PipelineCheckpoint

# Where an entry sits in the saved nested dict (its keys and list indices, as DCP's planner recorded them, which
# torch types as Any), and DCP's description of it.
_EntryPath = tuple[Any, ...]
_Entry = tuple[_EntryPath, STORAGE_TYPES]

_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)")
_SCALAR_ROWS = "lightning_fsdp_scalar_rows"


# Each engine's shard group as a DeviceMesh, by device type: built once, released with the engine.
_MESHES: weakref.WeakKeyDictionary[ShardingEngine, dict[str, DeviceMesh]] = weakref.WeakKeyDictionary()


def _mesh(engine: ShardingEngine, device_type: str) -> DeviceMesh:
    meshes = _MESHES.setdefault(engine, {})
    if device_type not in meshes:
        group = engine.shard_comm.group if engine.shard_comm.group is not None else dist.group.WORLD
        assert group is not None  # sharded tensors exist only inside a process group
        meshes[device_type] = DeviceMesh.from_group(group, device_type)
    return meshes[device_type]


def _dtensor(local: torch.Tensor, layout: ShardLayout, mesh: DeviceMesh) -> DTensor:
    shape = torch.Size(layout.shape)
    stride = torch.empty(shape, device="meta").stride()  # contiguous
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def to_global_tensor(local: torch.Tensor, layout: ShardLayout, engine: ShardingEngine) -> torch.Tensor:
    """This rank's rows as a global tensor for DCP: a DTensor, the tensor itself (unsharded), or for a 0-dim
    parameter (one row, which cannot be a Shard(0) DTensor) the value, gathered over the shard group if sharded."""
    if len(layout.shape) == 0:
        if is_sharded(layout):
            return gather_rows(local.detach(), layout, engine.shard_comm).cpu()
        return local.detach().reshape(())
    if not is_sharded(layout):
        return local
    return _dtensor(local.detach(), layout, _mesh(engine, local.device.type))


def _tp_mesh(engine: ShardingEngine, spec: TensorParallelSpec, device_type: str) -> DeviceMesh:
    """The (data-parallel, tensor-parallel) mesh of a DTensor parameter's shards: this rank's shard group and TP
    group, every rank of the one placed as the layout places them ([Note: the layout of the ranks])."""
    meshes = _MESHES.setdefault(engine, {})
    key = f"{device_type}/tensor_parallel"
    if key not in meshes:
        dp = engine.shard_comm.group if engine.shard_comm.group is not None else dist.group.WORLD
        assert dp is not None
        dp_ranks, tp_ranks = dist.get_process_group_ranks(dp), dist.get_process_group_ranks(spec.group)
        me = dist.get_rank()
        grid = torch.tensor([[r + t - me for t in tp_ranks] for r in dp_ranks])
        meshes[key] = DeviceMesh.from_group([dp, spec.group], device_type, mesh=grid, mesh_dim_names=("dp", "tp"))
    return meshes[key]


def _global_shape(slot: ParamSlot) -> tuple[int, ...]:
    return tuple(slot.unsplit_shape)


def _slot_global_tensor(local: torch.Tensor, slot: ParamSlot, engine: ShardingEngine) -> torch.Tensor:
    """This rank's rows of a managed parameter (or of its per-element state) as a global tensor for DCP, in the
    unsplit model's name and shape. A DTensor parameter's rows are a DTensor on the (data, tensor) mesh: the
    data-parallel row split of a TP piece is ``Shard(0)`` of the global tensor, or, when TP splits rows too,
    ``_StridedShard(0, split_factor=T)`` (the TP pieces are split first), as torch's FSDP2 records it."""
    spec = slot.tensor_parallel
    if spec is None:
        return to_global_tensor(local, slot.layout, engine)
    local = local.detach()
    shape, stride = spec.shape, spec.stride
    if not is_sharded(slot.layout):
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=shape, stride=stride)
    (tp_place,) = spec.placements
    splits_rows = isinstance(tp_place, Shard) and tp_place.dim == 0
    dp_place = _StridedShard(0, split_factor=spec.mesh.size()) if splits_rows else Shard(0)
    mesh = _tp_mesh(engine, spec, local.device.type)
    return DTensor.from_local(local, mesh, [dp_place, tp_place], run_check=False, shape=shape, stride=stride)


@torch.no_grad()
def sharded_model_state_dict(engine: ShardingEngine) -> StateDict:
    """The model's state dict, sharded parameters as DTensors of this rank's rows (no copies)."""
    managed = managed_keys(engine)  # first: it puts the user's parameters back where a forward left stand-ins
    state = engine.root.state_dict()
    for key, slot in managed.items():
        if key in state:
            state[key] = _slot_global_tensor(engine.shard_of(slot), slot, engine)
    return state


@torch.no_grad()
def sharded_optimizer_state_dict(
    engine: ShardingEngine, optimizer: Optimizer, *, unsplit_groups: Sequence[Sequence[str]] | None = None
) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name, state shaped like a shard as DTensors.
    ``unsplit_groups`` (pipeline parallelism, a collective then): the unsplit optimizer's param groups by name, so
    that the checkpoint describes every stage's parameters."""
    state_dict = optimizer.state_dict()
    names = common.engine_param_names(engine)
    params = common.optimizer_params(optimizer)
    fqns = [names.get(id(p), f"<unnamed parameter {i}>") for i, p in enumerate(params)]
    state: dict[str, StateDict] = {}
    scalar_rows: dict[str, list[str]] = {}
    for index, param in enumerate(params):
        entry = state_dict["state"].get(index)
        if entry is None:
            continue
        slot = engine.slot_of(param)
        new_entry: StateDict = {}
        for name in sorted(entry):  # the same order on every rank: 0-dim parameters gather
            value = entry[name]
            if slot is not None and is_slot_rows(value, slot):
                value = _slot_global_tensor(value, slot, engine)
                if len(slot.layout.shape) == 0:
                    scalar_rows.setdefault(fqns[index], []).append(name)
            new_entry[name] = value
        state[fqns[index]] = new_entry
    groups = [{**group, "params": [fqns[i] for i in group["params"]]} for group in state_dict["param_groups"]]
    if unsplit_groups is not None:
        groups = [{**group, "params": list(unsplit)} for group, unsplit in zip(groups, unsplit_groups)]
        # meta.pt is rank 0's: it must record every stage's 0-dim parameters.
        for rows in Collective().all_gather(scalar_rows):
            for fqn, entries in rows.items():
                scalar_rows.setdefault(fqn, entries)
    out: StateDict = {"state": state, "param_groups": groups}
    if scalar_rows:
        # A 0-dim parameter's per-element state (exp_avg) and its step counter both save as 0-dim tensors; loading
        # needs to know which is which to give this rank its row of the former. Kept in meta.pt, not in DCP.
        out[_SCALAR_ROWS] = scalar_rows
    return out


def _write(
    checkpoint: Mapping[str, Any],
    path: _PATH,
    coll: Collective,
    keys: str,
    pipeline: PipelineCheckpoint | None = None,
) -> None:
    """The DCP files (every rank its rows) and ``meta.pt`` (rank 0), committed atomically; ``keys``: how the
    optimizer state is keyed (``"fqn"``, or ``"index"`` converted from a full checkpoint)."""
    meta = dict(checkpoint)
    tensors: StateDict = {"model": meta.pop("state_dict", {})}
    optimizer_states = meta.pop("optimizer_states", None)
    scalar_rows: list[
        dict[str, list[str]]
    ] = []  # per optimizer, its 0-dim row-state names (kept in meta.pt, not in DCP)
    for index, state in enumerate(optimizer_states or []):
        state = dict(state)
        scalar_rows.append(state.pop(_SCALAR_ROWS, {}))
        tensors[f"optimizer_{index}"] = state
    info: dict[str, object] = {
        "format": "sharded",
        "version": common.FORMAT_VERSION,
        "world_size": coll.world_size,
        "num_optimizers": len(optimizer_states) if optimizer_states is not None else None,
        "optimizer_keys": keys,
    }
    if any(scalar_rows):
        info["scalar_param_rows"] = scalar_rows
    if pipeline is not None:  # written under pipeline parallelism: the stages, and the unsplit model's key order
        info["pipeline"] = pipeline.describe()
    meta[FORMAT_KEY] = info

    # Shards are views into their unit's flat buffer, which DCP's writer would clone (dcp_writing.py).
    tensors = with_exact_storages(tensors)

    def write_part(tmp: str) -> None:
        # A failure on any rank raises a CheckpointException on every rank (DCP gathers the results). No CRC-32 of
        # the records: no reader checks it (dcp_writing.py).
        with alone_on_purpose(coll), without_crc32():
            dcp.save(tensors, checkpoint_id=tmp, process_group=coll.group, no_dist=not coll.distributed)

    common.write_directory(path, SHARDED, write_part, lambda: meta, coll)


def save_sharded_checkpoint(
    checkpoint: Mapping[str, Any],
    path: _PATH,
    coll: Collective | None = None,
    pipeline: PipelineCheckpoint | None = None,
) -> None:
    """Write a checkpoint of :func:`sharded_model_state_dict` / :func:`sharded_optimizer_state_dict` to ``path``,
    atomically, on every rank; ``pipeline``: the run's ``PipelineCheckpoint``, recorded in ``meta.pt``."""
    _write(checkpoint, path, coll or Collective(), "fqn", pipeline)


def save_sharded_from_full(checkpoint: Mapping[str, Any], path: str) -> None:
    """Write a full checkpoint as a sharded directory, in this process alone. A full checkpoint's optimizer state
    has no parameter names, so it is keyed by position, which loading maps in order, as ``torch.optim`` does."""
    checkpoint = dict(checkpoint)
    optimizer_states = checkpoint.get("optimizer_states")
    if optimizer_states is not None:
        converted = []
        for state in optimizer_states:
            state = common.to_index_keyed(state)
            converted.append(
                {
                    "state": {str(k): v for k, v in state["state"].items()},
                    "param_groups": [{**g, "params": [str(p) for p in g["params"]]} for g in state["param_groups"]],
                }
            )
        checkpoint["optimizer_states"] = converted
    _write(checkpoint, path, Collective(alone=True), "index")


def _read_directory(path: str, weights_only: bool | None) -> tuple[Metadata, Checkpoint, dict[str, Any]]:
    """(DCP metadata, its shard files checked; ``meta.pt``; ``meta.pt``'s ``"lightning_fsdp"`` entry, popped)."""
    metadata = read_dcp_metadata(path, weights_only)
    check_shard_files(path, metadata)
    meta = AtomicCheckpointIO().load_checkpoint(os.path.join(path, META_FILE), weights_only=weights_only)
    return metadata, meta, meta.pop(FORMAT_KEY, None) or {}


def dcp_entries(metadata: Metadata, saved_order: bool = False) -> dict[str, _Entry]:
    """flat key -> (path in the saved nested dict, storage metadata); ``saved_order``: in the saved dict's order
    (DCP's save planner records it), else the metadata's."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    order = {flat: i for i, flat in enumerate(paths)} if saved_order else {}
    out = {}
    for key in sorted(metadata.state_dict_metadata, key=lambda f: order.get(f, len(order))):
        path = paths.get(key)
        if path is None:
            head, _, tail = key.partition(".")
            path = (head, tail) if tail else (head,)
        out[key] = (tuple(path), metadata.state_dict_metadata[key])
    return out


def _set(container: Any, path: _EntryPath, value: object) -> None:
    """Set ``value`` at ``path`` in nested dicts/lists, creating them (lists for int keys) on the way."""
    for i, key in enumerate(path):
        if isinstance(container, list):
            container.extend([None] * (key + 1 - len(container)))
        if i == len(path) - 1:
            container[key] = value
            return
        missing = container[key] is None if isinstance(container, list) else key not in container
        if missing:
            container[key] = [] if isinstance(path[i + 1], int) else {}
        container = container[key]


# [Note: a sharded load reads in place]
# DCP reads each saved chunk into a tensor of its own (one entry's rows of one file: the staging) and copies the
# rows this rank holds into the target. The targets are the live shards and the optimizer's state tensors where
# they exist on the host with the entry's dtype and shape, so a load holds no second copy of the model state (a
# resumed run's optimizer has no state yet: its targets are new tensors of this rank's rows, which
# ``Optimizer.load_state_dict`` then keeps without copying). The model's values change while the files are read,
# before the key check of ``load_model_state_dict``; a load that fails part-way leaves them partly loaded (as DCP's
# in-place load of FSDP2 does): the run stops with the error either way.
class _ShardedLoad:
    """Plans and performs the load of a sharded directory into a sharded module and its optimizers."""

    def __init__(
        self,
        path: str,
        engine: ShardingEngine,
        optimizers: Sequence[Optimizer] | None,
        coll: Collective,
        weights_only: bool | None,
        pipeline: PipelineCheckpoint | None = None,
    ) -> None:
        self.path = path
        self.engine = engine
        self.coll = coll
        # Under pipeline parallelism (a PipelineCheckpoint): the other stages' keys, the unsplit optimizers' groups.
        self.pipeline = pipeline
        self.weights_only = weights_only  # False: the caller trusts the files (see safe_load)
        self.metadata, self.meta, self.info = _read_directory(path, weights_only)
        self.entries = dcp_entries(self.metadata)
        self.optimizer_prefixes = sorted(
            {p[0] for p, _ in self.entries.values() if _OPTIMIZER_KEY.fullmatch(str(p[0]))},
            key=lambda s: int(s.split("_")[1]),
        )
        self.optimizers = list(optimizers) if optimizers is not None and self.optimizer_prefixes else None
        if self.optimizers is not None:
            common.check_optimizer_count(
                f"Sharded checkpoint {path!r}", len(self.optimizer_prefixes), len(self.optimizers)
            )
        self._plan_model()

    def _target(
        self,
        full_shape: tuple[int, ...],
        dtype: torch.dtype,
        slot: ParamSlot | None,
        live: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Where DCP reads an entry into: ``live`` (the shard or optimizer state tensor that will hold it, read in
        place, as DCP loads FSDP2's) where it is a host tensor of the entry's dtype and of this rank's shape, else a
        new tensor of this rank's rows (one shard's worth: see [Note: a sharded load reads in place])."""
        layout = slot.layout if slot is not None else None
        sharded = layout is not None and is_sharded(layout) and len(full_shape) > 0
        rows = slot is not None and (sharded or slot.tensor_parallel is not None)
        here = tuple(slot.layout.local_shape) if slot is not None and rows else full_shape
        if live is None or live.device.type != "cpu" or live.dtype != dtype or tuple(live.shape) != here:
            live = torch.zeros(here, dtype=dtype)
        else:
            live = live.detach()
        if slot is not None and slot.tensor_parallel is not None:  # this rank's rows of the unsplit tensor
            return _slot_global_tensor(live, slot, self.engine)
        if sharded:
            assert layout is not None
            return _dtensor(live, layout, _mesh(self.engine, "cpu"))
        return live

    def _plan_model(self) -> None:
        module = self.engine.root
        own = module.state_dict()
        managed = managed_keys(self.engine)
        param_keys = {name for name, _ in module.named_parameters(remove_duplicate=False)}
        stored = {p[1]: key for key, (p, _) in self.entries.items() if p[0] == "model" and len(p) == 2}
        self.model_keys: dict[str, str] = {}  # model key -> flat key
        self.tensor_targets: dict[str, torch.Tensor] = {}
        self.bytes_targets: dict[str, object] = {}
        self.layouts: dict[str, ShardLayout] = {}
        for key, value in own.items():
            flat = stored.get(key)
            if flat is None:
                continue
            storage = self.metadata.state_dict_metadata[flat]
            slot = managed.get(key)
            what = "parameter" if key in param_keys else "entry"
            if isinstance(storage, BytesStorageMetadata):
                if isinstance(value, torch.Tensor):
                    raise CheckpointMismatchError(
                        f"Sharded checkpoint {self.path!r}: {what} {key!r} is a tensor in the model but not in the "
                        "checkpoint; it is a checkpoint of another model."
                    )
                self.bytes_targets[flat] = None
                self.model_keys[key] = flat
                continue
            expected = _global_shape(slot) if slot is not None else tuple(value.shape)
            if not isinstance(value, torch.Tensor) or tuple(storage.size) != expected:
                here = shape_str(expected) if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
                raise CheckpointMismatchError(
                    f"Sharded checkpoint {self.path!r}: {what} {key!r} has shape {shape_str(storage.size)} in the "
                    f"checkpoint but {here} in the model; it is a checkpoint of another model."
                )
            layout = slot.layout if slot is not None else None
            live = self.engine.shard_of(slot) if slot is not None and not self.engine.closed else None
            self.tensor_targets[flat] = self._target(expected, storage.properties.dtype, slot, live)
            if layout is not None:
                self.layouts[flat] = layout
            self.model_keys[key] = flat
        # A key of another pipeline stage is the unsplit model's, not unexpected: that stage's ranks load it.
        others = self.pipeline.model_key_set if self.pipeline is not None else ()
        self.unexpected = tuple(k for k in stored if k not in own and k not in others)

    def _groups(self, prefix: str) -> list[dict[str, Any]]:
        groups: dict[str, Any] = {}
        for flat, (p, _) in self.entries.items():
            if p[0] == prefix and len(p) > 2 and p[1] == "param_groups":
                _set(groups, ("g",) + tuple(p[2:]), self.loaded_bytes[flat])
        return groups.get("g", [])

    def _plan_optimizers(self) -> None:
        self.optimizer_plans = []
        if self.optimizers is None:
            return
        names = common.engine_param_names(self.engine)
        for index, (prefix, optimizer) in enumerate(zip(self.optimizer_prefixes, self.optimizers)):
            groups = self._groups(prefix)
            here = optimizer.param_groups
            sizes = [len(g.get("params", [])) for g in groups]
            here_sizes = [len(g["params"]) for g in here]
            params = common.optimizer_params(optimizer)
            # The optimizer the checkpoint is compared with: this run's, or under pipeline parallelism the unsplit
            # one (every stage's parameters; see lightning_fsdp/pipeline/checkpoint.py), of which this rank holds
            # the positions mapping.local.
            mapping = self.pipeline.optimizers[index] if self.pipeline is not None else None
            expected_sizes = mapping.sizes if mapping is not None else here_sizes
            expected_names = mapping.names if mapping is not None else [names.get(id(p)) for p in params]
            what, over = f"Sharded checkpoint {self.path!r}: optimizer {index}", " over all pipeline stages"
            common.check_group_sizes(what, sizes, expected_sizes, over if mapping is not None else "")
            saved_ids = [str(p) for g in groups for p in g["params"]]
            keyed = self.info.get("optimizer_keys")
            if keyed is None:  # not written by this project: names if they are this model's names
                keyed = "fqn" if all(pid in expected_names for pid in saved_ids) else "index"
            if keyed == "fqn":
                common.check_param_names(what, saved_ids, expected_names)
            if mapping is None:
                position_of = {saved: i for i, saved in enumerate(saved_ids)}
            else:  # saved position (the unsplit index) -> this rank's position; other stages' entries are skipped
                local_of = {unsplit: i for i, unsplit in enumerate(mapping.local)}
                position_of = {saved: local_of[u] for u, saved in enumerate(saved_ids) if u in local_of}
            recorded = (self.info.get("scalar_param_rows") or [{}] * len(self.optimizer_prefixes))[index]
            state_targets: dict[str, tuple[int, tuple, str]] = {}  # flat -> (param index, path under the entry)
            for flat, (p, storage) in self.entries.items():
                if p[0] != prefix or len(p) < 4 or p[1] != "state":
                    continue
                position = position_of.get(str(p[2]))
                if position is None:
                    continue
                param = params[position]
                slot = self.engine.slot_of(param)
                layout = slot.layout if slot is not None else None
                if isinstance(storage, BytesStorageMetadata):
                    state_targets[flat] = (position, tuple(p[3:]), "bytes")
                    continue
                full = tuple(storage.size)
                rows = slot is not None and len(p) == 4 and full == _global_shape(slot)
                if rows and len(full) == 0:
                    # A 0-dim parameter: which 0-dim entries are per-element state was recorded at save time;
                    # without a record (a converted full file), every entry but a step counter is.
                    row_names = recorded.get(str(p[2])) if recorded else None
                    rows = p[3] in row_names if row_names is not None else p[3] != "step"
                live = optimizer.state.get(param, {}).get(p[3]) if rows and len(p) == 4 else None
                target_slot = slot if rows else None
                self.tensor_targets[flat] = self._target(full, storage.properties.dtype, target_slot, live)
                if rows and layout is not None:
                    self.layouts[flat] = layout
                state_targets[flat] = (position, tuple(p[3:]), "tensor")
            self.optimizer_plans.append((groups, state_targets, here_sizes))

    def _local(self, flat: str, value: object) -> object:
        """This rank's rows of a loaded target (DTensor -> its local tensor; a 0-dim parameter -> its row)."""
        if isinstance(value, DTensor):
            return value.to_local()
        layout = self.layouts.get(flat)
        if layout is not None and isinstance(value, torch.Tensor):
            return layout.local_slice(value)
        return value

    def run(self) -> Checkpoint:
        """Load (two rounds of DCP reads: the small non-tensor entries, then the tensors) and build the dict."""
        # Round 1: all non-tensor entries of the model and the optimizers (param_groups, hyper-parameters).
        bytes_keys = dict(self.bytes_targets)
        for flat, (p, storage) in self.entries.items() if self.optimizers is not None else ():
            if p[0] not in self.optimizer_prefixes:
                continue
            if isinstance(storage, BytesStorageMetadata):
                bytes_keys[flat] = None
            elif p[1] == "param_groups" and isinstance(storage, TensorStorageMetadata):  # a tensor lr
                bytes_keys[flat] = torch.zeros(tuple(storage.size), dtype=storage.properties.dtype)
        dcp_load(bytes_keys, self.path, self.coll, self.weights_only)
        self.loaded_bytes = bytes_keys
        self._plan_optimizers()  # raises the same mismatch on every rank: all read the same entries
        # Round 2: the tensors, each rank reading the rows it holds under the current layout.
        dcp_load(self.tensor_targets, self.path, self.coll, self.weights_only)
        self.loaded = {**self.tensor_targets, **self.loaded_bytes}
        state = ShardedStateDict(
            {key: self._local(flat, self.loaded[flat]) for key, flat in self.model_keys.items()},
            unexpected_keys=self.unexpected,
            source=self.path,
        )
        checkpoint = dict(self.meta)
        checkpoint["state_dict"] = state
        if self.optimizers is not None:
            checkpoint["optimizer_states"] = [self._optimizer_state(*plan) for plan in self.optimizer_plans]
        return checkpoint

    def _optimizer_state(
        self, groups: list[dict[str, Any]], state_targets: dict[str, tuple[int, _EntryPath, str]], sizes: list[int]
    ) -> ShardedOptimizerState:
        state: dict[int, dict[str, object]] = {}
        for flat, (position, sub, _kind) in state_targets.items():
            entry = state.setdefault(position, {})
            _set(entry, sub, self._local(flat, self.loaded[flat]))
        # This run's group sizes (fewer under pipeline parallelism).
        return ShardedOptimizerState({"state": state, "param_groups": common.numbered_groups(groups, sizes)})


def load_sharded_checkpoint(
    path: str, run: CheckpointRun, *, coll: Collective | None = None, weights_only: bool | None = None
) -> Checkpoint:
    """Read a sharded directory on every rank into a checkpoint dict holding this rank's rows under the current
    layout (``ShardedStateDict``, and ``ShardedOptimizerState`` entries if ``run.optimizers`` is given)."""
    engine, optimizers = run.engine, run.optimizers
    assert engine is not None
    coll = coll or Collective()
    # Every rank checks the directory and plans its reads; a problem on one raises on all before any DCP collective.
    loader = coll.run_agreed(lambda: _ShardedLoad(path, engine, optimizers, coll, weights_only, run.pipeline))
    return loader.run()


def read_sharded_checkpoint_full(path: str, weights_only: bool | None = None) -> Checkpoint:
    """A sharded directory as one full checkpoint (plain ``torch.optim`` optimizer state), in this process alone."""
    # What torch's format_utils.dcp_to_torch_save reads (every entry whole), through the public dcp.load.
    metadata, meta, info = _read_directory(path, weights_only)
    entries = dcp_entries(metadata, saved_order=True)
    targets: dict[str, torch.Tensor | None] = {
        flat: torch.empty(tuple(storage.size), dtype=storage.properties.dtype)
        if isinstance(storage, TensorStorageMetadata)
        else None
        for flat, (_, storage) in entries.items()
    }
    dcp_load(targets, path, Collective(alone=True), weights_only)
    tensors: dict[str, Any] = {}
    for flat, (where, _) in entries.items():
        _set(tensors, where, targets[flat])
    checkpoint = dict(meta)
    checkpoint["state_dict"] = tensors.pop("model", {})
    unsplit = (info.get("pipeline") or {}).get("model_keys") if isinstance(info, Mapping) else None
    if unsplit:  # written by pipeline stages, whose keys DCP lists stage by stage: the unsplit model's order
        state = checkpoint["state_dict"]
        ordered = {k: state[k] for k in unsplit if k in state}
        checkpoint["state_dict"] = {**ordered, **{k: v for k, v in state.items() if k not in ordered}}
    prefixes = sorted((k for k in tensors if _OPTIMIZER_KEY.fullmatch(k)), key=lambda s: int(s.split("_")[1]))
    if prefixes:
        checkpoint["optimizer_states"] = [common.to_index_keyed(tensors.pop(k)) for k in prefixes]
    checkpoint.update(tensors)
    return checkpoint


class ShardedFormat(common.DirectoryFormat):
    kind = SHARDED
    writes_offline = True

    model_state_dict = staticmethod(sharded_model_state_dict)
    optimizer_state = staticmethod(sharded_optimizer_state_dict)

    def write(self, checkpoint: Checkpoint, path: _PATH, run: CheckpointRun) -> None:
        save_sharded_checkpoint(checkpoint, path, pipeline=run.pipeline)

    read = staticmethod(load_sharded_checkpoint)
    read_as_full = staticmethod(read_sharded_checkpoint_full)
    write_full = staticmethod(save_sharded_from_full)
