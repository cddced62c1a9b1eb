"""lightning_fsdp.shutdown: the pause that lets gloo's worker threads free their tensors before a group goes away.

The race itself (a worker thread asking for the GIL while the main thread destroys its group, or after finalization
began) needs an unlucky schedule and cannot be forced from Python; docs/reliability.md gives the measured rates.
These tests check the parts that can be: the pause releases the GIL, the exit hook is registered once, and the
destroy helper destroys.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from lightning_fsdp import shutdown


def test_settle_releases_the_gil_for_the_pause():
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    thread = threading.Thread(target=count)
    thread.start()
    try:
        time.sleep(0.01)  # let the thread start
        before = ticks
        started = time.perf_counter()
        shutdown.settle_collective_threads()
        elapsed = time.perf_counter() - started
        during = ticks - before
    finally:
        stop.set()
        thread.join()
    assert elapsed >= shutdown.SETTLE_S
    # A pure-Python loop gets through many iterations only while this thread does not hold the GIL.
    assert during > 1000, during


def test_exit_hook_is_registered_once(monkeypatch):
    registered = []
    monkeypatch.setattr(shutdown.atexit, "register", registered.append)
    monkeypatch.setattr(shutdown, "_settle_registered", False)
    for _ in range(3):
        shutdown.settle_at_exit()
    assert registered == [shutdown._settle_if_initialized]


def test_destroy_process_group_destroys_after_the_pause(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(3))  # a collective whose tensor Python drops at once, as in a real run
        started = time.perf_counter()
        shutdown.destroy_process_group()
        assert time.perf_counter() - started >= shutdown.SETTLE_S
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
