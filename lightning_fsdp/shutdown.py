"""Ending a gloo run without racing the process group's worker threads (pytorch/pytorch#56297, #190489).

A worker thread freeing a finished collective's tensors needs the GIL: asked during ``destroy_process_group`` it
hangs, after finalization it aborts (134). Releasing the GIL briefly first narrows the race; only torch can close it
(docs/reliability.md)."""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

SETTLE_S = 0.05  # seconds the GIL is released for; a worker normally needs microseconds

_settle_registered = False


def settle_collective_threads() -> None:
    """Release the GIL briefly so that gloo worker threads finish freeing the tensors of completed collectives."""
    time.sleep(SETTLE_S)


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """``torch.distributed.destroy_process_group(group)``, after the pause that makes the hang above unlikely."""
    settle_collective_threads()
    dist.destroy_process_group(group)


def settle_at_exit() -> None:
    """Settle the worker threads when the interpreter exits, before finalization (registered once per process)."""
    global _settle_registered
    if not _settle_registered:
        _settle_registered = True
        atexit.register(_settle_if_initialized)


def _settle_if_initialized() -> None:
    if dist.is_available() and dist.is_initialized():
        settle_collective_threads()
