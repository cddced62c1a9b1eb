"""The engine trains exactly like unsharded training: 2 and 3 gloo processes against a single-process reference.

Each worker runs every configuration in one process group (start-up is the expensive part on two cores).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_fsdp.engine import fully_shard
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn

STEPS = 4
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
# (optimizer, accumulation micro-batches, clip max-norm or None)
SCHEDULES = [("sgd", 1, None), ("adamw", 1, None), ("sgd", 2, None), ("sgd", 1, 0.05), ("adamw", 2, 0.05)]


def make_optimizer(params, name):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def train(model, rank, world_size, optimizer_name, accumulate, clip, engine=None):
    """Train STEPS steps on rank's slice of each global batch; returns the global mean loss per step."""
    optimizer = make_optimizer(model.parameters(), optimizer_name)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, size=12)
        step_loss = 0.0
        for micro in range(accumulate):
            mx, my = x[micro::accumulate], y[micro::accumulate]  # the micro-batch, then this rank's part of it
            b = mx.shape[0] // world_size
            mx, my = mx[rank * b : (rank + 1) * b], my[rank * b : (rank + 1) * b]
            loss = loss_fn(model(mx), my) / accumulate
            loss.backward()
            step_loss += loss.detach()
        if clip is not None:
            if engine is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                engine.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if world_size > 1:
            torch.distributed.all_reduce(step_loss)
            step_loss /= world_size
        losses.append(float(step_loss))
    return losses


def one_device_with_schedule(optimizer_name, accumulate, clip):
    """One process, the whole global batch: the schedule's optimizer, micro-batches and clipping, as the ranks run
    it (train() with world size 1)."""
    torch.manual_seed(0)
    model = ToyLM()
    losses = train(model, 0, 1, optimizer_name, accumulate, clip)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def sharded_cases(rank, world_size, direct_gather_min_numel=None):
    from lightning_fsdp.engine.unit import FlatUnit

    if direct_gather_min_numel is not None:
        # Which parameters are all-gathered on their own, straight into place, instead of through the staging buffer.
        FlatUnit.direct_gather_min_numel = direct_gather_min_numel
    results = {}
    for strategy, (opt, accumulate, clip) in itertools.product(STRATEGIES, SCHEDULES):
        torch.manual_seed(0)
        model = ToyLM()
        engine = fully_shard(model, sharding_strategy=strategy, auto_wrap_policy={Block})
        names = [n for n, _ in model.named_parameters()]
        losses = train(model, rank, world_size, opt, accumulate, clip, engine)
        with engine.unsharded():
            params = {k: v.detach().clone() for k, v in model.named_parameters()}
        results[(strategy, opt, accumulate, clip)] = (losses, params, names)
    return results


@pytest.fixture(scope="module")
def references():
    return {(opt, acc, clip): one_device_with_schedule(opt, acc, clip) for opt, acc, clip in SCHEDULES}


@pytest.mark.parametrize(
    "world_size,direct_gather_min_numel",
    [
        (2, None),  # the default: ToyLM's parameters are all small, one staged all-gather per unit
        (3, None),
        (2, 1),  # every parameter gathered on its own, straight into place
        (3, 30),  # some in place (the 7x5 embedding, Block weights), the rest staged together
    ],
)
def test_losses_and_parameters_match_unsharded_training(world_size, direct_gather_min_numel, references):
    per_rank = run_distributed(sharded_cases, world_size, direct_gather_min_numel)
    unwrapped_names = [n for n, _ in ToyLM().named_parameters()]
    for key, (losses, params, names) in per_rank[0].items():
        strategy, opt, accumulate, clip = key
        ref_losses, ref_params = references[(opt, accumulate, clip)]
        assert names == unwrapped_names, key
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=str(key))
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=f"{key} {name}")
    # Every rank sees the same full parameters.
    for other in per_rank[1:]:
        for key in per_rank[0]:
            for name in per_rank[0][key][1]:
                assert torch.equal(per_rank[0][key][1][name], other[key][1][name])


def test_clipping_is_active_in_the_reference(references):
    # Guards the clip cases above: with this max-norm the clipped run must differ from the unclipped one.
    assert references[("sgd", 1, 0.05)][0][1:] != references[("sgd", 1, None)][0][1:]


def _direct_vs_staged(rank, world_size):
    from lightning_fsdp import MixedPrecision
    from lightning_fsdp.engine.unit import FlatUnit

    out = {}
    for precision in ("fp32", "fp16"):
        mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16) if precision == "fp16" else None
        for threshold in (2**18, 1):
            FlatUnit.direct_gather_min_numel = threshold
            torch.manual_seed(0)
            model = ToyLM(dim=6)  # 6-row layers split evenly over 2 ranks: reduced in place too
            engine = fully_shard(model, auto_wrap_policy={Block}, mixed_precision=mp)
            direct = sum(len(u._direct) + len(u.reduce_plan().direct) for u in engine.units)
            train(model, rank, world_size, "sgd", 1, None, engine)
            with engine.unsharded():
                out[(precision, threshold)] = (direct, {k: v.detach().clone() for k, v in model.named_parameters()})
    return out


def test_direct_collectives_are_bitwise_equal_to_staged():
    """Gathering and reducing a parameter on its own, in place, computes exactly what the staged path does (same
    sums in the same order), in float32 and with float16 reductions, which divide before summing."""
    for result in run_distributed(_direct_vs_staged, 2):
        for precision in ("fp32", "fp16"):
            (staged_count, staged), (direct_count, direct) = result[(precision, 2**18)], result[(precision, 1)]
            assert staged_count == 0 and direct_count > 0
            for name in staged:
                assert torch.equal(staged[name], direct[name]), (precision, name)
