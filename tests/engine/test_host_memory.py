"""engine/host_memory.py: glibc's free heap memory is given back to the kernel once there is enough of it, and left
alone below the threshold ([Note: returning freed host memory])."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp.engine import host_memory
from lightning_fsdp.engine.devices import device_runtime

pytestmark = pytest.mark.skipif(host_memory._GLIBC is None, reason="glibc (mallinfo2, malloc_trim) only")

MIB = 2**20


def _anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _heap_holes(count: int) -> torch.Tensor:
    """Free ``count`` MiB inside glibc's heap: 1 MiB tensors (under the mmap threshold once a larger block was freed),
    all freed but the last, which keeps glibc from trimming the heap's top by itself. Returns the one kept."""
    large = torch.ones(8 * MIB // 4)
    del large  # freeing a mapped 8 MiB block raises glibc's mmap threshold to 8 MiB
    blocks = [torch.ones(MIB // 4) for _ in range(count)]
    keep = torch.ones(MIB // 4)
    del blocks
    return keep


def test_free_heap_memory_is_returned_from_the_threshold_on():
    keep = _heap_holes(128)
    before = _anon()
    free = host_memory.return_free_heap_memory(at_least=64 * MIB)
    after = _anon()
    assert free >= 100 * MIB, free
    assert before - after >= 64 * MIB, (before, after)  # the holes' pages went back to the kernel
    del keep


def test_below_the_threshold_nothing_is_returned():
    keep = _heap_holes(128)
    before = _anon()
    free = host_memory.return_free_heap_memory(at_least=free_bytes() + MIB)
    assert abs(_anon() - before) < 16 * MIB  # nothing given back
    assert free < free_bytes() + MIB
    del keep


def free_bytes() -> int:
    assert host_memory._GLIBC is not None
    return int(host_memory._GLIBC.mallinfo2().fordblks)


def test_the_cpu_runtime_returns_memory_and_others_do_nothing(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr("lightning_fsdp.engine.devices.return_free_heap_memory", lambda: calls.append(1) or 0)
    device_runtime("cpu").return_free_memory()
    device_runtime("meta").return_free_memory()  # the default runtime: nothing
    assert calls == [1]
