"""What a backward reads. [Note: an embedding's backward reads no weight]: a unit of embedding weights only is not
gathered for its backward, and trains exactly as when it is (and as one device); a tied embedding, or one beside other
parameters, still is. [Note: the root freed inside backward]: the root (embedding and head) is resharded once the head's
gradient is in, before the other units' backwards, and gathered again for a forward recomputed later."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_fsdp.engine import MixedPrecision, fully_shard
from lightning_fsdp.engine.unit import only_embedding_lookups
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import VOCAB, Block, batch, loss_fn
from tests.toolbox.training import parameters_of, sgd_with_momentum, train_on_shares

STEPS = 3
DIM = 8


class Lookup(nn.Module):
    """Token and position embeddings: the unit torchtitan makes of a model's first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(4, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))


class Net(nn.Module):
    def __init__(self, tied: bool = False, checkpoint_lookup: bool = False) -> None:
        super().__init__()
        self.lookup = Lookup()
        self.blocks = nn.ModuleList(Block(DIM, 12) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.lookup.tokens.weight
        self.checkpoint_lookup = checkpoint_lookup  # recomputed in backward, after the head's gradient

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.lookup, ids, use_reentrant=False) if self.checkpoint_lookup else self.lookup(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def train(rank: int, world_size: int, skip: bool, mixed: bool, tied: bool = False) -> dict:
    torch.manual_seed(0)
    model = Net(tied)
    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    engine = fully_shard(model, auto_wrap_policy={Block, Lookup}, mixed_precision=precision)
    lookup_unit = next(u for u in engine.units if u.module is model.lookup)
    flag = lookup_unit.backward_reads_parameters
    if not skip:
        lookup_unit.backward_reads_parameters = True  # the reference: gathered for its backward as any unit
    optimizer = sgd_with_momentum(model.parameters())
    losses, gathers, backward_gathers = [], [], []
    for step in range(STEPS):
        x, y = batch(step, size=8)
        engine.shard_comm.stats.reset()
        loss = loss_fn(model(x[rank::world_size]), y[rank::world_size])
        forward_calls = engine.shard_comm.stats.all_gather_calls
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float())
        gathers.append(engine.shard_comm.stats.all_gather_calls)
        backward_gathers.append(engine.shard_comm.stats.all_gather_calls - forward_calls)
    with engine.unsharded():
        params = parameters_of(model)
    return {"flag": flag, "losses": torch.stack(losses), "params": params, "gathers": gathers, "bwd": backward_gathers}


def train_root(
    rank: int,
    world_size: int,
    *,
    free: bool,
    tied: bool = False,
    checkpoint_lookup: bool = False,
    freeze_head: bool = False,
) -> dict:
    """The lookup and the head left in the root (Block units only); ``free=False`` keeps the root gathered to the end
    of backward (the reference). Records, at each Block's backward start, whether the root is gathered."""
    torch.manual_seed(0)
    model = Net(tied, checkpoint_lookup)
    model.head.weight.requires_grad_(not freeze_head)
    engine = fully_shard(model, auto_wrap_policy={Block})
    if not free:
        engine._root_reads = []  # no parameter to wait for: the root is not freed early
    root, gathered_at_block = engine.root_unit, []
    pre_backward = engine._pre_backward

    def recorded(unit, **kwargs):
        pre_backward(unit, **kwargs)
        if unit is not root:
            gathered_at_block.append(root.is_unsharded)

    engine._pre_backward = recorded
    stats, gathers = engine.shard_comm.stats, []

    def count_gathers() -> None:  # after each backward: the step's all-gathers (the optimizer step makes none)
        gathers.append(stats.all_gather_calls)
        stats.reset()

    stats.reset()
    optimizer = sgd_with_momentum(p for p in model.parameters() if p.requires_grad)
    losses = train_on_shares(model, optimizer, STEPS, 8, rank, world_size, before_step=count_gathers)
    with engine.unsharded():
        params = parameters_of(model)
    return {"losses": torch.stack(losses), "params": params, "gathers": gathers, "at_block": gathered_at_block}


def runs(rank: int, world_size: int) -> dict:
    return (
        {(skip, mixed): train(rank, world_size, skip, mixed) for skip in (True, False) for mixed in (False, True)}
        | {"tied": train(rank, world_size, True, False, tied=True)}
        | {
            ("root", free, recompute): train_root(rank, world_size, free=free, checkpoint_lookup=recompute)
            for free in (True, False)
            for recompute in (False, True)
        }
        | {
            "root tied": train_root(rank, world_size, free=True, tied=True),
            "root frozen head": train_root(rank, world_size, free=True, freeze_head=True),
        }
    )


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(runs, 2)


def one_device() -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model = Net()
    optimizer = sgd_with_momentum(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step, size=8)
        halves = [loss_fn(model(x[r::2]), y[r::2]) for r in range(2)]
        (sum(halves) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(halves[0].detach())
    return torch.stack(losses), parameters_of(model)


def test_an_embedding_unit_is_not_gathered_for_its_backward_and_trains_the_same(ranks):
    ref_losses, ref_params = one_device()
    compared = 0
    for rank, result in enumerate(ranks):
        for mixed in (False, True):
            skipped, gathered = result[True, mixed], result[False, mixed]
            assert skipped["flag"] is False  # the embeddings-only unit is recognised: its backward reads no weight
            # One all-gather fewer per step, all of it in the backward: the lookup unit's.
            assert [g + 1 for g in skipped["gathers"]] == gathered["gathers"], (skipped["gathers"], gathered["gathers"])
            assert [g + 1 for g in skipped["bwd"]] == gathered["bwd"] and min(gathered["bwd"]) >= 1
            # Bitwise the run that gathers it.
            assert torch.equal(skipped["losses"], gathered["losses"]), mixed
            for key, value in gathered["params"].items():
                assert torch.equal(skipped["params"][key], value), (mixed, key)
                compared += 1
        if rank == 0:  # fp32: as one device on the same global batches
            torch.testing.assert_close(result[True, False]["losses"], ref_losses, rtol=1e-5, atol=1e-6)
            for key, value in ref_params.items():
                torch.testing.assert_close(result[True, False]["params"][key], value, rtol=1e-5, atol=1e-6)
                compared += 1
    assert compared == 2 * 2 * len(ranks[0][True, False]["params"]) + len(ref_params) > 0
    # Tied to the head (a matmul, whose backward reads the weight): the weight goes to the root, the lookup unit keeps
    # only the position embedding and is still recognised; the root is gathered for its backward.
    tied = ranks[0]["tied"]
    assert tied["flag"] is False and min(tied["bwd"]) >= 1


def test_the_root_is_freed_once_the_head_has_its_gradient_and_trains_the_same(ranks):
    ref_losses, ref_params = one_device()
    blocks_backward = STEPS * 3
    compared = 0
    for rank, result in enumerate(ranks):
        for recompute in (False, True):
            freed, kept = result["root", True, recompute], result["root", False, recompute]
            # Freed before every Block's backward; the reference holds it through them.
            assert freed["at_block"] == [False] * blocks_backward, (recompute, freed["at_block"])
            assert kept["at_block"] == [True] * blocks_backward
            # No gather more, but for the lookup recomputed after the head: it gathers the root again, once a step.
            assert freed["gathers"] == [g + recompute for g in kept["gathers"]], (freed["gathers"], kept["gathers"])
            assert torch.equal(freed["losses"], kept["losses"]), recompute
            for key, value in kept["params"].items():
                assert torch.equal(freed["params"][key], value), (recompute, key)
                compared += 1
            if rank == 0:  # as one device on the same global batches
                torch.testing.assert_close(freed["losses"], ref_losses, rtol=1e-5, atol=1e-6)
                for key, value in ref_params.items():
                    torch.testing.assert_close(freed["params"][key], value, rtol=1e-5, atol=1e-6)
                    compared += 1
        # A tied head's gradient is complete only after the lookup, the last node; a frozen head's backward reads its
        # weight with no gradient to say when it is done: the root stays gathered through the Blocks' backward.
        assert result["root tied"]["at_block"] == [True] * blocks_backward
        assert result["root frozen head"]["at_block"] == [True] * blocks_backward
    assert compared == 2 * (2 * len(ref_params) + len(ref_params)) > 0


def test_only_plain_dense_embedding_weights_qualify():
    from types import SimpleNamespace

    from lightning_fsdp.engine.wrap import ParamUse

    def slots(*uses: ParamUse, tensor_parallel: object = None) -> list:
        return [SimpleNamespace(uses=[use], tensor_parallel=tensor_parallel) for use in uses]

    class OwnLookup(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * self.weight.norm()

    class OwnInit(nn.Embedding):  # the demo GPT's kind: only reset_parameters differs
        def reset_parameters(self) -> None:
            nn.init.normal_(self.weight, std=0.02)

    lookup, linear = nn.Embedding(4, 2), nn.Linear(2, 2)
    assert only_embedding_lookups(slots(ParamUse(lookup, "weight"), ParamUse(nn.Embedding(3, 2), "weight")))
    assert not only_embedding_lookups([])
    assert not only_embedding_lookups(slots(ParamUse(lookup, "weight"), ParamUse(linear, "weight")))
    assert not only_embedding_lookups(slots(ParamUse(OwnLookup(4, 2), "weight")))  # its forward reads the weight
    assert only_embedding_lookups(slots(ParamUse(OwnInit(4, 2), "weight")))
    assert not only_embedding_lookups(slots(ParamUse(nn.Embedding(4, 2, sparse=True), "weight")))
    assert not only_embedding_lookups(slots(ParamUse(lookup, "weight"), tensor_parallel=object()))
    tied = [SimpleNamespace(uses=[ParamUse(lookup, "weight"), ParamUse(linear, "weight")], tensor_parallel=None)]
    assert not only_embedding_lookups(tied)
