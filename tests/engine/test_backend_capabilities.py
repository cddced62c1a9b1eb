"""The capability table (lightning_fsdp/engine/backends.py) and the MPI backend.

- ``process_group_backend="mpi"`` is refused when the strategy is built where torch has no MPI backend, naming why
  and what to use instead, and accepted where it has one (``torch.distributed.is_mpi_available`` patched both ways,
  so the test means the same on any torch build).
- The table's MPI row, run on gloo: in 2 gloo ranks the engine takes MPI's row, and torch's collectives are made to
  fail the way torch's MPI backend fails (``ProcessGroupMPI.cpp``: no ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor``, and only the dtypes of its MPI datatype map, written out here by hand). The engine must
  then train like one device (SGD with momentum, the same global batches, under anomaly checking so that its
  cross-rank check runs too, and read its full state for a checkpoint), and move bfloat16 tensors exactly through
  all-gather, broadcast, reduce-scatter and all-reduce.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lightning_fsdp  # noqa: F401  (registers "fsdp_custom")
from lightning_fsdp import FSDPStrategy
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM
from tests.toolbox.one_device import toy_lm_on_step_batches
from tests.toolbox.training import sgd_with_momentum, train_on_shares

STEPS = 3
WORLD = 2


# ------------------------------------------------------------------------------------ process_group_backend
@pytest.mark.parametrize("backend", ["mpi", "MPI", "cpu:mpi,cuda:nccl"])
def test_mpi_backend_refused_where_torch_has_none(monkeypatch, backend):
    monkeypatch.setattr(dist, "is_mpi_available", lambda: False)
    with pytest.raises(ValueError) as info:
        FSDPStrategy(process_group_backend=backend)
    message = str(info.value)
    for fragment in (f"process_group_backend={backend!r}", "is_mpi_available() is False", "mpirun", "'gloo'"):
        assert fragment in message, (fragment, message)
    assert "'nccl'" in message and "'hccl'" in message and "None" in message


def test_mpi_backend_accepted_where_torch_has_one(monkeypatch):
    monkeypatch.setattr(dist, "is_mpi_available", lambda: True)
    assert FSDPStrategy(process_group_backend="mpi").process_group_backend == "mpi"
    monkeypatch.setattr(dist, "is_mpi_available", lambda: False)
    assert FSDPStrategy(process_group_backend="gloo").process_group_backend == "gloo"  # only MPI needs it


# ------------------------------------------------------------------------------------ the MPI row on gloo
# torch's ProcessGroupMPI maps these dtypes to MPI datatypes (kByte, kChar, kShort, kInt, kLong, kFloat, kDouble).
MPI_CARRIES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64}
MPI_LACKS = (
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce_scatter",
)


def imitate_mpi() -> Counter:
    """In this rank: the engine's gloo groups get MPI's row of the table, and ``torch.distributed`` refuses what
    torch's MPI backend refuses. Returns the count of each collective issued, by name and dtype."""
    from lightning_fsdp.engine import backends

    backends.TABLE["gloo"] = backends.TABLE["mpi"]
    issued: Counter = Counter()

    def lacking(name: str):
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"ProcessGroupMPI does not support {name}")

        return refuse

    def carrying(name: str, collective):
        def checked(*args: Any, **kwargs: Any) -> Any:
            tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
            for tensor in tensors:
                if tensor.dtype not in MPI_CARRIES:
                    raise RuntimeError(f"MPI has no datatype for {tensor.dtype} ({name})")
            issued[(name, str(tensors[0].dtype))] += 1
            return collective(*args, **kwargs)

        return checked

    for name in MPI_LACKS:
        if hasattr(dist, name):
            setattr(dist, name, lacking(name))
    for name in ("broadcast", "all_gather", "all_to_all_single", "all_reduce"):
        setattr(dist, name, carrying(name, getattr(dist, name)))
    return issued


def _values(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s bfloat16 input: a function of the rank alone, so every process can compute every rank's."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=g).to(torch.bfloat16)


def _on_mpi_row(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_fsdp.checkpoint.full import full_model_state_dict
    from lightning_fsdp.engine import fully_shard
    from lightning_fsdp.engine.comm import Communicator
    from lightning_fsdp.engine.shared_memory import SWITCH_VARIABLE

    issued = imitate_mpi()
    # The forms of MPI's row are the subject: the same-host exchange, which would replace them here, stays off.
    os.environ[SWITCH_VARIABLE] = "0"
    torch.manual_seed(0)
    model = ToyLM(dim=16)
    engine = fully_shard(model, auto_wrap_policy={Block})
    with torch.autograd.detect_anomaly(check_nan=False):  # the engine's agree() gathers before every collective
        train_on_shares(model, sgd_with_momentum(model.parameters()), STEPS, 8, rank, world_size)
    training = dict(issued)
    with engine.unsharded():
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    checkpoint = full_model_state_dict(engine, rank0_only=False)

    comm = Communicator()  # the default group: gloo, so MPI's row
    shard = _values(rank, 6)
    gathered = torch.empty(6 * world_size, dtype=torch.bfloat16)
    comm.all_gather(gathered, shard)
    full = _values(10 + rank, 6 * world_size)
    scattered = torch.empty(6, dtype=torch.bfloat16)
    comm.reduce_scatter(scattered, full)
    reduced = full.clone()
    comm.all_reduce(reduced)
    broadcast = _values(rank, 6)
    comm.broadcast(broadcast, src_rank=0)
    return {
        "training_collectives": training,
        "params": params,
        "checkpoint": {k: v.clone() for k, v in checkpoint.items()},
        "gathered": gathered,
        "scattered": scattered,
        "reduced": reduced,
        "broadcast": broadcast,
    }


def test_mpi_row_on_gloo_trains_like_one_device_and_carries_bfloat16():
    results = run_distributed(_on_mpi_row, WORLD)
    expected = toy_lm_on_step_batches(STEPS, 8, dim=16).parameters()
    compared = 0
    for rank, result in enumerate(results):
        # Training used MPI's forms only: list all-gathers and all-to-all reductions, no broadcast gathers (the
        # flat collectives would have raised).
        kinds = {name for name, _dtype in result["training_collectives"]}
        assert {"all_gather", "all_to_all_single"} <= kinds and "broadcast" not in kinds, result["training_collectives"]
        assert sorted(result["params"]) == sorted(expected)
        for name, want in expected.items():
            torch.testing.assert_close(result["params"][name], want, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
            torch.testing.assert_close(
                result["checkpoint"][name], want, rtol=1e-5, atol=1e-6, msg=f"checkpoint rank {rank} {name}"
            )
            compared += 2
        # bfloat16 through MPI's dtypes: data moved bit for bit, sums rounded once from float32.
        assert torch.equal(result["gathered"], torch.cat([_values(r, 6) for r in range(WORLD)]))
        assert torch.equal(result["broadcast"], _values(0, 6))
        total = sum(_values(10 + r, 6 * WORLD).float() for r in range(WORLD))
        assert torch.equal(result["reduced"], total.to(torch.bfloat16))
        assert torch.equal(result["scattered"], total[rank * 6 : (rank + 1) * 6].to(torch.bfloat16))
        assert result["gathered"].dtype == result["reduced"].dtype == torch.bfloat16
    assert compared == WORLD * 2 * 14  # every parameter of ToyLM (the tied head once), on every rank, twice
    # The comparison is of trained values: training moved (almost) every parameter away from the initialisation.
    torch.manual_seed(0)
    start = dict(ToyLM(dim=16).named_parameters())
    moved = sum(int(not torch.equal(start[k], v)) for k, v in expected.items())
    assert moved >= 12, moved
