"""The shard group and, for the hybrid strategies, the replicate group: the user's group, pair or 2-D ``DeviceMesh``,
or by default (``node_groups``) the groups of ``init_device_mesh(device_type, (num_nodes, per_node))``.

[Note: the groups keep the strategy's timeout]
A new group does not inherit the default group's timeout, and ``init_device_mesh`` takes none (torch #119574,
#119613), so ``node_groups`` makes the same groups with ``new_group(..., timeout=timeout)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeGuard

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp.engine.groups import is_process_group
from lightning_fsdp.engine.options import ShardingStrategy

GroupPair = tuple[dist.ProcessGroup, dist.ProcessGroup]
# What the model is sharded over: (shard group, replicate group); None: the whole world / no replication.
ShardGroups = tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]


def is_group_pair(value: object) -> TypeGuard[Sequence[dist.ProcessGroup]]:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(is_process_group(g) for g in value)


def node_groups(world_size: int, per_node: int, rank: int, timeout: timedelta | None = None) -> GroupPair:
    """This rank's ``(shard group, replicate group)`` of the default hybrid layout. Every rank creates every group, in
    the same order, as ``new_group`` requires (see [Note: the groups keep the strategy's timeout])."""
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
    """The user's ``process_group`` / ``device_mesh`` (docs/options.md), checked when the strategy is built (on every
    rank, before any group exists) and turned into groups by ``resolve`` at setup."""

    sharding_strategy: ShardingStrategy
    # A callable returns a group or a pair, checked by the engine (engine/groups.py) once it is called.
    process_group: dist.ProcessGroup | GroupPair | Callable[[], Any] | None = None
    device_mesh: DeviceMesh | None = None

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

    def resolve(self, world_size: int, per_node: int, rank: int, timeout: timedelta | None) -> ShardGroups:
        """``(shard group, replicate group)`` for ``fully_shard`` (None: the whole world / no replication). Every rank
        must call it: the default hybrid layout creates every group on every rank."""
        # The user's group (or what their callable returned): fully_shard checks it (engine/groups.py).
        group: Any = self.process_group
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
