"""HYBRID_SHARD and HYBRID_SHARD_ZERO2: shard within a group, replicate across groups; 4 ranks as 2 "nodes" x 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.checkpoint.full import full_model_state_dict
from lightning_fsdp.engine import fully_shard
from lightning_fsdp.process_groups import node_groups
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn
from tests.toolbox.one_device import toy_lm_on_step_batches

STEPS = 3


def hybrid(rank, world_size):
    shard, replicate = node_groups(world_size, 2, rank)
    results = {}
    for strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        torch.manual_seed(0)
        model = ToyLM()
        engine = fully_shard(
            model, sharding_strategy=strategy, auto_wrap_policy={Block}, process_group=shard, replicate_group=replicate
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(STEPS):
            x, y = batch(step, size=8)
            loss = loss_fn(model(x[rank::world_size]), y[rank::world_size])
            loss.backward()
            engine.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world_size)
        state = full_model_state_dict(engine)
        results[strategy] = (
            losses,
            state,
            engine.local_param_bytes(),
            engine.shard_comm.world_size,
            engine.replicate_comm.world_size,
        )
    return results


def test_hybrid_matches_unsharded_and_holds_half_per_rank():
    results = run_distributed(hybrid, 4)
    one_device = toy_lm_on_step_batches(STEPS, 8, clip_norm=0.05)
    ref_losses, ref_model = one_device.losses, one_device.model
    full_bytes = sum(p.numel() * p.element_size() for p in ref_model.parameters())
    row_bytes = sum(p[0].numel() * p.element_size() for p in ref_model.parameters())
    for strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        losses, state, _, shard_size, replicate_size = results[0][strategy]
        assert (shard_size, replicate_size) == (2, 2)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for key, value in ref_model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"{strategy} {key}")
        for rank_results in results:
            held = rank_results[strategy][2]
            assert abs(held - full_bytes / 2) <= row_bytes  # 1/(processes per node), not 1/world
        assert all(r[strategy][1] == {} for r in results[1:])  # full state dict on rank 0 only


def test_hybrid_options_are_validated():
    with pytest.raises(ValueError, match="device_mesh is only used by HYBRID_SHARD"):
        FSDPStrategy(device_mesh=object())
    with pytest.raises(ValueError, match="expected a 2-D DeviceMesh"):
        FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=object())
    with pytest.raises(TypeError, match=r"\(shard_group, replicate_group\) pair"):
        FSDPStrategy(sharding_strategy="HYBRID_SHARD", process_group=3)
    with pytest.raises(ValueError, match="needs a replicate_group"):
        fully_shard(ToyLM(), sharding_strategy="HYBRID_SHARD")
