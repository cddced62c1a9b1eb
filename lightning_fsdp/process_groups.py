"""The process groups a sharded model's collectives run on: the shard group and, for the hybrid strategies, the
replicate group.

``FULL_SHARD`` / ``SHARD_GRAD_OP`` / ``NO_SHARD`` use one group: the whole world, or the user's ``process_group``.
``HYBRID_SHARD`` / ``HYBRID_SHARD_ZERO2`` shard within a shard group and replicate across shard groups: the user
passes a ``(shard_group, replicate_group)`` pair, a callable returning one, or a 2-D ``DeviceMesh`` with dims
``("replicate", "shard")``; by default (``node_groups``) a node's processes form a shard group and the processes with
the same local rank on every node form a replicate group, the layout
``init_device_mesh(device_type, (num_nodes, per_node), mesh_dim_names=("replicate", "shard"))`` describes.

``GroupChoice`` checks these values when the strategy is constructed (on every rank, before any group exists) and
turns them into groups at setup; ``engine/groups.py`` checks what ``fully_shard`` is given.

[Note: the groups keep the strategy's timeout]
``FSDPStrategy(timeout=...)`` must hold for the engine's collectives too, and a new group does not inherit the
default group's timeout: ``new_group`` without ``timeout=`` falls back to torch's default (30 minutes). So
``node_groups`` creates its groups with ``new_group(..., timeout=timeout)`` rather than with ``init_device_mesh``,
which has no timeout argument (torch issues #119574, #119613): it creates its groups through ``new_group`` /
``split_group`` with torch's default timeout (checked on torch 2.13: groups of 30 minutes under a default group of
77 seconds). Only the per-dimension option objects of ``backend_override`` carry a timeout, and those are
backend-specific (gloo's, NCCL's and HCCL's option classes differ), and ``backend_override`` is missing from torch 2.6
(whose ``init_device_mesh`` takes ``mesh_dim_names`` only). The groups are the same: shard groups of consecutive
ranks, replicate groups of equal local rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_fsdp.engine.config import ShardingStrategy
from lightning_fsdp.engine.groups import is_process_group

GroupPair = tuple[dist.ProcessGroup, dist.ProcessGroup]


def is_group_pair(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(is_process_group(g) for g in value)


def node_groups(world_size: int, per_node: int, rank: int, timeout: timedelta | None = None) -> GroupPair:
    """The default hybrid layout: ``(shard group, replicate group)`` of this rank, sharding within a node's
    ``per_node`` processes and replicating across nodes.

    Every rank creates every group, in the same order, as ``new_group`` requires. ``timeout`` is the strategy's;
    see [Note: the groups keep the strategy's timeout] for why this is not ``init_device_mesh``.
    """
    if per_node < 1 or world_size % per_node:
        raise ValueError(f"world size {world_size} is not a multiple of {per_node} processes per node.")
    shard = replicate = None
    for node in range(world_size // per_node):
        group = dist.new_group(list(range(node * per_node, (node + 1) * per_node)), timeout=timeout)
        if rank // per_node == node:
            shard = group
    for local in range(per_node):
        group = dist.new_group(list(range(local, world_size, per_node)), timeout=timeout)
        if rank % per_node == local:
            replicate = group
    assert shard is not None and replicate is not None
    return shard, replicate


@dataclass(frozen=True)
class GroupChoice:
    """The user's choice of groups for the engine (``FSDPStrategy(process_group=..., device_mesh=...)``), checked
    when it is made and resolved into groups by ``resolve`` once the default process group exists.

    ``process_group``: a ``ProcessGroup`` (a ``(shard_group, replicate_group)`` pair for the hybrid strategies), or
    a callable returning one, called at setup. ``device_mesh``: hybrid strategies only, a 2-D ``DeviceMesh`` with
    dims ``(replicate, shard)``. Neither: the whole world, or for the hybrid strategies ``node_groups``.
    """

    sharding_strategy: ShardingStrategy
    process_group: dist.ProcessGroup | GroupPair | Callable[[], Any] | None = None
    device_mesh: Any = None

    def __post_init__(self) -> None:
        strategy, group, mesh = self.sharding_strategy, self.process_group, self.device_mesh
        if strategy.is_hybrid:
            if group is not None and not (callable(group) or is_group_pair(group)):
                raise TypeError(
                    f"process_group={group!r} is not valid for {strategy.value}; expected a "
                    "(shard_group, replicate_group) pair or a callable returning one."
                )
        elif group is not None and not (callable(group) or is_process_group(group)):
            raise TypeError(
                f"process_group={group!r} is not valid; expected a torch.distributed.ProcessGroup or a "
                "callable returning one (called once the default process group exists)."
            )
        if mesh is not None:
            if not strategy.is_hybrid:
                raise ValueError(
                    f"device_mesh is only used by HYBRID_SHARD and HYBRID_SHARD_ZERO2, not {strategy.value!r}; "
                    "pass process_group to restrict sharding to a group."
                )
            if group is not None:
                raise ValueError("Pass either device_mesh or process_group, not both.")
            if getattr(mesh, "ndim", None) != 2:
                raise ValueError(
                    f"device_mesh={mesh!r} is not valid; expected a 2-D DeviceMesh with dims (replicate, shard)."
                )

    def resolve(
        self, world_size: int, per_node: int, rank: int, timeout: timedelta | None
    ) -> tuple[Any | None, Any | None]:
        """``(shard group, replicate group)`` for ``fully_shard``; ``None`` means the whole world / no replication.

        Collective: with the default hybrid layout every rank creates every group, so every rank must call this.
        """
        group = self.process_group
        if callable(group) and not is_process_group(group):
            group = group()
        if not self.sharding_strategy.is_hybrid:
            return group, None
        if self.device_mesh is not None:
            return self.device_mesh.get_group(1), self.device_mesh.get_group(0)
        if group is not None:
            if not is_group_pair(group):
                raise TypeError(f"process_group returned {group!r}; expected a (shard_group, replicate_group) pair.")
            return group[0], group[1]
        return node_groups(world_size, per_node, rank, timeout)
