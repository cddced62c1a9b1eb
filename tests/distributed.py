"""Run a function in N gloo processes on CPU and collect what each rank returns.

Each worker joins a ``file://`` rendezvous, runs with one thread (two cores are shared by every process), and
writes its return value to disk; an exception in any rank fails the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_fsdp.shutdown import destroy_process_group


def _worker(rank: int, world_size: int, folder: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
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
        mp.start_processes(_worker, args=(world_size, folder, fn, args), nprocs=world_size, start_method="spawn")
        results = []
        for rank in range(world_size):
            with open(f"{folder}/result-{rank}.pkl", "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
