"""Giving freed host memory back to the kernel during backward, on glibc (Linux).

[Note: returning freed host memory]
glibc serves allocations under its mmap threshold (which rises to 32 MiB as large blocks are freed) from heaps that
it returns to the kernel only from their top. During backward autograd frees the activations (most of them a few MiB
each, so in those heaps) while the reductions allocate the shards' gradients (large, so mmapped): the freed
activations do not serve the gradients and stay resident, and the resident set at the end of backward holds both,
about one activation set above the live tensors (0.6 GiB per rank at 0.85B parameters: docs/benchmarks.md, "At
scale"). So after each unit's backward a CPU engine asks glibc how many bytes its heaps hold free (``mallinfo2``,
all arenas) and, from ``RETURN_AT_BYTES`` on, gives them back (``malloc_trim(0)``, which also releases whole free
pages inside the heaps); below that, only the count is paid. Off glibc nothing is done. The next forward faults the
pages in again: the cost is that of touching one activation set afresh per step, which is worth paying only where
it lowers the peak, that is where the backward allocates blocks the freed heap memory cannot serve. glibc maps a
block afresh only above its mmap threshold, which never rises past ``ALWAYS_MAPPED_BYTES`` (32 MiB on 64-bit); a
smaller block, once the threshold has risen past it (the first freed buffer of that size raises it), is carved out of
the freed activations and leaves the resident set where it was. So an engine returns memory only when its backward
allocates a block of ``ALWAYS_MAPPED_BYTES`` or more (a unit's gradient shards, or one parameter's full-size
gradient: ``ShardingEngine``'s ``_largest_backward_block``). The 19M-parameter benchmark GPT (6.3 MiB of gradient
shards per Block at 2 ranks) frees about 200 MiB of activations per backward: trimming them after every unit made
its step 1.21x slower through Lightning (1.94 s against 1.60 s, docs/decisions.md, "Host memory at scale") for a
peak it cannot lower; the 0.84B GPT (96 MiB per Block) still trims after every unit.

[Note: at scale, one unit's full-size gradients in flight on the host]
A unit's reduction runs while backward goes on with the next unit, and is waited for when that unit's reduction
starts: through the next unit's whole backward, the previous unit's full-size gradients are alive beside the next
unit's gathered parameters and its own full-size gradients, three units' worth at the top of every unit's
backward. On the host, where the backward allocates blocks of ``ALWAYS_MAPPED_BYTES`` or more (the same line as
above, the models where host memory is what limits), the CPU runtime has the engine finish the previous reduction
before the next unit's backward starts instead (``DeviceRuntime.finishes_reduction_first``): 0.84B parameters on 2
ranks, Block units, 227 MiB less per rank at the step's peak (7463 against 7690 MiB over base) and no slower step
(32.96 s against 34.83 s, one launch each; docs/benchmarks.md, "At scale"). On a CPU each rank's collectives and
its compute share the same cores, so the overlap given up buys little there; smaller models keep it. Accelerators
keep it always: their reduction runs on its own stream."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_fsdp.engine.unit import FlatUnit

__all__ = ["ALWAYS_MAPPED_BYTES", "RETURN_AT_BYTES", "largest_backward_block", "return_free_heap_memory", "trim_heap"]

RETURN_AT_BYTES = 64 * 2**20
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (4 MiB * sizeof(long)): the dynamic mmap threshold never rises past
# it, so blocks this large are always mapped afresh, never carved out of freed heap memory.
ALWAYS_MAPPED_BYTES = 32 * 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _load_glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33 (no mallinfo2)
        return None
    return libc


def _load_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc (any version); musl and others lack it
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_GLIBC = _load_glibc()  # with mallinfo2, to count the free bytes
_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> bool:
    """glibc's ``malloc_trim(0)``: the heaps' free pages handed back to the kernel; False where the C library has no
    such call."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def return_free_heap_memory(largest_block: int, at_least: int = RETURN_AT_BYTES) -> int:
    """If what comes next allocates blocks of ``ALWAYS_MAPPED_BYTES`` or more (``largest_block``: the largest, in
    bytes) and glibc's heaps hold ``at_least`` bytes free, give their free pages back to the kernel; returns the free
    bytes found (0 when not looked at: off glibc, or smaller blocks, which reuse the freed memory anyway). See
    [Note: returning freed host memory]."""
    if _GLIBC is None or largest_block < ALWAYS_MAPPED_BYTES:
        return 0
    free = int(_GLIBC.mallinfo2().fordblks)
    if free >= at_least:
        trim_heap()
    return free


def largest_backward_block(units: Sequence[FlatUnit]) -> int:
    """The bytes of the largest single buffer a backward of these units allocates: a parameter's full-size gradient
    (in the compute dtype) or a unit's gradient shards (one buffer, in the reduction's dtype)."""
    largest = 0
    for unit in units:
        reduced = unit.shard_numel * torch.empty((), dtype=unit.reduce_dtype).element_size()
        compute_size = torch.empty((), dtype=unit.compute_dtype).element_size()
        full = max((math.prod(slot.layout.shape) * compute_size for slot in unit.slots), default=0)
        largest = max(largest, reduced, full)
    return largest
