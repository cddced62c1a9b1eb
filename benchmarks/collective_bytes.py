"""Bytes passed into every ``torch.distributed`` collective and point-to-point op, whoever calls it.

:class:`CollectiveBytes` is a ``TorchDispatchMode``: every collective reaches the dispatcher as an op of the
``c10d`` namespace (``torch.distributed.all_gather_into_tensor`` and friends, which lightning_fsdp's engine, torch's
FSDP2, Lightning and the pipelining schedules call) or of ``_c10d_functional`` (the functional collectives DTensor
runs for tensor parallelism), so one mode sees fsdp_custom's, FSDP2's and DTensor's alike, on the thread that enters
it (backward on CPU runs on the calling thread). torch's own ``CommDebugMode`` counts calls, not bytes; this counts
the bytes of each op's input: an all-gather's input (this rank's piece), a reduce-scatter's full-size input, an
all-reduce's tensor, what a send sends and a receive receives. A dispatch mode slows every op, so a benchmark counts
separate steps under it, never its timed ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KINDS", "CollectiveBytes", "collective_kind"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send", "recv", "broadcast", "all_to_all", "other")

# Op names (either namespace) by kind; an op of these namespaces not listed counts under "other" (barrier, ...).
_KIND_OF = {
    **dict.fromkeys(
        (
            "allgather_",
            "_allgather_base_",
            "allgather_into_tensor_coalesced_",
            "all_gather_into_tensor",
            "all_gather_into_tensor_out",
            "all_gather_into_tensor_coalesced",
        ),
        "all_gather",
    ),
    **dict.fromkeys(
        (
            "reduce_scatter_",
            "_reduce_scatter_base_",
            "reduce_scatter_tensor_coalesced_",
            "reduce_scatter_tensor",
            "reduce_scatter_tensor_coalesced",
        ),
        "reduce_scatter",
    ),
    **dict.fromkeys(
        ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced"), "all_reduce"
    ),
    **dict.fromkeys(("send", "isend"), "send"),
    **dict.fromkeys(("recv_", "recv_any_source_", "irecv"), "recv"),
    **dict.fromkeys(("broadcast_", "broadcast"), "broadcast"),
    **dict.fromkeys(("alltoall_", "alltoall_base_", "all_to_all_single"), "all_to_all"),
}
# The argument holding what an op sends, by the schemas' own names (c10d: input_tensor(s) / inputs / tensors;
# functional: input / inputs / tensor).
_INPUT_ARGUMENTS = ("input", "inputs", "input_tensor", "input_tensors", "tensors", "tensor")
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


def collective_kind(func: Any) -> str | None:
    """The kind of a dispatched op (one of :data:`KINDS`), or None when it is not a collective."""
    if func.namespace not in ("c10d", "_c10d_functional"):
        return None
    name = func.__name__.split(".")[0]
    if name in _NOT_COLLECTIVES:
        return None
    return _KIND_OF.get(name, "other")


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """While entered: ``bytes[kind]`` and ``calls[kind]`` of every collective this thread dispatches, and
    ``ops[name]``: the bytes by op (``c10d._allgather_base_``, ``_c10d_functional.all_reduce``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = collective_kind(func)
        if kind is not None:
            self.calls[kind] += 1
            sent = self._input_bytes(func, args, kwargs) if kind != "other" else 0
            self.bytes[kind] += sent
            self.ops[f"{func.namespace}.{func.__name__.split('.')[0]}"] += sent
        return func(*args, **kwargs)

    @staticmethod
    def _input_bytes(func: Any, args: tuple, kwargs: dict) -> int:
        for index, argument in enumerate(func._schema.arguments):
            if argument.name in _INPUT_ARGUMENTS:
                value = args[index] if index < len(args) else kwargs.get(argument.name)
                return _tensor_bytes(value)
        raise RuntimeError(f"no input argument known for the collective {func} ({func._schema})")
