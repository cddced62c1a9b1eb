"""Sharded and local checkpoints under HYBRID_SHARD with real replication: 4 ranks as 2 shard groups x 2 replicas.

Replicas hold identical rows; the sharded format must store them once and every replica must read its rows back,
the local format writes one file per rank. Restored parameters and optimizer state must equal the saved ones."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp.checkpoint.common import CheckpointRun, load_sharded_model_state_dict
from lightning_fsdp.checkpoint.full import full_model_state_dict, full_optimizer_state_dict
from lightning_fsdp.checkpoint.local import (
    load_local_checkpoint,
    local_model_state_dict,
    local_optimizer_state_dict,
    save_local_checkpoint,
)
from lightning_fsdp.checkpoint.sharded import (
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    sharded_model_state_dict,
    sharded_optimizer_state_dict,
)
from lightning_fsdp.engine import fully_shard
from lightning_fsdp.process_groups import node_groups
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn


def build(groups, seed):
    torch.manual_seed(seed)
    model = ToyLM()
    engine = fully_shard(
        model,
        sharding_strategy="HYBRID_SHARD",
        auto_wrap_policy={Block},
        process_group=groups[0],
        replicate_group=groups[1],
    )
    return model, engine, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def snapshot(engine, optimizer):
    return full_model_state_dict(engine, rank0_only=False), full_optimizer_state_dict(
        engine, optimizer, rank0_only=False
    )


def round_trip(rank, world_size, mode, folder):
    groups = node_groups(world_size, 2, rank)
    model, engine, optimizer = build(groups, seed=0)
    for step in range(2):
        x, y = batch(step, size=8)
        loss_fn(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = snapshot(engine, optimizer)
    path = os.path.join(folder, f"{mode}.ckpt")
    if mode == "sharded":
        save_sharded_checkpoint(
            {
                "state_dict": sharded_model_state_dict(engine),
                "optimizer_states": [sharded_optimizer_state_dict(engine, optimizer)],
                "global_step": 2,
            },
            path,
        )
    else:
        save_local_checkpoint(
            {
                "state_dict": local_model_state_dict(engine),
                "optimizer_states": [local_optimizer_state_dict(optimizer)],
                "global_step": 2,
            },
            path,
            engine,
            [optimizer],
        )
    dist.barrier()
    _, engine_b, optimizer_b = build(groups, seed=1)  # different initial values, overwritten by the load
    loader = load_sharded_checkpoint if mode == "sharded" else load_local_checkpoint
    checkpoint = loader(path, CheckpointRun(engine_b, [optimizer_b]))
    load_sharded_model_state_dict(engine_b, checkpoint["state_dict"])
    optimizer_b.load_state_dict(checkpoint["optimizer_states"][0])
    return saved, snapshot(engine_b, optimizer_b), checkpoint["global_step"]


@pytest.mark.parametrize("mode", ["sharded", "local"])
def test_hybrid_checkpoint_round_trip_is_exact(mode):
    with tempfile.TemporaryDirectory() as folder:
        results = run_distributed(round_trip, 4, mode, folder)
    for saved, restored, step in results:
        assert step == 2
        for key, value in saved[0].items():
            assert torch.equal(restored[0][key], value), key
        for index, entry in saved[1]["state"].items():
            for name, value in entry.items():
                assert torch.equal(restored[1]["state"][index][name], value), (index, name)
    # Replicas agree, and so do the shard groups' views of the full model.
    for other in results[1:]:
        for key, value in results[0][1][0].items():
            assert torch.equal(other[1][0][key], value)
