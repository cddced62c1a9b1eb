"""Agreement across ranks: "one rank found a problem" becomes the same exception on every rank, so that no rank
waits in the next collective for one that failed. Trivial without a process group."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

_T = TypeVar("_T")
_E = TypeVar("_E", bound=type[BaseException])

# Classes other ranks re-raise by name (others become a RuntimeError); a ``path`` attribute is the second argument.
_REBUILDABLE: dict[str, type[BaseException]] = {}


def raised_alike_on_every_rank(cls: _E) -> _E:
    """Class decorator: when one rank raises this exception inside :meth:`Collective.agree`, the other ranks raise the
    same class (with the message and the rank that raised it), so that callers can catch it by type on every rank."""
    _REBUILDABLE[cls.__name__] = cls
    return cls


_THREAD = threading.local()  # the process group collectives of this thread go over (collectives_over)


@contextlib.contextmanager
def collectives_over(group: ProcessGroup) -> Iterator[None]:
    """Every :class:`Collective` made in this thread inside the block uses ``group`` (a group of every rank) instead
    of the default group: a checkpoint written in a background thread must not meet the training's collectives."""
    previous = getattr(_THREAD, "group", None)
    _THREAD.group = group
    try:
        yield
    finally:
        _THREAD.group = previous


class Collective:
    """Object collectives over the default group (or the group of :func:`collectives_over`) for the checkpoint
    protocols; trivial without a process group."""

    def __init__(self, alone: bool = False) -> None:
        # alone: this process by itself even inside a process group (offline conversion), every collective trivial
        self.distributed = not alone and dist.is_available() and dist.is_initialized()
        self.group: ProcessGroup | None = getattr(_THREAD, "group", None) if self.distributed else None
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: _T, src: int = 0) -> _T:
        if not self.distributed or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=self.group)  # a group of every rank: global rank = group rank
        return box[0]

    def all_gather(self, obj: _T) -> list[_T]:
        if not self.distributed or self.world_size == 1:
            return [obj]
        out: list[_T] = [obj] * self.world_size  # each entry replaced by that rank's object
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.distributed and self.world_size > 1:
            dist.barrier(group=self.group)

    def agree(self, problem: BaseException | None) -> None:
        """Every rank passes its own problem (or None); if any rank has one, every rank raises. A rank raises its
        own exception; the others raise an equivalent one (same class where it is one of ours) naming the rank."""
        verdicts = self.all_gather(None if problem is None else _describe(problem))
        if problem is not None:
            raise problem
        for rank, verdict in enumerate(verdicts):
            if verdict is not None:
                raise _rebuild(verdict, rank)

    def run_agreed(self, work: Callable[[], _T]) -> _T:
        """``work()`` on every rank; if it raises on any rank, every rank raises (see ``agree``). For checks that
        must not leave the ranks that passed them waiting in the next collective for one that failed."""
        problem: Exception | None = None
        try:
            result = work()
        except Exception as exc:  # noqa: BLE001 - shared with every rank by agree
            problem = exc
        self.agree(problem)  # raises if work() raised here: ``result`` is set below
        return result

    def agree_from_rank0(self, problem: BaseException | None) -> None:
        """Rank 0 decided alone (e.g. it renamed the directory); every rank raises if it failed."""
        verdict = self.broadcast(None if problem is None else _describe(problem))
        if self.is_rank0 and problem is not None:
            raise problem
        if verdict is not None:
            raise _rebuild(verdict, 0)


# What other ranks learn of a problem: its class name, its message, and the class's extra arguments (a path).
_Verdict = tuple[str, str, tuple[object, ...]]


def _describe(exc: BaseException) -> _Verdict:
    return type(exc).__name__, str(exc), (exc.path,) if hasattr(exc, "path") else ()


def _rebuild(verdict: _Verdict, rank: int) -> BaseException:
    name, message, extra = verdict
    message = f"{message} [raised on rank {rank}]"
    cls = _REBUILDABLE.get(name)
    if cls is None:
        return RuntimeError(f"{name}: {message}")
    return cls(message, *extra)


def all_reduce_tensor(tensor: _T, group: ProcessGroup | None = None, reduce_op: ReduceOp | str | None = "mean") -> _T:
    """``Strategy.reduce``: ``tensor`` all-reduced in place over ``group`` (default: the world) with ``reduce_op``
    (a ``ReduceOp`` or its name; ``"mean"``, ``"avg"`` or None average); anything else, or no process group, as it is.

    Means are a SUM and a division: ``ReduceOp.AVG`` is missing on gloo and on some HCCL releases, and Lightning's
    ``_sync_ddp`` works around gloo only (by its backend name), with a barrier before every call."""
    if not isinstance(tensor, torch.Tensor) or not (dist.is_available() and dist.is_initialized()):
        return tensor
    op: ReduceOp | ReduceOp.RedOpType
    if reduce_op is None or (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")):
        op = dist.ReduceOp.AVG
    else:
        op = getattr(dist.ReduceOp, reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op
    group = dist.group.WORLD if group is None else group
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=group)
    if op != dist.ReduceOp.AVG:
        return tensor
    size = dist.get_world_size(group)
    if tensor.is_floating_point():
        tensor.div_(size)
    else:
        tensor.copy_(tensor / size)
    return tensor
