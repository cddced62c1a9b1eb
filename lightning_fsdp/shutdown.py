"""Ending a gloo run without racing the process group's worker threads (a torch issue, worked around here).

A gloo collective runs on one of its process group's worker threads. When it completes, the caller may drop its
tensors at once; the worker then holds the last reference and has to take the GIL to free them. That is harmless
while the program runs (the main thread hands the GIL over within a few milliseconds), but not while it ends:

* ``torch.distributed.destroy_process_group`` joins the worker threads while holding the GIL. If a worker is
  waiting for the GIL at that moment, the process hangs (pytorch/pytorch#56297).
* At interpreter exit, a worker that asks for the GIL after finalization has begun is stopped inside C++ code:
  ``terminate called without an active exception`` and SIGABRT (exit code 134) after a run that succeeded
  (pytorch/pytorch#190489). A script that ends right after a collective, such as ``strategy.all_gather``, meets
  it: 5 exits in 160 on the 2-core test machine under load, none in 160 with the pause below.

Releasing the GIL for a moment first lets any worker still freeing a tensor finish. This narrows the race to a
worker that gets no CPU time for the whole pause; it cannot close it, as only torch can.
"""

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
