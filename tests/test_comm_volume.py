"""The engine's own byte counters: per step, FULL_SHARD gathers every unit twice (forward, backward) except the
root, which stays gathered from its forward to its backward, and reduce-scatters the gradients once; SHARD_GRAD_OP
gathers once. Together that is the 3x (2x) of the parameter bytes, within padding and the root's saved re-gather.
Each rank's chunk of a reduction also carries one used-flag per trainable parameter (k elements per chunk), which
tells the engine which parameters no rank used."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp.engine import fully_shard
from tests.distributed import run_distributed
from tests.models import Block, ToyLM, batch, loss_fn


def volumes(rank, world_size):
    results = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        torch.manual_seed(0)
        model = ToyLM(dim=16)
        engine = fully_shard(model, sharding_strategy=strategy, auto_wrap_policy={Block})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        per_step = []
        for step in range(2):
            engine.shard_comm.stats.reset()
            x, y = batch(step, size=4)
            loss_fn(model(x[rank::2]), y[rank::2]).backward()
            optimizer.step()
            optimizer.zero_grad()
            stats = engine.shard_comm.stats
            per_step.append((stats.all_gather_bytes, stats.reduce_scatter_bytes, stats.all_reduce_bytes,
                             stats.peak_gathered_units))
        padded = {u.name: u.shard_numel * 4 for u in engine.units}
        # Reduction input per rank: N chunks of (padded gradient rows + one used-flag per trainable parameter).
        padded_grads = {u.name: (u.reduce_plan().numel + len(u.trainable_slots)) * 4 for u in engine.units}
        results[strategy] = (per_step, padded, padded_grads)
    return results


@pytest.fixture(scope="module")
def measured():
    return run_distributed(volumes, 2)


def _model_bytes():
    model = ToyLM(dim=16)
    params = list(model.parameters())
    return (sum(p.numel() * 4 for p in params), sum(p.numel() * 4 for p in params if p.requires_grad),
            sum(p[0].numel() * 4 for p in params))


def test_full_shard_gathers_twice_and_reduces_once(measured):
    full, trainable, row_bytes = _model_bytes()
    for per_step, padded, padded_grads in (r["FULL_SHARD"] for r in measured):
        root = padded["<root>"]
        expected_gather = 2 * sum(padded.values()) - root
        for step, (gathered, scattered, reduced, peak) in enumerate(per_step):
            assert gathered == expected_gather
            assert scattered == 2 * sum(padded_grads.values())  # input of N=2 shards per rank
            assert reduced == 0
            # One block at a time while the first step records the order; from then on the default backward
            # prefetch keeps the next block in flight beside the one computing.
            assert peak == (1 if step == 0 else 2)
            # Across both ranks the gathers deliver 2x the parameters (less the root's once), and the reduction
            # takes one full gradient: the 3x of the parameter bytes, within padding.
            assert abs(2 * gathered - (2 * full - 2 * root)) <= 4 * row_bytes
            assert abs(scattered - trainable) <= 2 * row_bytes


def test_shard_grad_op_gathers_once(measured):
    full, trainable, row_bytes = _model_bytes()
    for per_step, padded, _ in (r["SHARD_GRAD_OP"] for r in measured):
        for gathered, scattered, _, peak in per_step:
            assert gathered == sum(padded.values())
            assert abs(2 * gathered - full) <= 2 * row_bytes  # 1x the parameters, counted over both ranks
            assert abs(scattered - trainable) <= 2 * row_bytes
            assert peak == 2  # both blocks stay gathered from their forward to their backward


def test_no_shard_only_all_reduces(measured):
    _, trainable, _ = _model_bytes()
    for per_step, _, with_flags in (r["NO_SHARD"] for r in measured):
        for gathered, scattered, reduced, _ in per_step:
            assert (gathered, scattered) == (0, 0)
            assert reduced == sum(with_flags.values())  # N=1 chunk: the gradients plus one flag per parameter
            flags = 4 * sum(1 for p in ToyLM(dim=16).parameters() if p.requires_grad)  # parameters() lists a tie once
            assert reduced == trainable + flags
