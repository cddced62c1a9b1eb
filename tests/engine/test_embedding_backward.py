"""[Note: an embedding's backward reads no weight]: a unit of embedding weights only is not gathered for its backward,
and trains exactly as when it is (and as one device); a tied embedding, or one beside other parameters, still is."""

from __future__ import annotations

import torch
from torch import nn

from lightning_fsdp.engine import MixedPrecision, fully_shard
from lightning_fsdp.engine.unit import only_embedding_lookups
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import VOCAB, Block, batch, loss_fn
from tests.toolbox.training import parameters_of, sgd_with_momentum

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
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.lookup = Lookup()
        self.blocks = nn.ModuleList(Block(DIM, 12) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.lookup.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.lookup(ids)
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


def runs(rank: int, world_size: int) -> dict:
    return {
        (skip, mixed): train(rank, world_size, skip, mixed) for skip in (True, False) for mixed in (False, True)
    } | {"tied": train(rank, world_size, True, False, tied=True)}


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


def test_an_embedding_unit_is_not_gathered_for_its_backward_and_trains_the_same():
    ranks = run_distributed(runs, 2)
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


def test_only_plain_dense_embedding_weights_qualify():
    from types import SimpleNamespace

    from lightning_fsdp.engine.wrap import ParamUse

    def slots(*uses: ParamUse, tensor_parallel: object = None) -> list:
        return [SimpleNamespace(uses=[use], tensor_parallel=tensor_parallel) for use in uses]

    class OwnLookup(nn.Embedding):
        pass

    lookup, linear = nn.Embedding(4, 2), nn.Linear(2, 2)
    assert only_embedding_lookups(slots(ParamUse(lookup, "weight"), ParamUse(nn.Embedding(3, 2), "weight")))
    assert not only_embedding_lookups([])
    assert not only_embedding_lookups(slots(ParamUse(lookup, "weight"), ParamUse(linear, "weight")))
    assert not only_embedding_lookups(slots(ParamUse(OwnLookup(4, 2), "weight")))  # a subclass may compute otherwise
    assert not only_embedding_lookups(slots(ParamUse(nn.Embedding(4, 2, sparse=True), "weight")))
    assert not only_embedding_lookups(slots(ParamUse(lookup, "weight"), tensor_parallel=object()))
    tied = [SimpleNamespace(uses=[ParamUse(lookup, "weight"), ParamUse(linear, "weight")], tensor_parallel=None)]
    assert not only_embedding_lookups(tied)
