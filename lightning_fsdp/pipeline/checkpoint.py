"""Checkpoints of a pipelined model: whatever the (pipeline, data) layout, a checkpoint describes the unsplit model
(docs/pipeline.md, "Checkpoints across layouts").

[Note: checkpoints across pipeline layouts]
What each format does, and the rule for optimizer indices that every rank checks: the page above. A pipeline rank
holds only its stages' pieces, under the unsplit names; a key's place in the unsplit model is (its top-level child,
its piece, its place on its rank). The one thing a rank cannot write alone is the unsplit optimizer's param groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist
from torch.optim import Optimizer

from lightning_fsdp.checkpoint import StateDict
from lightning_fsdp.checkpoint.common import check_group_sizes, numbered_groups
from lightning_fsdp.checkpoint.full import full_model_state_dict, full_optimizer_state_dict
from lightning_fsdp.checkpoint.paths import FULL, LOCAL, SHARDED
from lightning_fsdp.checkpoint.sharded import sharded_model_state_dict, sharded_optimizer_state_dict
from lightning_fsdp.collective import Collective
from lightning_fsdp.engine import ShardingEngine

if TYPE_CHECKING:
    from lightning_fsdp.pipeline.runtime import PipelineLayout, PipelineRuntime

_T = TypeVar("_T")

__all__ = [
    "OptimizerMap",
    "PipelineCheckpoint",
    "check_pipeline_format",
    "pipeline_model_state_dict",
    "pipeline_optimizer_state",
    "unsplit_order",
]


def check_pipeline_format(kind: str) -> None:
    """Refuse the local format under pipeline parallelism (see [Note: checkpoints across pipeline layouts])."""
    if kind == LOCAL:
        raise ValueError(
            "state_dict_type='local' with pipeline_parallel_size > 1: a local checkpoint holds raw shards and loads "
            "only at the layout that wrote it, and its metadata describes one shard group, not the pipeline's "
            "stages. Use state_dict_type='sharded' (each rank writes its own rows too, and it loads under any "
            "pipeline and data-parallel size) or 'full'."
        )


def unsplit_order(
    lists: Sequence[Sequence[str]], children: Sequence[str], attribute: str, pieces: Sequence[str]
) -> list[str]:
    """The union of ``lists`` (each pipeline rank's keys or parameter names, in its own order) in the unsplit
    model's order: the LightningModule's own tensors, then its children in ``children`` order, the pipelined child
    ``attribute`` expanded piece by piece in ``pieces`` order (see [Note: checkpoints across pipeline layouts])."""
    child_index = {name: i for i, name in enumerate(children)}
    prefixes = [f"{attribute}.{piece}." for piece in pieces]
    place: dict[str, tuple[int, int, int]] = {}
    for names in lists:
        for position, name in enumerate(names):
            if name in place:
                continue
            head = name.split(".", 1)[0] if "." in name else None
            child = child_index.get(head, -1) if head is not None else -1
            piece = 0
            if head == attribute:
                piece = next((i for i, p in enumerate(prefixes) if name.startswith(p)), len(prefixes))
            place[name] = (child, piece, position)
    return sorted(place, key=place.__getitem__)


@dataclass(frozen=True)
class OptimizerMap:
    """One optimizer's unsplit param groups (parameter names) and where this rank's parameters sit in them."""

    groups: tuple[tuple[str, ...], ...]  # the unsplit optimizer's param groups, by parameter name
    local: tuple[int, ...]  # this rank's optimizer position -> the unsplit optimizer's index
    by_rank: tuple[tuple[int, ...], ...]  # the same for every pipeline rank (the merge on global rank 0 needs it)

    @property
    def sizes(self) -> list[int]:
        return [len(g) for g in self.groups]

    @property
    def names(self) -> list[str]:
        return [name for group in self.groups for name in group]


class PipelineCheckpoint:
    """What the checkpoint formats need to know about the other pipeline ranks: the unsplit model's state-dict keys
    in order, and an :class:`OptimizerMap` per optimizer. Built by :meth:`gather` (a collective: call on every rank)."""

    def __init__(
        self,
        layout: PipelineLayout,
        stages: Sequence[Sequence[str]],
        model_keys: list[str],
        local_keys: set[str],
        optimizers: list[OptimizerMap],
    ) -> None:
        self.layout = layout
        self.stages = [list(s) for s in stages]
        self.model_keys = model_keys
        self.model_key_set = set(model_keys)
        self.local_keys = local_keys
        self.optimizers = optimizers

    @classmethod
    def gather(
        cls, runtime: PipelineRuntime, engine: ShardingEngine, optimizers: Sequence[Optimizer] = ()
    ) -> PipelineCheckpoint:
        """Every rank's state-dict keys and optimizer parameter names, all-gathered; call on every rank."""
        layout = runtime.layout
        engine.reshard_idle()  # a forward whose backward never came leaves stand-ins: names are read past them
        module = engine.root
        keys = list(module.state_dict(keep_vars=True))
        names = {id(p): n for n, p in module.named_parameters()}
        parameters = list(names.values())
        groups = [[[names.get(id(p), "?") for p in g["params"]] for g in opt.param_groups] for opt in optimizers]
        settings = [[_settings(g) for g in opt.param_groups] for opt in optimizers]
        mine = (layout.pp_rank, keys, parameters, groups, settings)
        every = Collective().all_gather(mine)
        # One entry per pipeline rank: its data-parallel rank 0's (the stage's other ranks hold the same pieces).
        by_stage = {entry[0]: entry for entry in reversed(every)}
        ranks = [by_stage[p] for p in range(layout.size)]
        children = list(module._modules)
        attribute = runtime.options.module
        pieces = [piece for stage in runtime.stages for piece in stage]
        model_keys = unsplit_order([r[1] for r in ranks], children, attribute, pieces)
        parameter_order = unsplit_order([r[2] for r in ranks], children, attribute, pieces)
        maps = [
            _optimizer_map(index, [r[3][index] for r in ranks], [r[4][index] for r in ranks], parameter_order, layout)
            for index in range(len(optimizers))
        ]
        return cls(layout, runtime.stages, model_keys, set(keys), maps)

    def describe(self) -> dict[str, object]:
        """The ``"pipeline"`` entry of a sharded checkpoint's format info (read back by the offline readers)."""
        return {
            "size": self.layout.size,
            "data_size": self.layout.data_size,
            "stages": self.stages,
            "model_keys": list(self.model_keys),
        }

    def _to_global_rank0(self, obj: _T) -> list[_T] | None:
        """Every pipeline rank's ``obj`` (sent by its data-parallel rank 0) on global rank 0, in pipeline-rank
        order; ``None`` elsewhere. Call on every rank."""
        layout = self.layout
        if layout.dp_rank != 0:
            return None
        first = dist.get_global_rank(layout.pp_group, 0)
        # Each entry replaced by that pipeline rank's object.
        out: list[_T] | None = [obj] * layout.size if dist.get_rank() == first else None
        dist.gather_object(obj, out, dst=first, group=layout.pp_group)
        return out

    def merge_full_model(self, state: Mapping[str, object]) -> StateDict:
        """The unsplit model's full state dict on global rank 0 (``{}`` elsewhere), from each stage's full state
        dict on its data-parallel rank 0 (``state``; empty on the other ranks)."""
        parts = self._to_global_rank0(dict(state))
        if parts is None:
            return {}
        merged = {key: value for part in parts for key, value in part.items()}
        ordered = {key: merged[key] for key in self.model_keys if key in merged}
        ordered.update(merged)  # keys the unsplit model does not have (left for strict loading to report) come last
        return ordered

    def merge_full_optimizer(self, index: int, state: Mapping[str, Any]) -> StateDict:
        """Optimizer ``index``'s full state in plain ``torch.optim`` layout for the unsplit model on global rank 0
        (``{}`` elsewhere), from each stage's (this rank's optimizer positions) on its data-parallel rank 0."""
        parts = self._to_global_rank0(dict(state))
        if parts is None:
            return {}
        mapping = self.optimizers[index]
        entries: dict[int, object] = {}
        for rank, part in enumerate(parts):
            positions = mapping.by_rank[rank]
            for position, entry in part.get("state", {}).items():
                entries[positions[int(position)]] = entry
        groups = numbered_groups(parts[0]["param_groups"], mapping.sizes)
        return {"state": dict(sorted(entries.items())), "param_groups": groups}

    def local_model_state(self, state: Mapping[str, object]) -> dict[str, object]:
        """A full state dict of the unsplit model narrowed to this rank's stages. Keys the unsplit model does not
        have stay, so that strict loading reports them as unexpected."""
        return {k: v for k, v in state.items() if k in self.local_keys or k not in self.model_key_set}

    def local_optimizer_state(self, index: int, state: Mapping[str, Any], here: Optimizer, source: str) -> StateDict:
        """A plain ``torch.optim`` state dict of the unsplit optimizer (index-keyed) narrowed to this rank's
        parameters, renumbered by this rank's optimizer positions."""
        mapping = self.optimizers[index]
        groups = state["param_groups"]
        sizes = [len(g.get("params", ())) if isinstance(g, Mapping) else None for g in groups]
        check_group_sizes(
            f"{source}: the {type(here).__name__} state", sizes, mapping.sizes, " over all pipeline stages"
        )
        saved = state["state"]
        local_state = {}
        for position, unsplit in enumerate(mapping.local):
            entry = saved.get(unsplit, saved.get(str(unsplit)))
            if entry is not None:
                local_state[position] = entry
        here_sizes = [len(g["params"]) for g in here.param_groups]
        return {"state": local_state, "param_groups": numbered_groups(groups, here_sizes)}


def _settings(group: Mapping[str, object]) -> str:
    return repr({k: v for k, v in group.items() if k != "params"})


def _optimizer_map(
    index: int,
    rank_groups: list[list[list[str]]],
    rank_settings: list[list[str]],
    parameter_order: list[str],
    layout: PipelineLayout,
) -> OptimizerMap:
    counts = [len(g) for g in rank_groups]
    if len(set(counts)) > 1:
        raise ValueError(
            f"Optimizer {index} has {counts} param groups on pipeline ranks {list(range(len(counts)))}; a "
            "checkpoint of a pipelined run numbers its state as the unsplit model's optimizer, which needs the same "
            "groups on every pipeline rank (configure_optimizers builds them alike on every rank)."
        )
    for group in range(counts[0]):
        settings = {s[group] for s in rank_settings}
        if len(settings) > 1:
            raise ValueError(
                f"Optimizer {index}'s param group {group} has different settings on the pipeline ranks "
                f"({sorted(settings)}); a checkpoint records one setting per group of the unsplit optimizer."
            )
    place = {name: i for i, name in enumerate(parameter_order)}
    unsplit: list[list[str]] = []
    for group in range(counts[0]):
        names = [name for groups in rank_groups for name in groups[group]]
        for rank, groups in enumerate(rank_groups):
            own = groups[group]
            if any(name not in place for name in own) or own != sorted(own, key=place.__getitem__):
                raise ValueError(
                    f"Optimizer {index}'s param group {group} on pipeline rank {rank} lists its parameters in another "
                    f"order than the model's named_parameters ({own}). A checkpoint of a pipelined run numbers "
                    "optimizer state as the unsplit model's optimizer would, each group in the model's parameter "
                    "order; build each group from self.parameters() / self.named_parameters() in their order."
                )
        unsplit.append(sorted(set(names), key=place.__getitem__))
    index_of: dict[tuple[int, str], int] = {}  # numbered one group after another, as torch.optim does
    for group, names in enumerate(unsplit):
        for name in names:
            index_of[(group, name)] = len(index_of)
    by_rank = tuple(
        tuple(index_of[(g, name)] for g, names in enumerate(groups) for name in names) for groups in rank_groups
    )
    return OptimizerMap(tuple(tuple(g) for g in unsplit), by_rank[layout.pp_rank], by_rank)


def pipeline_model_state_dict(kind: str, runtime: PipelineRuntime, engine: ShardingEngine) -> StateDict:
    """``lightning_module_state_dict`` under pipeline parallelism: the unsplit model's full state on global rank 0
    (full), or this rank's stages' rows as DTensors (sharded). Call on every rank."""
    check_pipeline_format(kind)
    if kind == SHARDED:
        return sharded_model_state_dict(engine)
    assert kind == FULL
    info = PipelineCheckpoint.gather(runtime, engine)
    return info.merge_full_model(full_model_state_dict(engine, keep=runtime.layout.dp_rank == 0))


def pipeline_optimizer_state(
    kind: str, runtime: PipelineRuntime, engine: ShardingEngine, optimizer: Optimizer
) -> StateDict:
    """``optimizer_state`` under pipeline parallelism: the unsplit optimizer's full state on global rank 0 (full), or
    this rank's state keyed by name with the unsplit param groups (sharded). Call on every rank."""
    check_pipeline_format(kind)
    info = PipelineCheckpoint.gather(runtime, engine, [optimizer])
    if kind == SHARDED:
        return sharded_optimizer_state_dict(engine, optimizer, unsplit_groups=info.optimizers[0].groups)
    assert kind == FULL
    state = full_optimizer_state_dict(engine, optimizer, keep=runtime.layout.dp_rank == 0)
    return info.merge_full_optimizer(0, state)
