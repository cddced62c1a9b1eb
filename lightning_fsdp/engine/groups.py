"""The process groups the engine checks (``fully_shard``'s) and builds (hpZ, ``reshard_after_forward=N``)."""

from __future__ import annotations

import torch.distributed as dist

from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.options import ShardingStrategy


def is_process_group(value: object) -> bool:
    return isinstance(value, dist.ProcessGroup)


def check_engine_groups(strategy: ShardingStrategy, process_group: object, replicate_group: object) -> None:
    """``ProcessGroup`` objects or ``None``, and a replicate group for the hybrid strategies."""
    if strategy.is_hybrid and replicate_group is None:
        raise ValueError(f"sharding_strategy={strategy.value!r} needs a replicate_group beside the shard group.")
    for name, group in (("process_group", process_group), ("replicate_group", replicate_group)):
        if group is not None and not is_process_group(group):
            raise TypeError(f"{name}={group!r} is not valid; expected a torch.distributed.ProcessGroup or None.")


def consecutive_subgroup(shard_comm: Communicator, size: int) -> dist.ProcessGroup:
    """This rank's group of ``size`` consecutive ranks of its shard group. torch's ``new_group`` must be called by
    every process for every group, in the same order: when shard groups are smaller than the world (hybrid
    sharding, a user's group), every rank first learns every shard group's ranks (one ``all_gather_object``)."""
    group = shard_comm.group  # None: the default group, whose ranks are the global ones
    mine = tuple(dist.get_global_rank(group, i) if group is not None else i for i in range(shard_comm.world_size))
    world = dist.get_world_size()
    if len(mine) == world:
        every = [mine]
    else:
        gathered = [mine] * world  # placeholders: every entry is overwritten with that rank's shard group
        dist.all_gather_object(gathered, mine)
        every = sorted(set(gathered))
    me: int = dist.get_rank()
    found: dist.ProcessGroup | None = None
    for ranks in every:
        for start in range(0, len(ranks), size):
            members = sorted(ranks[start : start + size])
            subgroup = dist.new_group(members)
            if me in members:
                found = subgroup
    if found is None:  # every rank is in its own shard group
        raise RuntimeError(f"Rank {me} is in none of the shard groups {every}; the process groups are inconsistent.")
    return found
