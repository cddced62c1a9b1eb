"""What the strategy and the engine need to know about a kind of device, asked of one ``DeviceRuntime`` per device
type, so that neither branches on device names.

[Note: adding an accelerator]
A new device type is one module that subclasses ``DeviceRuntime`` (overriding only what differs from the defaults
below) and calls ``register_device_runtime`` when it is imported, next to the registration of its Lightning
accelerator (accelerators/hpu_runtime.py and accelerators/hpu.py are the example), plus its name in
``ACCELERATOR_MODULES`` (lightning_fsdp/registration.py), which imports it once Lightning is imported. The strategy
asks the runtime of its device for the process-group backend, the compute device, what must run before the process
group starts and whether to bind ``device_id``; the engine (engine/streams.py) asks it for the stream module and
whether host memory pins; ``ShardingMonitor`` for the memory statistics. A device type nobody registered gets
``DeviceRuntime()``: torch's own device module where it has one, and gloo.

Imports nothing but torch: the engine imports this module, and must not import Lightning."""

from __future__ import annotations

from types import ModuleType

import torch

from lightning_fsdp.engine.host_memory import ALWAYS_MAPPED_BYTES, return_free_heap_memory

__all__ = ["CPURuntime", "CUDARuntime", "DeviceRuntime", "device_runtime", "register_device_runtime"]


class DeviceRuntime:
    """One device type's specifics. The defaults are what any accelerator with a torch device module (``torch.xpu``,
    ``torch.hpu`` once its bridge is imported) gets: streams and memory statistics from that module, gloo."""

    device_type = ""  # the ``torch.device(...).type`` this runtime is registered for ("" for the default)
    process_group_backend = "gloo"  # the default process group's backend, unless the user names one
    binds_device_id = False  # whether ``init_process_group(device_id=...)`` binds the group to this rank's device
    memory_is_host = False  # whether the device's memory is the process's (its peak is the peak RSS)

    def compute_device(self, device: torch.device) -> torch.device:
        """Where tensors for ``device`` are allocated: the device itself, unless a runtime maps it elsewhere."""
        return device

    def before_process_group(self) -> None:
        """Checks and set-up that must happen before the default process group starts (none by default)."""

    def stream_module(self, device: torch.device) -> ModuleType | None:
        """The module whose streams order ``device``'s work (``torch.cuda``); None without real streams."""
        try:
            module = torch.get_device_module(device)
        except RuntimeError:  # no ``torch.<type>`` module (meta, or an accelerator whose bridge is not imported)
            return None
        needed = ("Stream", "current_stream", "stream")
        if not all(hasattr(module, name) for name in needed):
            return None
        is_available = getattr(module, "is_available", None)
        return module if is_available is None or is_available() else None

    def pins_host_memory(self, device: torch.device) -> bool:
        """Whether host buffers copied to ``device`` can be pinned (``pin_memory=True`` raises without an
        accelerator, so only when the current accelerator is this device's type)."""
        if not torch.accelerator.is_available():
            return False
        current = torch.accelerator.current_accelerator()
        return current is not None and current.type == device.type

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """Start a new peak of allocated memory on ``device`` (nothing where the device keeps no statistics)."""
        reset = getattr(getattr(torch, device.type, None), "reset_peak_memory_stats", None)
        if reset is not None:
            reset(device)

    def max_memory_allocated(self, device: torch.device) -> int | None:
        """The peak of memory allocated on ``device`` since the last reset; None where it is not measured."""
        peak = getattr(getattr(torch, device.type, None), "max_memory_allocated", None)
        return None if peak is None else int(peak(device))

    def return_free_memory(self, largest_block: int) -> None:
        """Called after each unit's backward: give memory the allocator holds free back, where that lowers the peak
        (nothing by default; an accelerator's caching allocator reuses its blocks). ``largest_block``: the bytes of
        the largest single buffer the engine's backward allocates."""

    def finishes_reduction_first(self, largest_block: int) -> bool:
        """Whether a unit's reduction is finished before the next unit's backward starts, rather than overlapping
        it (False by default: an accelerator reduces on its own stream while the next backward computes).
        ``largest_block`` as in ``return_free_memory``."""
        return False


class CPURuntime(DeviceRuntime):
    """Host memory: no streams, nothing to pin, the process's own memory (torch keeps no allocator statistics)."""

    device_type = "cpu"
    memory_is_host = True

    def stream_module(self, device: torch.device) -> ModuleType | None:
        return None

    def pins_host_memory(self, device: torch.device) -> bool:
        return False

    def return_free_memory(self, largest_block: int) -> None:
        # Freed activations would otherwise stay resident beside new gradients glibc maps afresh ([Note: returning
        # freed host memory] in engine/host_memory.py).
        return_free_heap_memory(largest_block)

    def finishes_reduction_first(self, largest_block: int) -> bool:
        # [Note: at scale, one unit's full-size gradients in flight on the host] in engine/host_memory.py.
        return largest_block >= ALWAYS_MAPPED_BYTES


class CUDARuntime(DeviceRuntime):
    """NCCL, with the default process group bound to this rank's GPU (``device_id``), as Lightning's own strategies
    bind it."""

    device_type = "cuda"
    process_group_backend = "nccl"
    binds_device_id = True


_DEFAULT = DeviceRuntime()
_RUNTIMES: dict[str, DeviceRuntime] = {}


def register_device_runtime(runtime: DeviceRuntime) -> None:
    """Make ``runtime`` the one asked about devices of type ``runtime.device_type`` (replacing any before it)."""
    if not runtime.device_type:
        raise ValueError(f"{type(runtime).__name__} names no device_type to be registered for.")
    _RUNTIMES[runtime.device_type] = runtime


def device_runtime(device: torch.device | str) -> DeviceRuntime:
    """The runtime registered for ``device``'s type (a ``torch.device`` or a type such as ``"cuda"``); the default
    ``DeviceRuntime()`` for a type nobody registered."""
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _RUNTIMES.get(device_type, _DEFAULT)


register_device_runtime(CPURuntime())
register_device_runtime(CUDARuntime())
