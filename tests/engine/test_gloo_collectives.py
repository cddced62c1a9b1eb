"""On a gloo group of CPU tensors the engine all-gathers by broadcasts and reduce-scatters float32 by an all-to-all
and a local sum (see [Note: collectives on gloo] in lightning_fsdp/engine/comm.py). Trained side by side with an
engine that uses torch's own ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, the model must come out the same:
bit for bit on 2 ranks (a + b is b + a), to float32 rounding on 4, with the same bytes counted."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp.engine import fully_shard
from lightning_fsdp.engine.backends import FLAT, TABLE
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM
from tests.toolbox.training import sgd_with_momentum, train_on_shares

STEPS = 3


def _train(rank: int, world_size: int, torch_collectives: bool) -> tuple[dict, tuple[int, int], bool]:
    torch.manual_seed(0)
    model = ToyLM(dim=16)
    engine = fully_shard(model, auto_wrap_policy={Block})
    comm = engine.shard_comm
    used_gloo_forms = comm.forms is TABLE["gloo"]
    if torch_collectives:
        comm.forms = FLAT
    train_on_shares(model, sgd_with_momentum(model.parameters()), STEPS, 8, rank, world_size)
    with engine.unsharded():
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return params, (comm.stats.all_gather_bytes, comm.stats.reduce_scatter_bytes), used_gloo_forms


def _both(rank: int, world_size: int):
    return _train(rank, world_size, False), _train(rank, world_size, True)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_forms_train_as_torchs_collectives(world_size):
    compared = 0
    for (mine, mine_bytes, used), (torchs, torch_bytes, _) in run_distributed(_both, world_size):
        assert used  # the default engine did take the gloo forms
        assert mine_bytes == torch_bytes and min(mine_bytes) > 0
        assert sorted(mine) == sorted(torchs)
        for name, value in mine.items():
            if world_size == 2:
                assert torch.equal(value, torchs[name]), name
            else:
                torch.testing.assert_close(value, torchs[name], rtol=1e-6, atol=1e-7)
            compared += 1
    assert compared == world_size * 14  # every parameter of ToyLM (the tied head once), on every rank
