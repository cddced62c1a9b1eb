"""The accelerator streams a sharded model's collectives run on, and the events that order them against compute.

[Note: collectives on their own streams]
What runs where: docs/how-it-works.md ("On an accelerator: streams"). Why it is safe: each side-stream block first
waits for the compute stream (the optimizer, a load or a reshard may just have written or freed what it reads) and
ends with an event the compute stream waits for. Handles are waited for inside the side stream, so NCCL and HCCL
block that stream, not the host. The caching allocator reuses a block on its own stream only, hence full buffers on
the compute stream and ``record_stream`` on gradients. Unlike FSDP2: the all-gather stream waits for compute at every
unshard, no copy-in stream, one reduction in flight. Everything goes through ``CollectiveStreams`` so that
tests/engine/test_streams.py checks the protocol on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType
from typing import NamedTuple, Protocol

import torch

from lightning_fsdp.engine.devices import device_runtime

# FSDP2's priority for its all-gather and reduce-scatter streams: higher than the default stream's (0).
HIGH_PRIORITY = -1


def stream_module(device: torch.device) -> ModuleType | None:
    """``torch.cuda`` / ``torch.hpu``, whose streams order ``device``'s work; None on CPU or without real streams (the
    device's runtime decides: engine/devices.py)."""
    return device_runtime(device).stream_module(device)


def pins_host_memory(device: torch.device) -> bool:
    """Whether ``device``'s host buffers can be pinned (``pin_memory=True`` raises without an accelerator)."""
    return device_runtime(device).pins_host_memory(device)


class DeviceModule(Protocol):
    """What ``CollectiveStreams`` uses of a device module (``torch.cuda``, ``torch.hpu``, or the tests' fake)."""

    def Stream(self, device: torch.device, priority: int = ...) -> torch.Stream: ...  # noqa: N802 - torch.cuda's name

    def current_stream(self, device: torch.device) -> torch.Stream: ...

    def stream(self, stream: torch.Stream) -> AbstractContextManager[object]: ...


class _SideStreams(NamedTuple):
    module: DeviceModule
    all_gather: torch.Stream
    reduce_scatter: torch.Stream


class CollectiveStreams:
    """One compute device's all-gather and reduce-scatter streams ([Note: collectives on their own streams]). On CPU
    ``active`` is False and nothing else may be called."""

    def __init__(self, device: torch.device | str, device_module: DeviceModule | None = None) -> None:
        self.device = torch.device(device)
        module = device_module if device_module is not None else stream_module(self.device)
        self.active = module is not None
        self._side = (
            _SideStreams(module, self._new_stream(module), self._new_stream(module)) if module is not None else None
        )

    def _new_stream(self, module: DeviceModule) -> torch.Stream:
        try:
            return module.Stream(device=self.device, priority=HIGH_PRIORITY)
        except TypeError:  # a device module whose streams take no priority
            return module.Stream(device=self.device)

    def _active_side(self) -> _SideStreams:
        if self._side is None:
            raise RuntimeError(f"CollectiveStreams on {self.device} is inactive: there are no streams to use.")
        return self._side

    @property
    def all_gather_stream(self) -> torch.Stream:
        return self._active_side().all_gather

    @property
    def reduce_scatter_stream(self) -> torch.Stream:
        return self._active_side().reduce_scatter

    def current_stream(self) -> torch.Stream:
        """The stream kernels are queued on now: the compute stream outside the side-stream blocks."""
        return self._active_side().module.current_stream(self.device)

    @contextmanager
    def _on(self, side: torch.Stream) -> Iterator[torch.Stream]:
        compute = self.current_stream()
        side.wait_stream(compute)
        with self._active_side().module.stream(side):
            yield compute

    def all_gather_side(self) -> AbstractContextManager[torch.Stream]:
        """A block on the all-gather stream, after it waited for the compute stream (yielded)."""
        return self._on(self.all_gather_stream)

    def reduce_scatter_side(self) -> AbstractContextManager[torch.Stream]:
        """A block on the reduce-scatter stream, after it waited for the compute stream (yielded)."""
        return self._on(self.reduce_scatter_stream)

    def record_event(self) -> torch.Event:
        """An event recorded on the current stream: done when everything queued there so far is."""
        return self.current_stream().record_event()

    def wait_event(self, event: torch.Event) -> None:
        """The current stream waits for ``event`` (the host does not)."""
        self.current_stream().wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: torch.Stream) -> None:
        """Once freed, ``tensor``'s memory is not reused before ``stream`` has done what was queued until then."""
        tensor.record_stream(stream)

    def synchronize_event(self, event: torch.Event) -> None:
        """The host waits for ``event``."""
        event.synchronize()

    def synchronize(self) -> None:
        """The host waits for everything queued on both side streams (the offload copies, at the end of backward)."""
        self.all_gather_stream.synchronize()
        self.reduce_scatter_stream.synchronize()


# What a unit uses until an engine gives it the streams of its device.
INACTIVE = CollectiveStreams(torch.device("cpu"))


def streams_for(devices: list[torch.device]) -> dict[torch.device, CollectiveStreams]:
    """One ``CollectiveStreams`` per compute device (an engine's units share their device's)."""
    return {device: CollectiveStreams(device) for device in dict.fromkeys(devices)}
