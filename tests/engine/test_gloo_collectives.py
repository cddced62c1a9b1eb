"""On a gloo group of CPU tensors the engine all-gathers by broadcasts and reduce-scatters float32 by an all-to-all
and a local sum (see [Note: collectives on gloo] in lightning_fsdp/engine/comm.py). Trained side by side with an
engine that uses torch's own ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, the model must come out the same:
bit for bit on 2 ranks (a + b is b + a), to float32 rounding on 4, with the same bytes counted. The engine's default
on one host, the shared-memory exchange (lightning_fsdp/engine/shared_memory.py), is held to the same reference."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lightning_fsdp.engine import fully_shard
from lightning_fsdp.engine.backends import FLAT, TABLE
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM
from tests.toolbox.training import sgd_with_momentum, train_on_shares

STEPS = 3


PATHS = ("shared memory", "gloo forms", "torch's collectives")


def _train(rank: int, world_size: int, path: str) -> tuple[dict, tuple[int, int], bool]:
    torch.manual_seed(0)
    model = ToyLM(dim=16)
    engine = fully_shard(model, auto_wrap_policy={Block})
    comm = engine.shard_comm
    # The default engine takes the same-host exchange over the gloo row of the table.
    default = comm.forms is TABLE["gloo"] and comm.exchange is not None
    if path != "shared memory":
        comm.exchange = None
    if path == "torch's collectives":
        comm.forms = FLAT
    train_on_shares(model, sgd_with_momentum(model.parameters()), STEPS, 8, rank, world_size)
    with engine.unsharded():
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return params, (comm.stats.all_gather_bytes, comm.stats.reduce_scatter_bytes), default


def _every_path(rank: int, world_size: int):
    return [_train(rank, world_size, path) for path in PATHS]


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_forms_and_shared_memory_train_as_torchs_collectives(world_size):
    compared = 0
    for runs in run_distributed(_every_path, world_size):
        torchs, torch_bytes, _ = runs[-1]
        for mine, mine_bytes, default in runs[:-1]:
            assert default
            assert mine_bytes == torch_bytes and min(mine_bytes) > 0
            assert sorted(mine) == sorted(torchs)
            for name, value in mine.items():
                if world_size == 2:
                    assert torch.equal(value, torchs[name]), name
                else:
                    torch.testing.assert_close(value, torchs[name], rtol=1e-6, atol=1e-7)
                compared += 1
    # Every parameter of ToyLM (the tied head once), on every rank, for both of the engine's own paths.
    assert compared == 2 * world_size * 14


def resident_peak_growth(fn) -> int:
    """Bytes the process's resident peak (``VmHWM``, reset first through ``/proc/self/clear_refs``) rose over its
    resident set while ``fn()`` ran."""

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def _reductions(rank: int, world_size: int) -> dict:
    """One reduction of each size through the engine's ``Communicator`` (the in-place all-reduce from
    ``IN_PLACE_REDUCE_BYTES`` on, the all-to-all below) and through torch's ``reduce_scatter_tensor``, with the
    process's resident peak growth during each of the large one's forms."""
    from lightning_fsdp.engine.comm import IN_PLACE_REDUCE_BYTES, Communicator

    torch.set_num_threads(1)
    comm = Communicator(None)
    out: dict = {}
    for name, numel in (("small", 3 * 2**20 // 4), ("large", 2 * IN_PLACE_REDUCE_BYTES // 4)):
        numel -= numel % world_size
        g = torch.Generator().manual_seed(rank)
        full = torch.randn(numel, generator=g)
        expected = torch.empty(numel // world_size)
        torch.distributed.reduce_scatter_tensor(expected, full.clone())
        got, reduced = torch.zeros_like(expected), full.clone()
        growth = resident_peak_growth(partial(comm.reduce_scatter, got, reduced))
        out[name] = (got, expected, growth)
    # The all-to-all form at the large size, for its memory: the receive buffer the in-place form does without.
    large, got = full.clone(), torch.zeros_like(got)
    out["all_to_all_growth"] = resident_peak_growth(partial(comm.reduce_scatter_wide, got, large, large.dtype))
    out["calls"] = comm.stats.reduce_scatter_calls
    return out


def test_a_large_reduction_runs_in_place():
    # [Note: a large reduction in place]: the same sums as torch's reduce-scatter, without a full-size receive buffer.
    from lightning_fsdp.engine.comm import IN_PLACE_REDUCE_BYTES

    # 2 ranks: a + b either way, so bit for bit (the 4-rank sums differ only in their order, as for the forms above).
    for result in run_distributed(_reductions, 2):
        for name in ("small", "large"):
            got, expected, _ = result[name]
            assert got.numel() > 0 and torch.equal(got, expected), name
        assert result["calls"] == 3
        # The all-to-all's receive buffer is the full tensor (64 MiB); the in-place form allocates none of it.
        in_place, all_to_all = result["large"][2], result["all_to_all_growth"]
        assert all_to_all - in_place >= IN_PLACE_REDUCE_BYTES, (in_place, all_to_all)
