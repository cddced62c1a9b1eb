"""``ParallelDims``: how a run's ranks divide into pipeline, data-parallel and tensor-parallel dimensions (torchtitan's
``ParallelDims``), checked once and built once into the N-D ``DeviceMesh`` every part takes its sub-mesh from.

[Note: the layout of the ranks]
Global rank ``r = (p * D + d) * T + t`` for pipeline rank ``p`` of ``P``, data-parallel rank ``d`` of ``D`` and
tensor-parallel rank ``t`` of ``T`` (``D = world / (P * T)``): TP innermost, so a TP group is ``T`` consecutive ranks
inside one node (its collectives run every layer), then data parallelism (the engine's all-gathers and
reduce-scatters, once per unit), then pipeline stages (only activations cross). Under ``HYBRID_SHARD`` the data-parallel
ranks are ``S`` shard ranks (one node's, ``S = processes per node / T``) times ``R = D / S`` replicas. The mesh's
dimensions carry Lightning's names (``ModelParallelStrategy``'s), so ``self.device_mesh["tensor_parallel"]`` and
``self.device_mesh["data_parallel"]`` work in ``configure_model``; with pipelining a leading ``"pipeline_parallel"``
dimension. Every group is made with ``new_group(..., timeout=...)`` on every rank in one order ([Note: the groups keep
the strategy's timeout] in process_groups.py) and the mesh is assembled from them with ``DeviceMesh.from_group``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp.tensor_parallel_plans import apply_tensor_parallel_plan

PIPELINE, DATA, TENSOR = "pipeline_parallel", "data_parallel", "tensor_parallel"


class ParallelGroups(NamedTuple):
    """This rank's groups and the N-D mesh over them (``ParallelDims.build``)."""

    mesh: DeviceMesh  # dims ("pipeline_parallel",) "data_parallel", "tensor_parallel"
    pp_group: dist.ProcessGroup | None  # this rank's pipeline (same d, t); None without pipelining
    dp_group: dist.ProcessGroup  # the engine's data-parallel ranks (same p, t)
    tp_group: dist.ProcessGroup  # the tensor-parallel ranks (same p, d)
    shard_group: dist.ProcessGroup  # the engine's shard group: ``dp_group``, or one node's part of it under hybrid
    replicate_group: dist.ProcessGroup | None  # hybrid: the replicas of this rank's shard (same p, s, t)


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the layout, checked: ``P`` pipeline stages, ``T`` tensor-parallel ranks, ``D`` data-parallel ranks
    (of them ``S`` shard ranks per replica under hybrid sharding)."""

    world_size: int
    pipeline: int
    tensor: int
    shard: int  # S: the data-parallel ranks a parameter is sharded over (D without hybrid sharding)

    @property
    def data(self) -> int:
        return self.world_size // (self.pipeline * self.tensor)

    @property
    def replicate(self) -> int:
        return self.data // self.shard

    @classmethod
    def check(
        cls, world_size: int, per_node: int, *, pipeline: int = 1, tensor: int = 1, hybrid: bool = False
    ) -> ParallelDims:
        """The layout of ``world_size`` ranks (``per_node`` on each node); a clear error naming the sizes when they
        cannot be placed. No collective: called on every rank before the process group exists."""
        sizes = f"tensor_parallel_size={tensor} x pipeline_parallel_size={pipeline}"
        if world_size % (pipeline * tensor):
            raise ValueError(
                f"{sizes} = {pipeline * tensor} does not divide the {world_size} processes (devices x num_nodes): "
                f"the data-parallel size is world / (T x P). Choose sizes whose product divides {world_size}."
            )
        if tensor > per_node or per_node % tensor:
            raise ValueError(
                f"tensor_parallel_size={tensor} with {per_node} processes per node: a tensor-parallel group must lie "
                f"inside one node (its collectives run at every layer), so T must divide {per_node}; choose one of "
                f"{[t for t in range(1, per_node + 1) if per_node % t == 0]}."
            )
        data = world_size // (pipeline * tensor)
        shard = data
        if hybrid:
            shard = min(per_node // tensor, data)
            if data % shard:
                raise ValueError(
                    f"HYBRID_SHARD with {sizes} on {world_size} processes ({per_node} per node): the {data} "
                    f"data-parallel ranks do not split into replicas of one node's {shard} shard ranks."
                )
        return cls(world_size, pipeline, tensor, shard)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(p, d, t)`` of global ``rank`` (see [Note: the layout of the ranks])."""
        rest, t = divmod(rank, self.tensor)
        p, d = divmod(rest, self.data)
        return p, d, t

    def rank_of(self, p: int, d: int, t: int) -> int:
        return (p * self.data + d) * self.tensor + t

    def sampler_kwargs(self, rank: int) -> dict[str, int]:
        """The data-parallel rank and size: the ranks of one TP group (and of one pipeline) read the same samples."""
        return {"num_replicas": self.data, "rank": self.coordinates(rank)[1]}

    def build(self, rank: int, device_type: str, timeout: timedelta | None = None) -> ParallelGroups:
        """Create every group on every rank, in one order, and the mesh over this rank's; call once, on every rank."""
        P, D, T, S = self.pipeline, self.data, self.tensor, self.shard
        mine: dict[str, dist.ProcessGroup] = {}

        def make(name: str, ranks: list[int]) -> None:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[name] = group

        for p in range(P):
            for d in range(D):
                make(TENSOR, [self.rank_of(p, d, t) for t in range(T)])
        for p in range(P):
            for t in range(T):
                make(DATA, [self.rank_of(p, d, t) for d in range(D)])
        if P > 1:
            for d in range(D):
                for t in range(T):
                    make(PIPELINE, [self.rank_of(p, d, t) for p in range(P)])
        hybrid = S < D
        if hybrid:
            for p in range(P):
                for t in range(T):
                    for r in range(D // S):
                        make("shard", [self.rank_of(p, r * S + s, t) for s in range(S)])
                    for s in range(S):
                        make("replicate", [self.rank_of(p, r * S + s, t) for r in range(D // S)])
        names = ((PIPELINE,) if P > 1 else ()) + (DATA, TENSOR)
        shape = ((P,) if P > 1 else ()) + (D, T)
        mesh = DeviceMesh.from_group(
            [mine[name] for name in names],
            device_type,
            mesh=torch.arange(self.world_size).view(shape),
            mesh_dim_names=names,
        )
        return ParallelGroups(
            mesh,
            mine.get(PIPELINE),
            mine[DATA],
            mine[TENSOR],
            mine["shard"] if hybrid else mine[DATA],
            mine.get("replicate"),
        )


class ParallelLayout:
    """The strategy's layout of the ranks, from ``tensor_parallel_size`` and ``tensor_parallel_plan``: inactive with
    ``T = 1`` (the plain and pipeline-only paths keep their own groups); otherwise checked against the world before
    the process group exists (``check``), then built once (``build``) into the groups and mesh every part takes."""

    def __init__(self, tensor_parallel_size: int, plan: str | None) -> None:
        self.tensor_parallel_size = tensor_parallel_size
        self.plan = plan
        self.dims: ParallelDims | None = None
        self.groups: ParallelGroups | None = None

    def check(self, world_size: int, per_node: int, *, pipeline: int, hybrid: bool) -> None:
        """The sizes against the world (no collective; on every rank before any)."""
        if self.tensor_parallel_size > 1:
            self.dims = ParallelDims.check(
                world_size, per_node, pipeline=pipeline, tensor=self.tensor_parallel_size, hybrid=hybrid
            )

    def build(self, rank: int, device_type: str, timeout: timedelta | None) -> DeviceMesh | None:
        """The groups and the mesh (once; every rank); returns the mesh, None when inactive."""
        if self.dims is not None and self.groups is None:
            self.groups = self.dims.build(rank, device_type, timeout)
        return self.mesh

    @property
    def mesh(self) -> DeviceMesh | None:
        return self.groups.mesh if self.groups is not None else None

    def sampler_kwargs(self, rank: int) -> dict[str, int] | None:
        return self.dims.sampler_kwargs(rank) if self.dims is not None else None

    def shard_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None:
        """The engine's (shard, replicate) groups; None when inactive."""
        return (self.groups.shard_group, self.groups.replicate_group) if self.groups is not None else None

    def apply_plan(self, module: nn.Module) -> None:
        """``tensor_parallel_plan="auto"``: the built-in plan parallelizes ``module`` on the tensor-parallel sub-mesh
        (call once, before the model is split and sharded)."""
        if self.plan != "auto" or self.groups is None:
            return
        apply_tensor_parallel_plan(module, self.groups.mesh[TENSOR])
