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
pages in again: the cost is that of touching one activation set afresh per step. The activations decide, not the
model's size: the 19M-parameter benchmark GPT at 8 x 128 tokens also frees about 200 MiB per backward and trims;
alternating steps with and without trimming on one rank measured -3% and +9% in two runs, within this machine's
noise (docs/decisions.md, "Host memory at scale")."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

__all__ = ["RETURN_AT_BYTES", "return_free_heap_memory", "trim_heap"]

RETURN_AT_BYTES = 64 * 2**20


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


def return_free_heap_memory(at_least: int = RETURN_AT_BYTES) -> int:
    """If glibc's heaps hold ``at_least`` bytes free, give their free pages back to the kernel; returns the free bytes
    found (0 off glibc). See [Note: returning freed host memory]."""
    if _GLIBC is None:
        return 0
    free = int(_GLIBC.mallinfo2().fordblks)
    if free >= at_least:
        trim_heap()
    return free
