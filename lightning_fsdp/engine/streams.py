"""The accelerator streams a sharded model's collectives run on, and the events that order them against compute.

[Note: collectives on their own streams]
On CPU every kernel runs when it is called, so a work handle's ``wait()`` is all the ordering there is, and this
module is inactive (``CollectiveStreams.active`` False): the units take their plain path, which reads that flag and
nothing else here. On an accelerator (CUDA, HPU) a kernel is only queued on a stream, so the engine follows torch's
FSDP2 (``_fsdp_param_group.py``, ``_fsdp_collectives.py``): an all-gather stream and a reduce-scatter stream per
compute device, both high priority (their small copies should not queue behind long compute kernels), and events
between them and the *compute* stream (whatever stream is current when a hook runs, normally the default one).

* Unshard (``FlatUnit.start_unshard``): the all-gather stream first waits for the compute stream (the optimizer, a
  checkpoint load or a reshard may just have written or freed what it reads), then does the copy-in (the shard to
  the device and the compute dtype, the concatenation of the staged pieces) and the all-gathers; an event is
  recorded after them. ``_finish_unshard`` makes the compute stream wait for that event before the copy-out, or
  before the modules see the full parameters when a collective wrote them in place. Units with no collective
  (NO_SHARD casting or offloading) copy on the compute stream.
* Reduce (``FlatUnit.reduce_grads``): the reduce-scatter stream waits for the compute stream (backward just produced
  the gradients there), then does the copy-in (casts, ``_chunk_cat``), the reduce-scatter and the post-reduce work
  (the split copy, the replicas' all-reduce, the division, the cast and copy to the shard device); an event is
  recorded after all of it. ``finish_reduce`` makes the compute stream wait for that event before ``.grad`` is set.
  The engine finishes every reduction by the end of backward, so the optimizer (compute stream) comes after all of
  them. The used-flags are filled on the device: a blocking host-to-device copy would stall the host until the
  stream drained.
* Collectives are issued inside the side stream's context and their work handles waited for there, right away:
  NCCL and HCCL run a collective on a stream of their own that first waits for the current one (the copy-in), and
  ``wait()`` makes the current stream (the side stream) wait for the collective without blocking the host. That is
  FSDP2's ``async_op=False`` inside the stream, spelled so that the unit's code stays the CPU's, including work
  handles whose ``wait()`` runs kernels (the wire-dtype reduction's sum), which then run on the side stream too.
  gloo blocks the host instead: correct, without the overlap.
* Memory: the caching allocator gives a block back to the stream it was allocated on, and hands it out again to
  that stream's next allocation, ordered after that stream's earlier uses only. So the full buffer, which outlives
  the unshard and which reshard frees on the compute stream, is allocated there before switching; autograd's
  full-size gradients (and held ones), compute-stream allocations that the reduce-scatter stream reads, get
  ``record_stream(reduce_scatter_stream)``: they are dropped as soon as the copy-in is queued and their memory is
  reused once it is done (FSDP2 copies them in on the compute stream instead, in line with compute). Side-stream
  allocations that the compute stream reads (the all-gather's staging output, the reduced gradients and their
  used-flags) get ``record_stream(compute)``; that is belt and braces, as every side-stream block starts by waiting
  for the compute stream. The collectives' inputs stay referenced until the side stream has waited for them.
* cpu_offload on an accelerator: the host shards and the reduced gradients' host buffers are pinned; the shard is
  copied to the device ``non_blocking`` on the all-gather stream, the reduced gradient to the host ``non_blocking``
  on the reduce-scatter stream. The host must not read those gradients, nor write the shards, before the copies
  are done: at the end of backward the engine makes the host wait for both side streams, before clipping and the
  optimizer (which runs on the host, where the shards and its state are); a reduction that adds into an existing
  host gradient (accumulation) makes the host wait for its own event first.

What differs from FSDP2: the all-gather stream waits for the compute stream at every unshard (FSDP2 once per
forward, and it gathers into side-stream memory only), so without ``forward_prefetch`` a forward's all-gather
starts only when the previous unit's kernels are done; no separate copy-in stream; the replicas' all-reduce runs
on the reduce-scatter stream (FSDP2 has a third stream for it); the compute stream waits for a unit's reduction
when the next unit's starts (one in flight), as on CPU.

Every stream, event and ``record_stream`` call goes through ``CollectiveStreams``, so a test on CPU can give it a
fake device module (and its own ``record_stream``) and check the protocol (``tests/test_streams.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# FSDP2's priority for its all-gather and reduce-scatter streams: higher than the default stream's (0).
HIGH_PRIORITY = -1


def stream_module(device: torch.device) -> Any | None:
    """The device module (``torch.cuda``, ``torch.hpu``) whose streams order ``device``'s work; None on CPU, or where
    the module has no real streams or no device."""
    if device.type in ("cpu", "meta"):
        return None
    try:
        module = torch.get_device_module(device)
    except RuntimeError:
        return None
    needed = ("Stream", "current_stream", "stream")
    if not all(hasattr(module, name) for name in needed):
        return None
    is_available = getattr(module, "is_available", None)
    return module if is_available is None or is_available() else None


def pins_host_memory(device: torch.device) -> bool:
    """Whether host buffers that ``device`` copies from and to can be pinned: ``pin_memory=True`` pins for the current
    accelerator, and raises on a build without one."""
    if device.type in ("cpu", "meta") or not torch.accelerator.is_available():
        return False
    current = torch.accelerator.current_accelerator()
    return current is not None and current.type == device.type


class CollectiveStreams:
    """The all-gather and reduce-scatter streams of one engine's compute device (see [Note: collectives on their own
    streams]). Inactive on CPU: ``active`` is False and nothing else may be called."""

    def __init__(self, device: torch.device | str, device_module: Any | None = None) -> None:
        self.device = torch.device(device)
        self._module = device_module if device_module is not None else stream_module(self.device)
        self.active = self._module is not None
        self.all_gather_stream: Any = None
        self.reduce_scatter_stream: Any = None
        if self.active:
            self.all_gather_stream = self._new_stream()
            self.reduce_scatter_stream = self._new_stream()

    def _new_stream(self) -> Any:
        try:
            return self._module.Stream(device=self.device, priority=HIGH_PRIORITY)
        except TypeError:  # a device module whose streams take no priority
            return self._module.Stream(device=self.device)

    def current_stream(self) -> Any:
        """The stream kernels are queued on now: the compute stream outside the side-stream blocks."""
        return self._module.current_stream(self.device)

    @contextmanager
    def _on(self, side: Any) -> Iterator[Any]:
        compute = self.current_stream()
        side.wait_stream(compute)
        with self._module.stream(side):
            yield compute

    def all_gather_side(self) -> Any:
        """A block run on the all-gather stream after it waited for the current (compute) stream; yields that
        compute stream."""
        return self._on(self.all_gather_stream)

    def reduce_scatter_side(self) -> Any:
        """A block run on the reduce-scatter stream after it waited for the current (compute) stream; yields that
        compute stream."""
        return self._on(self.reduce_scatter_stream)

    def record_event(self) -> Any:
        """An event recorded on the current stream: done when everything queued there so far is."""
        return self.current_stream().record_event()

    def wait_event(self, event: Any) -> None:
        """The current stream waits for ``event`` (the host does not)."""
        self.current_stream().wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory is not handed out again, once freed, before ``stream`` has done what was queued on it
        until the free."""
        tensor.record_stream(stream)

    def synchronize_event(self, event: Any) -> None:
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
