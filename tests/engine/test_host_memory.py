"""engine/host_memory.py: glibc's free heap memory is given back to the kernel once there is enough of it, and left
alone below the threshold or when the backward allocates no block glibc always maps afresh ([Note: returning freed
host memory])."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_fsdp.engine import host_memory
from lightning_fsdp.engine.devices import device_runtime

pytestmark = pytest.mark.skipif(host_memory._GLIBC is None, reason="glibc (mallinfo2, malloc_trim) only")

MIB = 2**20
LARGE_BLOCK = 32 * MIB  # glibc's highest mmap threshold on 64-bit: such blocks never reuse freed heap memory


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
    free = host_memory.return_free_heap_memory(LARGE_BLOCK, at_least=64 * MIB)
    after = _anon()
    assert free >= 100 * MIB, free
    assert before - after >= 64 * MIB, (before, after)  # the holes' pages went back to the kernel
    del keep


def test_below_the_threshold_nothing_is_returned():
    keep = _heap_holes(128)
    before = _anon()
    free = host_memory.return_free_heap_memory(LARGE_BLOCK, at_least=free_bytes() + MIB)
    assert abs(_anon() - before) < 16 * MIB  # nothing given back
    assert free < free_bytes() + MIB
    del keep


def free_bytes() -> int:
    assert host_memory._GLIBC is not None
    return int(host_memory._GLIBC.mallinfo2().fordblks)


def test_smaller_blocks_leave_the_heap_alone():
    """Blocks under glibc's highest mmap threshold are carved out of the freed memory: trimming would only make the
    next forward fault those pages in again, so nothing is looked at or returned, however much is free."""
    keep = _heap_holes(128)
    before = _anon()
    assert host_memory.return_free_heap_memory(LARGE_BLOCK - 1, at_least=64 * MIB) == 0
    assert abs(_anon() - before) < 16 * MIB
    assert free_bytes() >= 100 * MIB  # the holes are still there
    del keep


def test_the_cpu_runtime_returns_memory_and_others_do_nothing(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr("lightning_fsdp.engine.devices.return_free_heap_memory", lambda largest: calls.append(largest))
    device_runtime("cpu").return_free_memory(LARGE_BLOCK)
    device_runtime("meta").return_free_memory(LARGE_BLOCK)  # the default runtime: nothing
    assert calls == [LARGE_BLOCK]


def test_the_cpu_runtime_finishes_a_reduction_first_only_at_scale():
    # [Note: at scale, one unit's full-size gradients in flight on the host]
    assert device_runtime("cpu").finishes_reduction_first(LARGE_BLOCK)
    assert not device_runtime("cpu").finishes_reduction_first(LARGE_BLOCK - 1)
    assert not device_runtime("meta").finishes_reduction_first(LARGE_BLOCK)  # the default: overlap


def _unit(shapes: list[tuple[int, ...]], shard_numel: int, compute: torch.dtype, reduce: torch.dtype) -> object:
    """What ``largest_backward_block`` reads of a ``FlatUnit``: its parameters' full shapes, its shard's size, and
    the dtypes its full gradients and its reduction use."""
    slots = [SimpleNamespace(layout=SimpleNamespace(shape=torch.Size(shape))) for shape in shapes]
    return SimpleNamespace(slots=slots, shard_numel=shard_numel, compute_dtype=compute, reduce_dtype=reduce)


def test_largest_backward_block_is_a_full_gradient_or_a_units_shards():
    f32, bf16 = torch.float32, torch.bfloat16
    wide = _unit([(4096, 4096), (4096,)], shard_numel=(4096 * 4096 + 4096) // 2, compute=f32, reduce=f32)
    assert host_memory.largest_backward_block([wide]) == 4096 * 4096 * 4  # the weight's full gradient: 64 MiB
    half = _unit([(4096, 4096)], shard_numel=4096 * 4096 // 2, compute=bf16, reduce=f32)
    assert host_memory.largest_backward_block([half]) == 4096 * 4096 * 2  # bf16 full gradient = fp32 shards
    many = _unit([(64, 64)] * 4096, shard_numel=64 * 64 * 4096 // 2, compute=f32, reduce=f32)
    assert host_memory.largest_backward_block([many]) == 64 * 64 * 4096 // 2 * 4  # small ones: the shards' buffer
    empty_root = _unit([], shard_numel=0, compute=f32, reduce=f32)
    assert host_memory.largest_backward_block([empty_root, many, wide]) == 4096 * 4096 * 4
    # The 19M benchmark GPT's Block at 2 ranks (6.3 MiB of shards, 4 MiB its largest weight) stays under the line.
    block = _unit([(2048, 512), (512, 2048), (1536, 512), (512, 512)], 3 * 2**20 // 2, f32, f32)
    assert host_memory.largest_backward_block([block]) < host_memory.ALWAYS_MAPPED_BYTES
