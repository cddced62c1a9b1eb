"""Run a function in N gloo processes on CPU and collect what each rank returns.

Each worker joins a ``file://`` rendezvous, runs with one thread (two cores are shared by every process), and
writes its return value to disk; an exception in any rank fails the caller with that rank's traceback. The ranks
are started and joined by the benchmarks' harness (benchmarks/ranks.py).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks.ranks import join_gloo_group, spawn_ranks, wait_ranks
from lightning_fsdp.shutdown import destroy_process_group


def _worker(rank: int, world_size: int, folder: str, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    join_gloo_group(folder, rank, world_size)
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    with open(f"{folder}/result-{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each of ``world_size`` processes; returns the per-rank results."""
    with tempfile.TemporaryDirectory() as folder:
        problem = wait_ranks(spawn_ranks(_worker, (world_size, folder, fn, args), world_size))
        if problem is not None:
            raise RuntimeError(problem)
        results = []
        for rank in range(world_size):
            with open(f"{folder}/result-{rank}.pkl", "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
