"""The stream path on a real CUDA device (see [Note: collectives on their own streams]); skipped without one.

World size 1 (gloo; the engine's collectives are then copies on the side streams) in one spawned process per test
module, and, where two GPUs are present, 2 NCCL ranks. Against plain unsharded training of the same model from the
same seed on the same batches: fp32 parity with tight tolerances, with and without prefetching, with the side
streams slowed down (``torch.cuda._sleep`` queued before every collective, so that a missing wait shows as wrong
numbers instead of a lucky race), bf16 within bf16 rounding, and cpu_offload with pinned host shards and gradients.
The counters show the collectives ran on the side streams and the events were recorded there.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections import Counter
from typing import Any

import pytest
import torch

from lightning_fsdp import MixedPrecision
from lightning_fsdp.engine import fully_shard
from lightning_fsdp.engine.streams import CollectiveStreams
from lightning_fsdp.engine.unit import FlatUnit
from tests.toolbox.compare import assert_all_close
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 3
SLOW = 2_000_000  # GPU cycles slept on the side stream before each collective (about a millisecond)
TOL = {"rtol": 1e-5, "atol": 1e-6}  # CUDA's embedding backward adds in no fixed order


class CountingStreams(CollectiveStreams):
    """The device's real streams; counts the events recorded on each side stream."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.events: Counter = Counter()

    def record_event(self) -> Any:
        self.events[self.which(self.current_stream())] += 1
        return super().record_event()

    def which(self, stream: Any) -> str:
        if stream == self.all_gather_stream:
            return "all_gather"
        return "reduce_scatter" if stream == self.reduce_scatter_stream else "compute"


def _instrument(engine: Any, slow: int) -> tuple[CountingStreams, Counter]:
    """Give ``engine`` counting streams; every collective notes the stream it is issued on and, with ``slow``, first
    queues a sleep there."""
    streams = CountingStreams(engine.root_unit.device)
    engine._use_streams(streams)
    issued: Counter = Counter()
    comm = engine.shard_comm
    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        method = getattr(comm, name)

        def collective(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            issued[(_name, streams.which(torch.cuda.current_stream()))] += 1
            if slow:
                torch.cuda._sleep(slow)
            return _method(*args, **kwargs)

        setattr(comm, name, collective)
    return streams, issued


def _train(model: torch.nn.Module, rank: int, world_size: int, device: torch.device) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, size=4)
        x, y = x[rank::world_size].to(device), y[rank::world_size].to(device)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if step < STEPS - 1:  # the last step's gradients stay, to be looked at
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _params(model: torch.nn.Module, engine: Any = None) -> dict[str, torch.Tensor]:
    if engine is None:
        return {k: v.detach().float().cpu().clone() for k, v in model.named_parameters()}
    with engine.unsharded():
        return {k: v.detach().float().cpu().clone() for k, v in model.named_parameters()}


def _plain(device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ToyLM(dim=6).to(device)
    return {"losses": _train(model, 0, 1, device), "params": _params(model)}


def _sharded(rank: int, world_size: int, device: torch.device, *, slow: int = 0, direct: int | None = None, **options):
    default = FlatUnit.direct_gather_min_numel
    FlatUnit.direct_gather_min_numel = direct or default
    try:
        torch.manual_seed(0)
        model = ToyLM(dim=6).to(device)
        engine = fully_shard(model, auto_wrap_policy={Block}, device=device, **options)
        streams, issued = _instrument(engine, slow)
        losses = _train(model, rank, world_size, device)
        units = engine.units
        result = {
            "losses": losses,
            "active": engine.streams.active,
            "events": dict(streams.events),
            "issued": dict(issued),
            "shards_pinned": [u.flat_shard.is_pinned() for u in units],
            "params_pinned": [p.is_pinned() for p in model.parameters()],
            "grads_pinned": [p.grad.is_pinned() for p in model.parameters() if p.grad is not None],
            "grad_devices": sorted({str(p.grad.device) for p in model.parameters() if p.grad is not None}),
            "priorities": [streams.all_gather_stream.priority, streams.reduce_scatter_stream.priority],
        }
        result["params"] = _params(model, engine)
        return result
    finally:
        FlatUnit.direct_gather_min_numel = default


CASES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "fp32, prefetching both ways, in place": {"forward_prefetch": True, "direct": 1},
    "fp32, slow side streams": {"forward_prefetch": True, "slow": SLOW},
    "fp32, slow side streams, in place": {"forward_prefetch": True, "slow": SLOW, "direct": 1},
    "bf16": {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16), "forward_prefetch": True},
    "bf16, fp32 reduction, slow": {
        "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "slow": SLOW,
    },
    "cpu_offload": {"cpu_offload": True},
    "cpu_offload, slow side streams": {"cpu_offload": True, "slow": SLOW, "forward_prefetch": True},
}


def _one_gpu(rank: int, world_size: int) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    results = {"plain": _plain(device)}
    for name, options in CASES.items():
        results[name] = _sharded(rank, world_size, device, **options)
    return results


@pytest.fixture(scope="module")
def one_gpu() -> dict[str, Any]:
    return run_distributed(_one_gpu, 1)[0]


def _assert_close(result: dict, reference: dict, **tol: float) -> int:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), **tol)
    return assert_all_close(result["params"], reference["params"], "stream path vs plain", **tol)


FP32 = [name for name in CASES if name.startswith(("fp32", "cpu_offload"))]


@pytest.mark.parametrize("case", FP32)
def test_fp32_stream_path_equals_plain_training(one_gpu, case):
    result = one_gpu[case]
    assert result["active"]
    assert _assert_close(result, one_gpu["plain"], **TOL) == 14  # ToyLM's parameters, the tied weight once
    # The comparison is between trained models: the embedding moved.
    torch.manual_seed(0)
    assert not torch.equal(one_gpu["plain"]["params"]["emb.weight"], ToyLM(dim=6).emb.weight.detach())


@pytest.mark.parametrize("case", list(CASES))
def test_collectives_ran_on_the_side_streams(one_gpu, case):
    result = one_gpu[case]
    issued, events = result["issued"], result["events"]
    assert issued and all(
        where == ("all_gather" if name == "all_gather" else "reduce_scatter") for name, where in issued
    ), issued
    # FULL_SHARD, 3 units: one reduction per unit and step, each with one event on the reduce-scatter stream; at
    # least one unshard per unit and step, each with one event on the all-gather stream; none on the compute stream.
    assert events.get("reduce_scatter") == 3 * STEPS, events
    assert events.get("all_gather", 0) >= 3 * STEPS and "compute" not in events, events
    assert all(priority < 0 for priority in result["priorities"])  # higher than the default stream's 0


def test_bf16_stream_path_within_bf16_rounding(one_gpu):
    reference = one_gpu["plain"]["losses"]
    for case in ("bf16", "bf16, fp32 reduction, slow"):
        losses = one_gpu[case]["losses"]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert max(abs(a - b) for a, b in zip(losses, reference)) < 0.05, (case, losses, reference)


def test_cpu_offload_pins_host_shards_and_gradients(one_gpu):
    for case in ("cpu_offload", "cpu_offload, slow side streams"):
        result = one_gpu[case]
        assert all(result["shards_pinned"]) and all(result["params_pinned"]), case
        assert result["grads_pinned"] and all(result["grads_pinned"]), case  # the reduced gradients' host buffers
        assert result["grad_devices"] == ["cpu"], case
        _assert_close(result, one_gpu["fp32"], **TOL)
    assert not any(one_gpu["fp32"]["shards_pinned"])  # nothing pinned without offload


# ---------------------------------------------------------------------------------------- 2 GPUs, NCCL
NCCL_CASES = ("fp32, slow side streams", "fp32, slow side streams, in place", "cpu_offload, slow side streams")


def _nccl_worker(rank: int, world_size: int, folder: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.distributed.init_process_group(
        "nccl", init_method=f"file://{folder}/store", rank=rank, world_size=world_size, device_id=device
    )
    try:
        results = {"plain": _plain(device)}
        for name in NCCL_CASES:
            results[name] = _sharded(rank, world_size, device, **CASES[name])
        outcome: Any = ("ok", results)
    except BaseException:  # noqa: BLE001 - reported to the parent
        outcome = ("error", traceback.format_exc())
    torch.save(outcome, os.path.join(folder, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_collectives_on_the_side_streams_equal_plain_training():
    """2 ranks: NCCL's collectives issued inside the side streams and waited for there, slowed down; each rank's
    half of every batch, so the average of the ranks' gradients is the full batch's (the reference's)."""
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.start_processes(_nccl_worker, args=(2, folder), nprocs=2, start_method="spawn")
        outcomes = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for status, value in outcomes:
        assert status == "ok", value
    per_rank = [value for _status, value in outcomes]
    reference = per_rank[0]["plain"]  # the whole batch on one GPU (both ranks computed it)
    for name in NCCL_CASES:
        for results in per_rank:
            assert results[name]["active"] and results[name]["issued"], name
        # Each rank trains on its half of every batch: the mean of the halves' losses is the whole batch's.
        mean = torch.tensor([results[name]["losses"] for results in per_rank]).mean(0)
        torch.testing.assert_close(mean, torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5, msg=name)
        for results in per_rank:
            for key, value in reference["params"].items():
                torch.testing.assert_close(results[name]["params"][key], value, rtol=1e-5, atol=1e-5, msg=name)
