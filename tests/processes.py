"""Helpers for tests that start their own processes: a clean environment, a free port, and process groups that can
be checked and killed as a whole (every job starts in a session of its own, so nothing is left behind)."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (pytest itself may run under SLURM or torchrun), one
    thread per process, the repository importable, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))
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
