"""What a rank holds and moves: model-state bytes, peak live tensor bytes, bytes sent into collectives.

Three measures, each stated in the benchmark's output next to its figures:

* :func:`model_state_bytes` - parameters, gradients and optimizer state, summed from the tensors themselves after
  a step (for DTensors the local shard, ``to_local()``). Padding that a sharded layout keeps in its buffers is not
  a parameter's and is not counted.
* :class:`LiveTensorBytes` - peak bytes of live tensor storage allocated through torch's CPU allocator, from
  ``torch.profiler``'s memory events (``profile_memory=True``). torch's CPU allocator keeps a running total of the
  bytes it handed out and has not had back, and stamps it on every allocation and free event; the measured run
  starts profiling before the model is built, so that total is every live tensor of the run (model, shards,
  gathered parameters, gradients, optimizer state, activations, communication buffers). Raw RSS is not used:
  glibc keeps freed memory mapped, so RSS says little about what is alive. The profiler slows each operator, so
  this runs separately from the timed run.

  One trap: the allocator only keeps that total while the *freeing thread* is being profiled. gloo runs
  collectives on its own worker threads, which often drop the last reference to a buffer that the main thread
  allocated (an all-gather's staging buffer, a reduce-scatter's input); without care those frees are lost and the
  total creeps up by about a unit's worth per collective. c10's ``FLAGS_caffe2_report_cpu_memory_usage`` makes the
  allocator keep the total on every thread, so it is switched on (through ``ctypes``; c10 has no Python setter)
  for the measurement; with it the total at the start of each step stays flat, as it must.
* :class:`CollectiveCounter` - bytes passed to ``torch.distributed``'s flat collectives from Python (torch's FSDP1
  and FSDP2 call them by module attribute, so a wrapper sees them). DDP's reducer calls the process group from
  C++ and is not seen; lightning_fsdp's engine keeps its own exact counters (``CommStats``), used instead.
* :class:`PeakGrowth` - peak growth of the resident set (``VmHWM`` after a reset, exact) and of private memory
  (``RssAnon``, sampled), for the pretrained-loading and export measurements, where memory-mapped files matter.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "LIVE_BYTES_METHOD",
    "MODEL_STATE_METHOD",
    "CollectiveCounter",
    "LiveTensorBytes",
    "local_tensor",
    "model_state_bytes",
]

MODEL_STATE_METHOD = (
    "parameters + gradients + optimizer state, summed over the tensors each rank holds after the last step "
    "(numel x element size; DTensor -> to_local(); padding excluded)"
)
LIVE_BYTES_METHOD = (
    "peak live tensor bytes over the measured steps: torch's CPU allocator total from torch.profiler memory "
    "events (profile_memory=True), kept on every thread (c10 FLAGS_caffe2_report_cpu_memory_usage, so frees on "
    "gloo's worker threads count), profiling from before the model is built, in a separate short run"
)

_WINDOW = "benchmarks.steps"


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores: a DTensor's local shard, anything else itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    seen: set[int] = set()
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = local_tensor(tensor)
        total += local.numel() * local.element_size()
    return total


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (shared parameters counted once)."""
    params = list(model.parameters())  # parameters() already lists a tied parameter once
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    result = {"params": _nbytes(params), "grads": _nbytes(grads), "optimizer": _nbytes(state)}
    result["total"] = sum(result.values())
    return result


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence the profiler's start/stop chatter, which it prints to fd 2 from C++."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def c10_report_flag() -> Any:
    """c10's ``FLAGS_caffe2_report_cpu_memory_usage`` as a ctypes bool, or None where it cannot be reached."""
    import ctypes
    import sys

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    names = {"darwin": ["libc10.dylib"], "win32": ["c10.dll"]}.get(sys.platform, ["libc10.so"])
    for name in names:
        try:
            return ctypes.c_bool.in_dll(
                ctypes.CDLL(os.path.join(lib_dir, name)), "FLAGS_caffe2_report_cpu_memory_usage"
            )
        except (OSError, ValueError):
            continue
    return None


class LiveTensorBytes:
    """Peak bytes of live CPU tensor storage, from torch.profiler's allocation events.

    >>> with LiveTensorBytes() as live:                 # doctest: +SKIP
    ...     model = build()                             # counted from here on
    ...     with live.window():
    ...         train_steps()
    >>> live.peak, live.at_window_start                 # doctest: +SKIP

    Only allocations made after ``__enter__`` are known to the allocator's total (a tensor that existed before is
    neither counted nor subtracted when freed), so build everything that should count inside the block.
    """

    def __init__(self) -> None:
        self.peak = 0  # highest live total inside the window
        self.at_window_start = 0  # live total when the window opened
        self.peak_overall = 0  # highest live total anywhere in the block (includes model construction)
        # Whether frees on every thread were counted (see the module docstring); False: an upper bound.
        self.all_threads = False
        self._profile: Any = None
        self._flag: Any = None
        self._flag_was = False

    def __enter__(self) -> LiveTensorBytes:
        from torch.profiler import ProfilerActivity, profile

        self._flag = c10_report_flag()
        if self._flag is not None:
            self._flag_was = self._flag.value
            self._flag.value = True
            self.all_threads = True
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with quiet_stderr():
            self._profile.__enter__()
        return self

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Mark the region (the training steps) whose peak is reported."""
        with torch.profiler.record_function(_WINDOW):
            yield

    def __exit__(self, *exc: Any) -> None:
        # Frees are only recorded while profiling: collect garbage (engines hold reference cycles) before stopping.
        gc.collect()
        with quiet_stderr():
            self._profile.__exit__(*exc)
        if self._flag is not None:
            self._flag.value = self._flag_was
        if exc[0] is None:
            self._analyse()

    def _analyse(self) -> None:
        from torch._C._profiler import _EventType

        allocations: list[tuple[int, int, int]] = []
        windows: list[tuple[int, int]] = []
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation:
                fields = node.extra_fields
                if fields.device.type == "cpu":
                    allocations.append((node.start_time_ns, int(fields.total_allocated), int(fields.alloc_size)))
            elif node.name == _WINDOW:
                windows.append((node.start_time_ns, node.end_time_ns))
        if not windows:
            raise RuntimeError("LiveTensorBytes.window() was never entered inside the profiled block")
        allocations.sort()
        # The allocator's total lives as long as the process: blocks allocated under an earlier profiling session
        # and freed while none ran are never subtracted. Measure from this session's first event instead.
        base = allocations[0][1] - allocations[0][2] if allocations else 0
        totals = [(t, total - base) for t, total, _size in allocations]
        start, end = min(w[0] for w in windows), max(w[1] for w in windows)
        before = [total for t, total in totals if t < start]
        inside = [total for t, total in totals if start <= t <= end]
        self.at_window_start = before[-1] if before else 0
        self.peak = max(inside + [self.at_window_start])
        self.peak_overall = max([total for _t, total in totals] + [0])


class CollectiveCounter:
    """Counts bytes passed to torch.distributed's flat collectives from Python while ``counting`` is on.

    Bytes per kind follow lightning_fsdp's ``CommStats``: all-gather counts its input (this rank's shard),
    reduce-scatter its full-size input, all-reduce the tensor. A call that forwards to another wrapped function
    (an old name calling the new one) is counted once.
    """

    _NAMES = {
        "all_gather": "all_gather",  # list form: FSDP1 gathers with it on CPU
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "_all_gather_base": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
        "_reduce_scatter_base": "reduce_scatter",
        "all_reduce": "all_reduce",
    }

    def __init__(self) -> None:
        self.bytes = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.calls = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.counting = False
        self._saved: dict[str, Any] = {}
        self._depth = 0

    def reset(self) -> None:
        for kind in self.bytes:
            self.bytes[kind] = 0
            self.calls[kind] = 0

    def __enter__(self) -> CollectiveCounter:
        for name, kind in self._NAMES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original
            setattr(dist, name, self._wrap(original, kind))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, original: Any, kind: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting and self._depth == 0:
                # all_gather(output(s), input); reduce_scatter(output, input); all_reduce(tensor)
                tensor = (
                    args[0]
                    if kind == "all_reduce"
                    else (args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input")))
                )
                if isinstance(tensor, torch.Tensor):
                    self.bytes[kind] += tensor.numel() * tensor.element_size()
                    self.calls[kind] += 1
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def status_bytes(field: str) -> int:
    """A byte count of this process from ``/proc/self/status`` (Linux): ``VmHWM``, ``VmRSS``, ``RssAnon``,
    ``RssFile``, ``RssShmem``."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


class PeakGrowth:
    """Peak host memory growth of this process from ``start()`` to ``stop()`` (Linux): for code whose memory is not
    all torch tensors, such as files memory-mapped by safetensors, which :class:`LiveTensorBytes` does not see.
    ``start()`` resets the kernel's peak (``/proc/self/clear_refs``), so the imports' own peak is not counted.

    ``rss``: the growth of ``VmHWM`` (exact, kernel-kept). It counts the pages of files mapped into the process
    (safetensors reads through ``mmap``) as well as private memory. ``anon``: the growth of ``RssAnon`` (private
    memory: tensors, allocator caches), which the kernel keeps no peak of, so it is sampled every millisecond by a
    thread; a spike shorter than that can be missed (torch's copies release the GIL, so the thread keeps running).
    """

    INTERVAL_S = 0.001

    def __init__(self) -> None:
        self._thread = None

    def start(self) -> None:
        import threading

        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        self._rss_level = status_bytes("VmHWM")
        self._anon_level = self._anon_peak = status_bytes("RssAnon")
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stopping.wait(self.INTERVAL_S):
            self._anon_peak = max(self._anon_peak, status_bytes("RssAnon"))

    def stop(self) -> dict[str, int]:
        assert self._thread is not None, "start() first"
        rss = status_bytes("VmHWM") - self._rss_level
        self._anon_peak = max(self._anon_peak, status_bytes("RssAnon"))
        self._stopping.set()
        self._thread.join()
        self._thread = None
        held = status_bytes("VmRSS") - self._rss_level
        return {"rss": rss, "anon": self._anon_peak - self._anon_level, "held": held}
