"""The work behind the engine's user-facing controls (torch FSDP2's ``FSDPModule`` methods, which
``ShardingEngine`` keeps as its own methods), as functions of the units they act on.

[Note: engine controls]
Per-unit state read by the unit's hook when it acts, so a change between micro-batches applies to the next hook;
every rank must make the same changes. Held gradients are not ``.grad`` (a step over them raises). A ``kept`` unit
survives the engine's own reshards (FSDP2's does not after forward) but not an optimizer step, so it never computes
with stale weights; for the same reason a step drops a secondary shard."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.optim import Optimizer

from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.groups import consecutive_subgroup
from lightning_fsdp.engine.unit import FlatUnit


class UnshardHandle:
    """What ``ShardingEngine.unshard(async_op=True)`` returns: ``wait()`` completes the all-gathers it issued."""

    def __init__(self, units: list[FlatUnit], after_wait: Callable[[], None]) -> None:
        self._units = units
        self._after_wait = after_wait  # the engine's peak accounting

    def wait(self) -> None:
        for unit in self._units:
            if unit.is_prefetched:  # not yet waited for by its forward, nor resharded since
                unit.unshard()
        self._after_wait()


@contextmanager
def hold_unsharded(units: list[FlatUnit]) -> Iterator[None]:
    """``units`` unsharded and kept for the block (``ShardingEngine.unsharded``); those sharded before are resharded
    on exit."""
    was = [(u.is_unsharded, u.kept) for u in units]
    try:
        with torch.no_grad():
            for unit in units:
                unit.unshard()
                unit.kept = True
        yield
    finally:
        for unit, (unsharded, kept) in zip(units, was):
            unit.kept = kept
            if not unsharded:
                unit.reshard()


@contextmanager
def gradient_sync_off(units: list[FlatUnit]) -> Iterator[None]:
    """``units`` hold their gradients for the block (``ShardingEngine.no_sync``); their previous settings after."""
    previous = [unit.requires_gradient_sync for unit in units]
    for unit in units:
        unit.requires_gradient_sync = False
    try:
        yield
    finally:
        for unit, requires in zip(units, previous):
            unit.requires_gradient_sync = requires


def unshard_and_keep(units: list[FlatUnit], *, async_op: bool, after_wait: Callable[[], None]) -> UnshardHandle | None:
    """All-gather ``units`` (``ShardingEngine.unshard``) and keep them unsharded; with ``async_op`` the collectives
    are only issued, and the returned handle's ``wait()`` completes them, then calls ``after_wait``."""
    for unit in units:
        if async_op:
            unit.start_unshard(async_op=True)
        else:
            unit.unshard()
        unit.kept = True
    return UnshardHandle(list(units), after_wait) if async_op else None


def secondary_group(
    size: int, shard_comm: Communicator, made: dict[int, Communicator], describe_tag: Callable[[int], str]
) -> Communicator:
    """The group of ``size`` consecutive ranks of the shard group a forward reshards to (hpZ), made once per size
    (``made``, as torch's groups are created once, by every rank)."""
    comm = made.get(size)
    if comm is None:
        comm = Communicator(consecutive_subgroup(shard_comm, size), shard_comm.device)
        comm.describe_tag = describe_tag
        made[size] = comm
    return comm


def check_held_gradients(units: list[FlatUnit], optimizer: Optimizer, *, late: bool) -> None:
    """Raise if ``optimizer`` steps (``late``: stepped) parameters of units whose gradients are held, not yet in
    ``.grad`` (gradient sync off)."""
    holding = [u for u in units if u.grads_unsynced]
    if not holding:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = [u.name for u in holding if any(id(s.param) in stepped for s in u.slots)]
    if names:
        when = "updated" if late else "would update"
        raise RuntimeError(
            f"optimizer.step() {when} parameters of units {names} whose gradients were accumulated with "
            "gradient sync off (ShardingEngine.no_sync() / set_requires_gradient_sync(False)) and never reduced "
            "across ranks: the shards' .grad does not contain them yet. Run the last micro-batch's backward with "
            "gradient sync on (outside no_sync()), which reduces the accumulated sum once, then step."
        )
