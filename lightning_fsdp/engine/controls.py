"""The engine's user-facing controls (torch FSDP2's ``FSDPModule`` methods, for the whole model or chosen units).

[Note: engine controls]
Per-unit state read by the unit's hook when it acts, so a change between micro-batches applies to the next hook;
every rank must make the same changes. Held gradients are not ``.grad`` (a step over them raises). A ``kept`` unit
survives the engine's own reshards (FSDP2's does not after forward) but not an optimizer step, so it never computes
with stale weights; for the same reason a step drops a secondary shard."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.groups import consecutive_subgroup
from lightning_fsdp.engine.options import check_flag, check_reshard_after_forward
from lightning_fsdp.engine.records import TrainingState
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


class EngineControls:
    """``ShardingEngine``'s controls (it inherits them; see [Note: engine controls]). Call on every rank alike."""

    @contextmanager
    def unsharded(self, units: Iterable[FlatUnit] | None = None) -> Iterator[None]:
        """Hold the full parameters of ``units`` (default: all) in their modules for the block (torch FSDP's
        ``summon_full_params``). Enter it on every rank; calls of the model inside it make no collective, so one
        rank may run the model alone. On exit, units that were sharded before are resharded. Use it between steps."""
        units = list(self.units if units is None else units)
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

    def set_requires_gradient_sync(self, requires: bool, units: Iterable[FlatUnit] | None = None) -> None:
        """Whether each unit's (default: all) backward reduces its gradients (torch FSDP2's name). With False the unit
        holds one full-size gradient sum, reduced once by the next backward with True; a step meanwhile raises."""
        check_flag(requires, "requires")
        for unit in self.units if units is None else units:
            unit.requires_gradient_sync = requires

    @contextmanager
    def no_sync(self, units: Iterable[FlatUnit] | None = None) -> Iterator[None]:
        """``set_requires_gradient_sync(False, units)`` inside the block, previous values restored on exit."""
        chosen = list(self.units if units is None else units)
        previous = [unit.requires_gradient_sync for unit in chosen]
        self.set_requires_gradient_sync(False, chosen)
        try:
            yield
        finally:
            for unit, requires in zip(chosen, previous):
                unit.requires_gradient_sync = requires

    def set_prefetch_groups(self, groups: Iterable[Iterable[FlatUnit]]) -> None:
        """No prefetch crosses groups: for parts whose order the first step cannot predict (pipeline stages)."""
        self._prefetch_group = {id(unit): index for index, group in enumerate(groups) for unit in group}

    def set_reshard_after_backward(self, flag: bool) -> None:
        """Whether each unit frees its full parameters when its backward ends (default True; torch FSDP2's name).
        With False they stay until the next optimizer step or ``reshard()``, and later micro-batches gather nothing."""
        check_flag(flag, "flag")
        for unit in self.units:
            unit.reshard_after_backward = flag

    def set_reshard_after_forward(self, value: bool | int | None) -> None:
        """What each unit but the root does with its full parameters after forward: the values of docs/options.md's
        ``reshard_after_forward``. The first use of an N creates process groups: call it on every rank."""
        check_reshard_after_forward(value, self.root_unit.world_size)
        if value is None:
            value = self.sharding_strategy.reshard_after_forward
        secondary = None if isinstance(value, bool) else self._secondary_group(value)
        self.secondary_comm = secondary
        for unit in self.units:
            unit.reshard_after_forward = bool(value)
            unit.secondary_comm = secondary

    def _secondary_group(self, size: int) -> Communicator:
        comm = self._secondary_comms.get(size)
        if comm is None:
            comm = Communicator(consecutive_subgroup(self.shard_comm, size), self.shard_comm.device)
            comm.describe_tag = self._describe_collective
            self._secondary_comms[size] = comm
        return comm

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather every unit now and keep it unsharded until ``reshard()`` or the next optimizer step (torch
        FSDP2's ``unshard``); with ``async_op``, the handle's ``wait()`` completes it. Call on every rank."""
        check_flag(async_op, "async_op")
        for unit in self.units:
            if async_op:
                unit.start_unshard(async_op=True)
            else:
                unit.unshard()
            unit.kept = True
        self._update_peak()
        return UnshardHandle(list(self.units), self._update_peak) if async_op else None

    def reshard(self) -> None:
        """Free every unit's full parameters now, kept ones included (torch FSDP2's ``reshard``, for the whole
        model); a prefetch or an ``unshard(async_op=True)`` in flight is completed first. Not during a backward."""
        if self._training_state is TrainingState.BACKWARD:
            raise RuntimeError(
                "ShardingEngine.reshard() was called during a backward: the units still computing their gradients "
                "need their full parameters. Call it between steps."
            )
        self._reshard_all()

    @contextmanager
    def backward_scope(self, units: Iterable[FlatUnit]) -> Iterator[None]:
        """Backwards run inside this block end the step of ``units`` only and leave every other unit as it is: for
        parts of a model whose backwards run separately, such as two pipeline stages on one rank."""
        previous = self._backward_scope
        self._backward_scope = {id(unit) for unit in units}
        try:
            yield
        finally:
            self._backward_scope = previous
