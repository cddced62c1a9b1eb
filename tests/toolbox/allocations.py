"""The peak of the bytes torch's allocator holds while a function runs, beyond what it held before: every allocation
and free of CPU (and accelerator) tensor memory as ``torch.profiler`` records it with ``profile_memory=True``
(storages made by ``torch.load`` and DCP's reads included), summed in time order."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def peak_allocated_bytes(work: Callable[[], T]) -> tuple[T, int, int]:
    """``(work(), peak bytes allocated over the start, number of allocator events seen)``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = work()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return result, peak, len(events)
