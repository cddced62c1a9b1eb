"""The engine's user-facing controls (torch FSDP2's ``FSDPModule`` methods, for the whole model or chosen units):
what a pipeline schedule or a gradient-accumulation loop calls between forwards and backwards.

[Note: engine controls]
The controls (named as torch FSDP2's, for pipeline schedules and gradient accumulation) are per-unit state, not
arguments of a call: each is read by the unit's hook at the moment that hook acts, so setting one between
microbatches changes what the next hook does, and what a unit holds (kept parameters, a secondary shard, gradients)
stays until a later hook or call releases it. The engine's setters set every unit alike; every rank must set the
same values at the same points, as the collectives depend on them.

* ``requires_gradient_sync`` is read when a unit's backward ends. True: its gradients, plus any it holds, are reduced
  into the shards' ``.grad`` (one reduction, as always). False: they are added to the full-size gradients it holds
  (``FlatUnit.hold_grads``), with no communication; the next backward with sync on reduces the sum once (DDP's and
  FSDP2's ``no_sync``). An optimizer step over a unit that holds gradients raises before stepping: its shards'
  ``.grad`` lacks them. ``zero_grad`` does not see held gradients (they are not ``.grad``). Parameters the engine
  keeps whole (ignored ones) are still averaged at every backward: the result is the same, only the traffic is not.
* ``reshard_after_backward`` is read when a unit's backward ends. False: the unit stays unsharded and ``kept``.
* ``unshard()`` unshards every unit now and keeps it; ``reshard()`` reshards every unit now.
* A ``kept`` unit is left alone by every reshard the engine does on its own: after its forward (whatever
  ``reshard_after_forward`` says), after its backward, at the next root forward, and to make room for prefetches. So
  the next microbatches' forwards and backwards gather nothing. (torch's FSDP2 still reshards such a unit after its
  next forward when ``reshard_after_forward`` is True, and gathers it again in backward.) It never computes with
  stale weights: every optimizer step reshards every unit, kept ones too, so the next use gathers the updated
  shards; so do ``reshard()``, ``reshard_idle()`` (checkpoints) and ``restore_unsharded()``.
* ``reshard_after_forward`` is read when a unit's forward ends (never for the root, whose parameters backward needs
  first, nor for a kept unit). False: the unit stays unsharded until its backward ends. True: it is resharded. An int
  N: it is resharded, but first keeps this rank's 1/N of the full parameters (``SecondaryShard``), so its backward's
  unshard all-gathers over the N consecutive ranks of the shard group this rank belongs to (ZeRO++ hpZ) instead of
  the whole group. The secondary shard is used up by that unshard and dropped by any other reshard (an optimizer step
  between a forward and its backward would have made it stale); the unshard then gathers from the shard group.
* The flags are independent of one another: no_sync with reshard_after_backward off is gradient accumulation that
  neither communicates gradients nor gathers parameters again until the last microbatch and the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.groups import consecutive_subgroup
from lightning_fsdp.engine.options import check_flag, check_reshard_after_forward
from lightning_fsdp.engine.states import TrainingState
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
    """The controls of ``ShardingEngine``, which inherits them (the attributes are the engine's). Per-unit state read
    by the hooks; see [Note: engine controls]. Call each on every rank at the same point."""

    @contextmanager
    def unsharded(self, units: Iterable[FlatUnit] | None = None) -> Iterator[None]:
        """Hold the full parameters of ``units`` (default: all) in their modules for the block (torch FSDP's
        ``summon_full_params``): enter it on every rank, after which calls of the model inside it make no
        collective, so one rank may run the model alone (sampling on rank 0). The units stay unsharded during the
        block (kept); those unsharded before are left so on exit, the others are resharded. The gathering runs
        without autograd; use it between steps, not inside one."""
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
        """Whether each unit's backward reduces its gradients across ranks (default True; torch FSDP2's name).

        With False, a unit's backward only adds its full-size gradients to the ones it holds (memory: one full
        gradient per unit, until reduced); the next backward with True reduces the accumulated sum once, as
        syncing every backward would have (gradient accumulation without communication on all but the last
        micro-batch). An optimizer step while gradients are held raises ``RuntimeError``. ``units``: only these
        (default: all; pipeline stages on one rank reduce at different backwards).
        """
        check_flag(requires, "requires")
        for unit in self.units if units is None else units:
            unit.requires_gradient_sync = requires

    @contextmanager
    def no_sync(self, units: Iterable[FlatUnit] | None = None) -> Iterator[None]:
        """``set_requires_gradient_sync(False, units)`` inside the block; each unit's previous value is restored on
        exit."""
        chosen = list(self.units if units is None else units)
        previous = [unit.requires_gradient_sync for unit in chosen]
        self.set_requires_gradient_sync(False, chosen)
        try:
            yield
        finally:
            for unit, requires in zip(chosen, previous):
                unit.requires_gradient_sync = requires

    def set_prefetch_groups(self, groups: Iterable[Iterable[FlatUnit]]) -> None:
        """Prefetching never crosses from one group of units to another. The order units are prefetched in is the
        forward order of the first step; where separate parts of the model run in an order that does not predict
        (pipeline stages on one rank, driven by a schedule), each part is a group and prefetches only within it."""
        self._prefetch_group = {id(unit): index for index, group in enumerate(groups) for unit in group}

    def set_reshard_after_backward(self, flag: bool) -> None:
        """Whether each unit frees its full parameters when its backward ends (default True; torch FSDP2's name).

        With False a unit stays unsharded after its backward, so the next micro-batches' forwards and backwards
        all-gather nothing; the next optimizer step (or ``reshard()``) frees it, so it never computes with stale
        weights. Costs the unit's full parameters in memory from its backward to that step.
        """
        check_flag(flag, "flag")
        for unit in self.units:
            unit.reshard_after_backward = flag

    def set_reshard_after_forward(self, value: bool | int | None) -> None:
        """What each unit (except the root) does with its full parameters when its forward ends.

        True frees them (backward all-gathers them again over the shard group); False keeps them until backward;
        an int N (1 < N < shard group size, dividing it) frees them but keeps this rank's 1/N of them, so
        backward's all-gather runs over N consecutive ranks of the shard group only (ZeRO++ hpZ: less traffic
        across nodes, 1/N of the unit in memory meanwhile). None: the sharding strategy's default (FULL_SHARD and
        HYBRID_SHARD True, the others False). A bad value raises ``ValueError`` before any collective. The first
        use of an N creates torch process groups: call on every rank of the world, with the same value.
        """
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
        """All-gather every unit now and keep it unsharded (torch FSDP2's ``unshard``, for the whole model).

        Forwards and backwards then gather nothing and free nothing until ``reshard()`` or the next optimizer step
        frees the units. With ``async_op`` the all-gathers are only issued and the returned handle's ``wait()``
        completes them (a unit's forward also completes its own). Call on every rank of the shard group.
        """
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
        """Backwards run inside this block concern ``units`` only: their end reduces (or holds) and forgets the step
        of these units and leaves every other unit as it is. For parts of a model whose backwards run separately,
        such as two pipeline stages on one rank: a backward of one must neither reduce the other's units early nor
        drop the records of their forwards, whose backwards are still to come."""
        previous = self._backward_scope
        self._backward_scope = {id(unit) for unit in units}
        try:
            yield
        finally:
            self._backward_scope = previous
