"""Starting ranks and cleaning up after them: one harness for the benchmarks and the tests.

Ranks started here, with torch.multiprocessing's ``spawn``: each runs a function of this repository, sets its
thread counts and joins a gloo group over a ``file://`` rendezvous (:func:`join_gloo_group`). :func:`run_ranks` is
the whole round trip (environment, spawn, deadline, each rank's JSON result or its error); :func:`spawn_ranks`,
:func:`wait_ranks` and :func:`kill_ranks` are its parts, for a caller that watches its ranks in its own way.
Spawned ranks import what the parent imported from the parent's ``sys.path``, so a benchmark started from the
repository root needs no ``PYTHONPATH``.

Ranks started as commands (a Lightning script, torchrun), which the tests run in a session of their own:
:func:`clean_env` (no launcher's variables, the repository importable), :func:`free_port`, and the process group's
members (:func:`group_members`) or its end (:func:`kill_group`), so that nothing is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


# ------------------------------------------------------------------------------------- ranks as commands
def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (pytest itself may run under SLURM or torchrun), one
    thread per process, the repository importable, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            found.append(int(entry.name))
    return found


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_logged(cmd: list[str], log: Path, env: dict[str, str], cwd: Path, timeout: float) -> int | None:
    """Run ``cmd`` (a launch: rank 0, which Lightning's launcher makes start the others) in a session of its own,
    its output into ``log``; its whole process group killed when it ends or outlives ``timeout``. The exit status,
    or None on a timeout."""
    with open(log, "wb") as output:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            kill_group(proc.pid)
            proc.wait()


# ----------------------------------------------------------------------------------------- spawned ranks
def quiet_env(threads: int) -> dict[str, str]:
    """A benchmark rank's environment: ``threads`` threads for every thread pool, and no profiler or c10 chatter."""
    return {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "KINETO_LOG_LEVEL": "5",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in this process for the duration: a spawned rank takes the environment of the moment it starts."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn_ranks(worker: Callable[..., None], args: tuple, nprocs: int) -> Any:
    """Start ``worker(rank, *args)`` in ``nprocs`` fresh interpreters; returns torch's process context (not joined)."""
    import torch.multiprocessing as mp

    return mp.start_processes(worker, args=args, nprocs=nprocs, start_method="spawn", join=False)


def wait_ranks(context: Any, stop: Callable[[], str | None] = lambda: None) -> str | None:
    """Join the ranks, asking ``stop`` once a second whether to give up on them. Returns None when every rank exited
    cleanly; otherwise kills the ranks and returns why: ``stop``'s answer, or a rank's error (its traceback)."""
    while True:
        try:
            if context.join(timeout=1.0):
                return None
        except Exception as error:  # noqa: BLE001 - a rank raised or died (signal): its text is the answer
            kill_ranks(context)
            return f"process failed: {str(error).strip()}"
        reason = stop()
        if reason is not None:
            kill_ranks(context)
            return reason


def kill_ranks(context: Any) -> None:
    for process in context.processes:
        if process.is_alive():
            process.kill()
    for process in context.processes:
        process.join(timeout=10)


def join_gloo_group(folder: str, rank: int, world: int, *, threads: int = 1, timeout: float | None = None) -> None:
    """A spawned rank's set-up: its thread counts, then the gloo group of all ranks (``file://`` rendezvous in
    ``folder``); ``timeout`` seconds for each collective (gloo's default if None)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the inter-op pool already started (the rank ran a parallel op first): keep it
        pass
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=None if timeout is None else timedelta(seconds=timeout),
    )


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write whole or not at all: the parent may poll for the file while the ranks run."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(payload))
    os.replace(partial, path)


def report_rank(folder: str, rank: int, compute: Callable[[], dict[str, Any]]) -> None:
    """A spawned rank's end: ``compute()``'s result written as ``rank{rank}.json``, or its traceback as
    ``error{rank}.txt`` (then raised again), and the default process group destroyed either way."""
    from lightning_fsdp.shutdown import destroy_process_group

    try:
        write_json(Path(folder, f"rank{rank}.json"), compute())
    except BaseException:
        Path(folder, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        destroy_process_group()


def run_ranks(
    worker: Callable[..., None],
    args_of: Callable[[str], tuple],
    nprocs: int,
    *,
    threads: int,
    timeout: float,
    name: str,
) -> list[dict[str, Any]]:
    """Spawn ``nprocs`` processes of ``worker(rank, *args_of(folder))`` with ``threads`` threads each, wait for them
    (at most ``timeout`` seconds), and return the ``rank{r}.json`` each wrote into ``folder``. A rank that fails
    writes ``error{r}.txt`` (:func:`report_rank` does both); the first one's text goes into the RuntimeError."""
    with environment(quiet_env(threads)), tempfile.TemporaryDirectory(prefix="lfsdp-bench-") as folder:
        context = spawn_ranks(worker, args_of(folder), nprocs)
        deadline = time.time() + timeout
        problem = wait_ranks(context, lambda: f"timed out after {timeout:.0f} s" if time.time() > deadline else None)
        files = [Path(folder, f"rank{r}.json") for r in range(nprocs)]
        if problem is not None or not all(f.exists() for f in files):
            errors = [p.read_text() for p in sorted(Path(folder).glob("error*.txt"))]
            problem = problem or "a rank exited without its results"
            raise RuntimeError(f"{name} failed: {problem}" + ("\n" + errors[0] if errors else ""))
        return [json.loads(f.read_text()) for f in files]
