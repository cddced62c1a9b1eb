"""The same-host exchange ([Note: the shared-memory exchange] in lightning_fsdp/engine/shared_memory.py) against
torch's own collectives on the same gloo group: tensors larger than a slot (several chunks), sizes that do not divide
a slot, bytes of any dtype, float64 sums; a wait that ends like a gloo collective's (at the group's timeout, or as
soon as the rank it waits for has gone); and every way it must decline: a ``/dev/shm`` that is not shared, none at
all, a processor whose memory order the counters cannot rely on, the switch, another thread."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp.engine import shared_memory
from lightning_fsdp.engine.comm import Communicator, wait_works
from lightning_fsdp.engine.shared_memory import slot_bytes
from tests.toolbox.distributed import run_distributed


def _arena_files() -> set[str]:
    return {name for name in os.listdir(shared_memory.SHARED_MEMORY_DIR) if name.startswith("lightning_fsdp_")}


def _against_torch(rank: int, world_size: int) -> dict:
    before = _arena_files()
    comm = Communicator(None)
    assert comm.use_shared_memory()
    exchange = comm.exchange
    assert exchange is not None
    dist.barrier()  # rank 0 unlinks right after the last collective of the set-up
    left = _arena_files() - before
    g = torch.Generator().manual_seed(100 + rank)
    counted = 0
    # 3 slots and a bit per rank (4 chunks), one slot exactly, a few odd elements; float32, bfloat16 and int64 bytes.
    slot = slot_bytes(world_size)
    assert exchange.slot_bytes == slot == 8 * 2**20 // (world_size // 2)  # 64 MiB over 4 buffers of N slots
    for numel, dtype in ((3 * slot // 4 + 7, torch.float32), (slot // 2, torch.bfloat16), (5, torch.int64)):
        shard = (torch.randn(numel, generator=g) * 100).to(dtype)
        got = torch.full((world_size * numel,), -1).to(dtype)
        wait_works(exchange.all_gather(got, shard))
        expected = torch.empty_like(got)
        dist.all_gather_into_tensor(expected, shard)
        assert torch.equal(got, expected), (numel, dtype)
        counted += 1
    # Reductions: more than a slot per region, an odd count, float64; torch's reduce-scatter as the reference.
    for numel, dtype in ((slot // 4 + 3, torch.float32), (11, torch.float32), (slot // 16, torch.float64)):
        full = torch.randn(world_size * numel, generator=g, dtype=dtype)
        got = torch.full((numel,), float("nan"), dtype=dtype)
        comm.reduce_scatter(got, full.clone())  # through the Communicator: its float32/float64 route
        expected = torch.empty(numel, dtype=dtype)
        dist.reduce_scatter_tensor(expected, full.clone())
        if world_size == 2:
            assert torch.equal(got, expected), (numel, dtype)  # a + b either way
        else:
            torch.testing.assert_close(got, expected, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=1e-6)
        counted += 1
    # A thread other than the one that made it takes gloo (slots are not interleaved between threads).
    result: dict = {}

    def other_thread() -> None:
        result["usable"] = exchange.usable_here()
        shard = torch.full((4,), float(rank))
        out = torch.empty(4 * world_size)
        comm.all_gather(out, shard)
        result["gathered"] = out

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert not result["usable"]
    assert torch.equal(result["gathered"], torch.arange(world_size, dtype=torch.float32).repeat_interleave(4))
    return {"counted": counted, "left": left, "calls": comm.stats.reduce_scatter_calls}


@pytest.mark.parametrize("world_size", [2, 4])
def test_exchange_matches_torchs_collectives(world_size):
    results = run_distributed(_against_torch, world_size)
    assert [r["counted"] for r in results] == [6] * world_size
    assert [r["left"] for r in results] == [set()] * world_size
    assert [r["calls"] for r in results] == [3] * world_size


def _waited_out_of_order(rank: int, world_size: int) -> int:
    """A reduction issued first and waited last, after more gathers than the arena has buffers (each waited at once):
    its slots must be read before a later exchange reuses them. torch's collectives are the reference."""
    comm = Communicator(None)
    assert comm.use_shared_memory()
    g = torch.Generator().manual_seed(7 + rank)
    full = torch.randn(world_size * 1000, generator=g)
    reduced = torch.full((1000,), float("nan"))
    late = comm.reduce_scatter(reduced, full.clone(), async_op=True)
    compared = 0
    for i in range(2 * shared_memory.BUFFERS):
        shard = torch.randn(500, generator=g)
        got = torch.empty(world_size * 500)
        comm.all_gather(got, shard, async_op=True).wait()
        expected = torch.empty_like(got)
        dist.all_gather_into_tensor(expected, shard)
        assert torch.equal(got, expected), i
        compared += 1
    late.wait()
    expected = torch.empty(1000)
    dist.reduce_scatter_tensor(expected, full.clone())
    assert torch.equal(reduced, expected)
    return compared + 1


def test_a_reduction_waited_after_later_gathers_keeps_its_sum():
    assert run_distributed(_waited_out_of_order, 2) == [2 * shared_memory.BUFFERS + 1] * 2


def _rank_1_never_issues(rank: int, world_size: int, how: str) -> dict:
    """Rank 0 gathers; rank 1 set up the exchange but never issues: it stays (a hang) or closes its exchange, which
    releases its lock as its process ending would. Rank 0's wait must end by itself, naming why."""
    timeout_ms = 1000 if how == "stays" else 60_000
    exchange = shared_memory.SharedMemoryExchange.for_group(None, rank, list(range(world_size)), timeout_ms)
    assert exchange is not None
    seen: dict = {}
    if rank == 1:
        if how == "exits":
            exchange.close()
    else:
        started = time.monotonic()
        try:
            wait_works(exchange.all_gather(torch.empty(2 * world_size), torch.ones(2)))
        except RuntimeError as error:
            seen["error"] = str(error)
        seen["waited"] = time.monotonic() - started
    dist.barrier()  # through gloo: rank 1 stays until rank 0 has given up
    return seen


@pytest.mark.parametrize("how", ["stays", "exits"])
def test_a_wait_ends_at_the_timeout_or_when_the_rank_is_gone(how):
    seen = run_distributed(_rank_1_never_issues, 2, how)[0]
    assert "error" in seen, seen
    if how == "stays":
        assert "process group's timeout (1000 ms) for rank(s) [1]" in seen["error"], seen
        assert 1.0 <= seen["waited"] <= 4.0, seen  # the configured second, not torch's 30 minutes (slack for load)
    else:
        assert seen["error"].startswith("Rank(s) [1] exited while this rank waited"), seen
        assert seen["waited"] <= 5.0, seen  # at a liveness check (every 0.1 s), not at the 60 s timeout


def _declines(rank: int, world_size: int, case: str, folder: str) -> bool:
    if case == "weak memory order":
        shared_memory.platform.machine = lambda: "aarch64"
    elif case == "not shared":
        # Rank 1 looks in a /dev/shm of its own (another container of the host): it cannot open rank 0's file.
        if rank == 1:
            shared_memory.SHARED_MEMORY_DIR = folder
    elif case == "no /dev/shm":
        shared_memory.SHARED_MEMORY_DIR = os.path.join(folder, "missing")
    else:
        os.environ[shared_memory.SWITCH_VARIABLE] = "0"
    comm = Communicator(None)
    used = comm.use_shared_memory()
    assert (comm.exchange is not None) == used
    # The group still works, through gloo.
    out = torch.empty(2 * world_size)
    comm.all_gather(out, torch.full((2,), float(rank)))
    assert torch.equal(out, torch.tensor([0.0, 0, 1, 1]))
    return used


@pytest.mark.parametrize("case", ["not shared", "no /dev/shm", "weak memory order", "switched off"])
def test_exchange_declines_on_every_rank(case, tmp_path):
    before = _arena_files()
    assert run_distributed(_declines, 2, case, str(tmp_path)) == [False, False]
    assert _arena_files() == before  # the file rank 0 made for the unshared case is gone too
