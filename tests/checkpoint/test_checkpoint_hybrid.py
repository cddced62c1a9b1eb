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
    """ToyLM under HYBRID_SHARD over ``groups`` (shard, replicate), or FULL_SHARD over the world when None."""
    torch.manual_seed(seed)
    model = ToyLM()
    if groups is None:
        engine = fully_shard(model, sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
    else:
        engine = fully_shard(
            model,
            sharding_strategy="HYBRID_SHARD",
            auto_wrap_policy={Block},
            process_group=groups[0],
            replicate_group=groups[1],
        )
    return model, engine, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def save_sharded(engine, optimizer, path):
    checkpoint = {
        "state_dict": sharded_model_state_dict(engine),
        "optimizer_states": [sharded_optimizer_state_dict(engine, optimizer)],
        "global_step": 2,
    }
    save_sharded_checkpoint(checkpoint, path)
    dist.barrier()


def load_into(groups, path, loader=None):
    """A fresh model (other initial values) under the layout of ``groups``, loaded from ``path`` (sharded format
    unless ``loader`` says otherwise)."""
    loader = loader or load_sharded_checkpoint
    _, engine, optimizer = build(groups, seed=1)
    checkpoint = loader(path, CheckpointRun(engine, [optimizer]))
    load_sharded_model_state_dict(engine, checkpoint["state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    return engine, optimizer, checkpoint["global_step"]


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
        save_sharded(engine, optimizer, path)
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
    engine_b, optimizer_b, step = load_into(groups, path, None if mode == "sharded" else load_local_checkpoint)
    restored = {"same layout": snapshot(engine_b, optimizer_b)}
    if mode == "sharded":
        # Hybrid -> full sharding over all 4 ranks, and that run's checkpoint back into the hybrid layout
        # (docs/resuming.md).
        engine_full, optimizer_full, _ = load_into(None, path)
        restored["hybrid -> full"] = snapshot(engine_full, optimizer_full)
        full_path = os.path.join(folder, "from_full.ckpt")
        save_sharded(engine_full, optimizer_full, full_path)
        engine_back, optimizer_back, _ = load_into(groups, full_path)
        restored["full -> hybrid"] = snapshot(engine_back, optimizer_back)
    return saved, restored, step


@pytest.mark.parametrize("mode", ["sharded", "local"])
def test_hybrid_checkpoint_round_trip_is_exact(mode):
    """Restored parameters and optimizer state equal the saved ones exactly: in the same layout, and for the sharded
    format also under FULL_SHARD over all ranks and back from that run's checkpoint into the hybrid layout."""
    with tempfile.TemporaryDirectory() as folder:
        results = run_distributed(round_trip, 4, mode, folder)
    expected = ["same layout", "hybrid -> full", "full -> hybrid"] if mode == "sharded" else ["same layout"]
    compared = 0
    for saved, restored, step in results:
        assert step == 2
        assert list(restored) == expected
        for how, (model_state, optimizer_state) in restored.items():
            for key, value in saved[0].items():
                assert torch.equal(model_state[key], value), (how, key)
                compared += 1
            for index, entry in saved[1]["state"].items():
                for name, value in entry.items():
                    assert torch.equal(optimizer_state["state"][index][name], value), (how, index, name)
                    compared += 1
    saved_model, saved_optimizer = results[0][0]
    assert saved_optimizer["state"] and compared > 4 * len(expected) * len(saved_model) > 0
    # Replicas agree, and so do the shard groups' views of the full model.
    for other in results[1:]:
        for key, value in results[0][1]["same layout"][0].items():
            assert torch.equal(other[1]["same layout"][0][key], value)
