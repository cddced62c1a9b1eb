"""The engine's process groups (lightning_fsdp/process_groups.py) and the one options parser
(lightning_fsdp/engine/options.py).

The default hybrid layout must be the one ``init_device_mesh(..., mesh_dim_names=("replicate", "shard"))`` describes,
and, unlike the mesh's groups, keep the strategy's timeout (see [Note: the groups keep the strategy's timeout]).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp.engine.options import ShardingOptions, ShardingStrategy
from lightning_fsdp.process_groups import GroupChoice, node_groups
from tests.toolbox.distributed import run_distributed

TIMEOUT = timedelta(seconds=77)


def _timeout(group):
    """A gloo group's timeout, read through torch's private accessors (None where this torch has other ones)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def layout_case(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    shard, replicate = node_groups(world_size, 2, rank, TIMEOUT)
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("replicate", "shard"))
    plain = dist.new_group(list(range(world_size)))  # no timeout given: torch's default
    return {
        "ours": (dist.get_process_group_ranks(shard), dist.get_process_group_ranks(replicate)),
        "mesh": (
            dist.get_process_group_ranks(mesh.get_group("shard")),
            dist.get_process_group_ranks(mesh.get_group("replicate")),
        ),
        "timeouts": (_timeout(shard), _timeout(replicate)),
        "plain_timeout": _timeout(plain),
    }


def test_default_hybrid_groups_are_the_mesh_layout_with_the_strategys_timeout():
    results = run_distributed(layout_case, 4)
    for rank, result in enumerate(results):
        assert result["ours"] == result["mesh"], rank
        assert result["ours"] == ([rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2])
    if results[0]["plain_timeout"] is None:
        pytest.skip("this torch does not expose a group's timeout")
    assert results[0]["plain_timeout"] != TIMEOUT  # the reading tells the timeouts apart
    for result in results:
        assert result["timeouts"] == (TIMEOUT, TIMEOUT)


def test_a_group_callable_must_return_a_pair_for_the_hybrid_strategies():
    choice = GroupChoice(ShardingStrategy.HYBRID_SHARD, process_group=lambda: 3)
    with pytest.raises(TypeError, match=r"process_group returned 3; expected a \(shard_group, replicate_group\) pair"):
        choice.resolve(world_size=2, per_node=1, rank=0, timeout=None)
    with pytest.raises(ValueError, match="world size 3 is not a multiple of 2 processes per node"):
        node_groups(3, 2, 0)


def test_ignored_entries_are_normalised_alike_for_the_strategy_and_fully_shard():
    linear = nn.Linear(2, 2)
    for names in (False, True):
        assert ShardingOptions.parse(ignored_modules=linear, names=names).ignored_modules == (linear,)
        assert ShardingOptions.parse(ignored_modules=(m for m in [linear]), names=names).ignored_modules == (linear,)
        assert ShardingOptions.parse(ignored_states=linear.weight, names=names).ignored_states == (linear.weight,)
        with pytest.raises(TypeError, match=r"ignored_modules contains \{'a': 1\}"):
            ShardingOptions.parse(ignored_modules={"a": 1}, names=names)
    assert ShardingOptions.parse(ignored_modules=["block"], names=True).ignored_modules == ("block",)
    with pytest.raises(TypeError, match="ignored_modules='block' is not valid; expected an iterable of nn.Module"):
        ShardingOptions.parse(ignored_modules="block")
