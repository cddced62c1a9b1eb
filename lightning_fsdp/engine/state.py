"""The runtime of a sharded model: forward/backward hooks, per-step state, gradient norm and accounting.

[Note: a unit's training step]
Per unit and step: unshard before forward; reshard after forward (FULL_SHARD, except the root, whose parameters
are needed again as soon as backward starts); unshard again when the gradient of the unit's output arrives; reduce
the gradients when the gradient of the unit's inputs has been computed, i.e. when the unit's whole backward is
done; reshard. That trigger does not depend on which parameters received gradients, so a parameter that one rank
skips (data-dependent control flow inside a unit) does not change the order of collectives between ranks. A
callback queued on the autograd engine finishes whatever a step left open (units whose inputs need no gradient, the
root), in a fixed unit order, so every rank issues the same collectives in the same order.

[Note: the engine's training state]
``TrainingState`` (as torch FSDP2's) is IDLE between steps, FORWARD while some unit's forward is open and BACKWARD
from the first gradient that reaches a unit until the queued callback (``_finish_backward``) has run. The phases
nest: with manual optimization the backward runs inside the root's forward (the state returns to FORWARD after it),
and activation checkpointing recomputes forwards inside BACKWARD (the state stays BACKWARD). A backward that
raised leaves the state at BACKWARD; the next root forward outside any backward abandons that step. Counts that
really are counts stay counters: the forward depth of the engine and of each unit, and each unit's calls per step
(``UnitStepState``).

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

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.config import BackwardPrefetch, MixedPrecision, ShardingStrategy
from lightning_fsdp.engine.groups import consecutive_subgroup
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.options import check_flag, check_reshard_after_forward
from lightning_fsdp.engine.registry import detach_engine, unwatch_optimizer_steps, watch_optimizer_steps
from lightning_fsdp.engine.streams import CollectiveStreams, streams_for
from lightning_fsdp.engine.unit import CollectiveKind, FlatUnit, ParamSlot


class TrainingState(Enum):
    """What the engine is doing (see [Note: the engine's training state])."""

    IDLE = auto()  # between steps: no unit forward open, no backward in flight
    FORWARD = auto()  # some unit's forward is open, no backward in flight
    BACKWARD = auto()  # a backward reached a unit; ends when ``_finish_backward`` has run


def _current_graph_task_id() -> int:
    """The id of the backward this thread is running, -1 outside any (torch has no public spelling of this)."""
    return torch._C._current_graph_task_id()


# ``Communicator.agree`` tags of collectives that belong to no unit (unit tags are non-negative).
_TAG_IGNORED_GRAD, _TAG_CLIP, _TAG_ANOMALY = -1, -2, -3


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the gradients of those inputs are known: by then the
    autograd engine has run every node the unit's forward created (they were created later, and it runs ready nodes
    newest first), including the gradient accumulation of the unit's parameters."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class UnshardHandle:
    """What ``ShardingEngine.unshard(async_op=True)`` returns: ``wait()`` completes the all-gathers it issued."""

    def __init__(self, engine: ShardingEngine, units: list[FlatUnit]) -> None:
        self._engine = engine
        self._units = units

    def wait(self) -> None:
        for unit in self._units:
            if unit.is_prefetched:  # not yet waited for by its forward, nor resharded since
                unit.unshard()
        self._engine._update_peak()


class ShardingEngine:
    """Owns the units of one root module and drives them from module hooks."""

    def __init__(
        self,
        root: nn.Module,
        units: list[FlatUnit],
        shard_comm: Communicator,
        replicate_comm: Communicator | None,
        sharding_strategy: ShardingStrategy,
        *,
        mixed_precision: MixedPrecision | None = None,
        ignored_params: list[nn.Parameter] | None = None,
        forward_prefetch: bool = False,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers: bool = True,
    ) -> None:
        self.root = root
        self.units = units  # root unit first, then module pre-order: the fixed order for leftover reductions
        self.root_unit = units[0]
        self.shard_comm = shard_comm
        self.replicate_comm = replicate_comm
        self.sharding_strategy = sharding_strategy
        self.mixed_precision = mixed_precision or MixedPrecision()
        self._training_state = TrainingState.IDLE
        self._handles: list[Any] = []
        # Prefetching follows the order units ran in during the first training step (identical on every rank, so
        # every rank issues the same prefetches). If the order changes later, an unused prefetch is completed and
        # resharded at the end of the step: it wastes an all-gather, never unshards wrongly or deadlocks.
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self._order: list[FlatUnit] = []
        self._order_frozen = False
        # The last unit of the forward stays unsharded into its backward, which comes next (see ``_next_up``). Off
        # where forwards of several micro-batches run before their backwards (pipeline schedules).
        self.keep_last_unit_for_backward = True
        self._prefetch_group: dict[int, int] = {}  # set_prefetch_groups: unit id -> group (none: one group)
        self._backward_scope: set[int] | None = None  # backward_scope: the units a backward concerns (None: all)
        self._position: dict[int, int] = {}
        self._slot_by_param = {id(s.param): s for u in units for s in u.slots}
        self.ignored_params = list(ignored_params or [])
        self._ignored_ids = {id(p) for p in self.ignored_params}
        names = {id(p): name for name, p in root.named_parameters(remove_duplicate=False)}
        self._reduced_units: list[FlatUnit] = []
        self._nonfinite_ignored: list[str] = []
        self._forward_depth = 0  # unit forwards open right now (outermost call of each, nested ones included)
        # reshard_after_forward=N: the Communicator over this rank's N consecutive ranks of the shard group, in use now
        # (``secondary_comm``) and by group size (torch's groups are created once, by every rank).
        self.secondary_comm: Communicator | None = None
        self._secondary_comms: dict[int, Communicator] = {}
        # The collectives' streams of the units' compute device (see [Note: collectives on their own streams]).
        streams = streams_for([unit.device for unit in units])
        for index, unit in enumerate(units):
            unit.index = index
            unit.streams = streams[unit.device]
            self._register_hooks(unit)
        # cpu_offload from an accelerator: the host waits for the copies to and from it at the end of backward.
        self._host_copies = any(unit.pinned for unit in units)
        for comm in (shard_comm, replicate_comm):
            if comm is not None:
                comm.describe_tag = self._describe_tag
        self._ignored_names = {id(p): names.get(id(p), "?") for p in self.ignored_params}
        self._ignored_hooked: set[int] = set()
        self._hook_ignored_params()
        self._register_root_hooks()
        self.closed = False

    # ------------------------------------------------------------------------------------------------ hooks
    # [Note: what the hooks guarantee]
    # * The post-forward hook is registered with ``always_call``: it also runs when the forward raises, so a
    #   caught exception (a user's try/except, Lightning's tuners) leaves no unit unsharded or half-counted.
    # * A backward that raised never reaches ``_finish_backward``. The next root forward outside any backward
    #   sees that and abandons the step (``_abandon_step``) before starting a new one.
    # * A forward always computes with the current weights: every root forward starts by resharding whatever an
    #   earlier forward left unsharded (the root, SHARD_GRAD_OP units, a forward whose backward never came), except
    #   kept units, prefetches never outlive the forward or backward that issued them, and every optimizer step
    #   reshards every unit (the root inside its own forward under manual optimization, kept units), which the next
    #   module using it unshards again (see [Note: engine controls]).
    # * ``requires_grad`` is read at each unit's forward (``FlatUnit.sync_requires_grad``), so freezing and
    #   unfreezing at any time trains as in a single process.
    def _register_hooks(self, unit: FlatUnit) -> None:
        self._handles.append(
            unit.module.register_forward_pre_hook(
                lambda module, args, kwargs: self._pre_forward(unit, args, kwargs), with_kwargs=True, prepend=True
            )
        )
        self._handles.append(
            unit.module.register_forward_hook(
                lambda module, args, output: self._post_forward(unit, output), always_call=True
            )
        )

    def _register_root_hooks(self) -> None:
        root = self.root_unit
        # The root's forward is the whole training_step under Lightning, so with manual optimization backward and
        # optimizer steps happen inside it, and toggle_optimizer flips requires_grad there. Modules that use the
        # root's parameters resync their flags when they run.
        users: dict[int, tuple[nn.Module, list]] = {}
        for slot in root.slots:
            for module, _attr in slot.uses:
                if module is not root.module:
                    users.setdefault(id(module), (module, []))[1].append(slot)
        for module, slots in users.values():
            self._handles.append(
                module.register_forward_pre_hook(lambda _m, _a, slots=slots: self._sync_root_slots(slots))
            )
            # Backward may start inside the root's forward too, and need the root again after an earlier backward
            # of the same training_step resharded it: these modules' outputs unshard it, as a unit's outputs do.
            self._handles.append(module.register_forward_hook(lambda _m, _a, output: self._mark_root_use(output)))
        # The root has no unit above it to start backward for it: with manual optimization its backward starts
        # before its forward has ended, so its own gradients announce it.
        for slot in root.slots:
            # torch refuses hooks on tensors that need no gradient; this one stays when the parameter is unfrozen.
            frozen = not slot.full.requires_grad
            slot.full.requires_grad_(True)
            self._handles.append(slot.full.register_post_accumulate_grad_hook(lambda _p: self._start_backward()))
            slot.full.requires_grad_(not frozen)
        watch_optimizer_steps(self)

    def _hook_ignored_params(self) -> None:
        # Ignored parameters that become trainable later get their gradient averaging then.
        for param in self.ignored_params:
            if param.requires_grad and id(param) not in self._ignored_hooked:
                self._ignored_hooked.add(id(param))
                name = self._ignored_names[id(param)]
                self._handles.append(
                    param.register_hook(lambda grad, name=name: self._average_ignored_grad(grad, name))
                )

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._ignored_hooked.clear()

    def _pre_forward(self, unit: FlatUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        first = unit.forward_depth == 0
        # Counted first: the always-called post-forward hook undoes it even if what follows raises.
        unit.forward_depth += 1
        self._forward_depth += 1
        if self._training_state is TrainingState.IDLE:
            self._training_state = TrainingState.FORWARD
        if first:
            if unit is self.root_unit:
                self._begin_root_forward()
            in_backward = self._training_state is TrainingState.BACKWARD
            if not in_backward:
                unit.sync_requires_grad()
                if not self._order_frozen and unit is not self.root_unit and id(unit) not in self._position:
                    self._position[id(unit)] = len(self._order)
                    self._order.append(unit)
            self._make_room(unit)
            unit.unshard()
            self._update_peak()
            if self.forward_prefetch and not in_backward:
                self._prefetch(self._neighbour(unit, +1))
        mp = self.mixed_precision
        changed = False
        if mp.param_dtype is not None and (
            mp.cast_forward_inputs or (unit is self.root_unit and mp.cast_root_forward_inputs)
        ):
            args, kwargs = _cast_floating(args, mp.param_dtype), _cast_floating(kwargs, mp.param_dtype)
            changed = True
        if (
            first
            and unit.trainable_slots
            and torch.is_grad_enabled()
            and self._training_state is not TrainingState.BACKWARD
        ):
            flat, spec = tree_flatten((args, kwargs))
            wanted = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not wanted:
                unit.step_state.untrack_call()
            else:
                unit.step_state.track_call()
                unit.marked_call = True
                marked = _PostBackward.apply(lambda: self._post_backward(unit), *(flat[i] for i in wanted))
                for i, tensor in zip(wanted, marked):
                    flat[i] = tensor
                args, kwargs = tree_unflatten(flat, spec)
                changed = True
        return (args, kwargs) if changed else None

    def _begin_root_forward(self) -> None:
        if self._training_state is TrainingState.BACKWARD:
            if _current_graph_task_id() != -1:
                return  # the root recomputed inside backward (activation checkpointing): the step goes on
            self._abandon_step()
        # Whatever an earlier forward left unsharded may predate an optimizer step: reshard it, unshard afresh. Kept
        # units do not (an optimizer step reshards them).
        self._reshard_all(spare_kept=True)
        self._hook_ignored_params()

    def _post_forward(self, unit: FlatUnit, output: Any) -> None:
        if unit.forward_depth == 0:
            return  # the hooks were added while this forward ran
        unit.forward_depth -= 1
        self._forward_depth -= 1
        in_backward = self._training_state is TrainingState.BACKWARD
        if unit.forward_depth == 0 and not in_backward:
            self._end_forward(unit, output)
        if self._forward_depth == 0 and not in_backward:
            self._training_state = TrainingState.IDLE
            if self.forward_prefetch:
                # A prefetch the forward did not use would otherwise be completed later, with the weights of now.
                # (Backward prefetches end with their backward, in _finish_backward.)
                for other in self.units:
                    if other.is_prefetched and not other.kept:
                        other.reshard()

    def _end_forward(self, unit: FlatUnit, output: Any) -> None:
        marked, unit.marked_call = unit.marked_call, False
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and tensors:
            for tensor in tensors:
                tensor.register_hook(lambda _grad: self._pre_backward(unit))
            if unit.reshard_after_forward and unit is not self.root_unit and not unit.kept and not self._next_up(unit):
                unit.reshard(secondary=unit.secondary_comm)
            return
        if marked:
            # The forward raised (its output is None then) or returned nothing that needs a gradient: no backward
            # will signal the end of this call, so the end of backward reduces the unit.
            unit.step_state.untrack_call(was_tracked=True)
        # No backward will come through this forward (eval, no_grad, nothing requires grad, or it raised).
        if not unit.kept:
            unit.reshard()

    def _next_up(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s backward is the first after this forward: the last unit of the recorded forward order,
        while the step is a plain forward then backward (``keep_last_unit_for_backward``). Resharding it only to
        gather it again at once would cost an all-gather that nothing overlaps; torch's FSDP2 prefetches it during
        the root's backward instead, which holds the same memory."""
        return self.keep_last_unit_for_backward and self._order_frozen and bool(self._order) and unit is self._order[-1]

    def _sync_root_slots(self, slots: list) -> None:
        if self._training_state is TrainingState.BACKWARD:
            return
        root = self.root_unit
        root.sync_requires_grad(slots)
        if root.forward_depth > 0 and not root.is_unsharded:
            root.unshard()

    def _mark_root_use(self, output: Any) -> None:
        root = self.root_unit
        if root.forward_depth == 0 or self._training_state is TrainingState.BACKWARD or not torch.is_grad_enabled():
            return
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda _grad: self._pre_backward(root))

    def _start_backward(self) -> None:
        if self._training_state is not TrainingState.BACKWARD:
            self._training_state = TrainingState.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _before_optimizer_step(self, optimizer: Any, *, after_closure: bool = False) -> None:
        # Gradients held with sync off are not in the shards' .grad yet: a step now would use partial gradients.
        if not after_closure:
            self._check_held_gradients(optimizer, late=False)

    def _check_held_gradients(self, optimizer: Any, *, late: bool) -> None:
        if self.closed or self._training_state is TrainingState.BACKWARD:
            return
        holding = [u for u in self.units if u.grads_unsynced]
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

    def _after_optimizer_step(self) -> None:
        # Full parameters unsharded before a step are stale: kept units, and the root when manual optimization steps
        # inside its forward (training_step). Resharded, the modules show the user's updated parameters (weight
        # clipping after a step edits them), and the next module using them unshards them again.
        if self.closed or self._training_state is TrainingState.BACKWARD:
            return
        self._reshard_all()

    def reshard_idle(self) -> None:
        """Between forwards: reshard whatever an earlier forward left unsharded (the root, SHARD_GRAD_OP units, a
        forward whose backward never came, kept units), so that the modules hold the user's parameters again.
        Checkpoint functions call it before reading parameters by name. Safe while a backward is still to come:
        backward unshards again."""
        if not self.closed and self._training_state is TrainingState.IDLE:
            self._reshard_all()

    def _reshard_all(self, *, spare_kept: bool = False) -> None:
        """Reshard every unit whose forward is not running (the root's is when the step is its forward), except kept
        ones with ``spare_kept``."""
        for unit in self.units:
            if (unit is self.root_unit or unit.forward_depth == 0) and not (spare_kept and unit.kept):
                unit.reshard()

    def _abandon_step(self) -> None:
        """A backward raised (on every rank) before it ended: drop what it left in flight and start clean."""
        for unit in self.units:
            unit.abandon()
        self._reduced_units.clear()
        self._nonfinite_ignored = []
        self._begin_step()
        self._end_backward_state()

    def _pre_backward(self, unit: FlatUnit) -> None:
        self._start_backward()
        self._make_room(unit)
        unit.unshard()
        self._update_peak()
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch(self._neighbour(unit, -1))

    def _post_backward(self, unit: FlatUnit) -> None:
        if not unit.step_state.backward_ended():
            return  # not every call's backward has ended (or one cannot signal it: then _finish_backward reduces)
        # Reshard before the reduction allocates its buffers (the gradients do not need the full parameters).
        self._reshard_after_backward(unit)
        self._reduce(unit)
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch(self._neighbour(unit, -1))

    def _reshard_after_backward(self, unit: FlatUnit) -> None:
        if unit.kept:
            return
        if not unit.reshard_after_backward and unit.is_unsharded:
            unit.kept = True
            return
        unit.reshard()

    def _reduce(self, unit: FlatUnit) -> None:
        """The unit's gradients of this backward are complete: reduce them (with any it holds), or hold them when
        its gradient sync is off (see [Note: engine controls])."""
        if not unit.requires_gradient_sync:
            unit.hold_grads()
            unit.step_state.reduced = True
            return
        # One reduction in flight at a time: the previous unit's had this unit's whole backward to complete, and
        # waiting for it here bounds the full-size gradient buffers kept alive to two units'.
        self._finish_reductions()
        unit.reduce_grads()
        unit.step_state.reduced = True
        self._reduced_units.append(unit)

    def _finish_reductions(self) -> None:
        # Only the latest reduction can still be in flight: each one waited for its predecessor before starting.
        if self._reduced_units:
            self._reduced_units[-1].finish_reduce()

    def _neighbour(self, unit: FlatUnit, step: int) -> FlatUnit | None:
        """The unit after (+1) or before (-1) ``unit`` in the recorded forward order; backward runs it reversed."""
        if not self._order_frozen or id(unit) not in self._position:
            return None
        index = self._position[id(unit)] + step
        found = self._order[index] if 0 <= index < len(self._order) else None
        if found is not None and self._prefetch_group.get(id(found)) != self._prefetch_group.get(id(unit)):
            return None
        return found

    def _prefetch(self, unit: FlatUnit | None) -> None:
        if unit is None or unit.is_alive or not unit.sharded:
            return
        if self.limit_all_gathers and self._alive_units() >= 2:
            return  # at most two units' full parameters in flight
        unit.start_unshard(async_op=True)
        self._update_peak()

    def _make_room(self, unit: FlatUnit) -> None:
        """Before unsharding ``unit``: drop prefetches the order no longer needs, to stay within the limit."""
        if not self.limit_all_gathers or unit.is_alive or unit is self.root_unit:
            return
        for other in self.units:
            if self._alive_units() < 2:
                return
            if other is not unit and other.is_prefetched and not other.kept:
                other.reshard()

    def _alive_units(self) -> int:
        return sum(1 for u in self.units if u is not self.root_unit and u.sharded and u.is_alive)

    def _finish_backward(self) -> None:
        try:
            for unit in reversed(self.units):
                if not self._in_scope(unit):
                    continue
                # Inside the root's forward too (manual optimization): the modules then show the user's parameters
                # (weight clipping after the step edits the shards), and the next module using the root unshards it.
                self._reshard_after_backward(unit)
                if unit.trainable_slots and not unit.step_state.reduced:
                    self._reduce(unit)
            self._finish_reductions()
            if self._host_copies:
                self._wait_host_copies()
            self._check_no_late_gradients()
            self._restore_none_gradients()
            if torch.is_anomaly_enabled():
                self._report_nonfinite()
        finally:
            self._reduced_units.clear()
            self._begin_step()
            self._end_backward_state()
            self._order_frozen = True

    def _wait_host_copies(self) -> None:
        """cpu_offload on an accelerator: the host waits for the asynchronous copies of shards to the device and of
        reduced gradients to the host before clipping or the optimizer reads or writes them there."""
        for streams in {id(u.streams): u.streams for u in self.units if u.pinned and u.streams.active}.values():
            streams.synchronize()

    @property
    def streams(self) -> CollectiveStreams:
        """The streams the root unit's collectives run on (inactive on CPU)."""
        return self.root_unit.streams

    def _use_streams(self, streams: CollectiveStreams) -> None:
        """Every unit's collectives on ``streams`` from now on (the tests' recording fake); between steps only."""
        for unit in self.units:
            unit.streams = streams

    def _end_backward_state(self) -> None:
        # The backward may have run inside the root's forward (manual optimization), which is still open.
        self._training_state = TrainingState.FORWARD if self._forward_depth > 0 else TrainingState.IDLE

    def _begin_step(self) -> None:
        for unit in self.units:
            if self._in_scope(unit):
                unit.begin_step()

    def _in_scope(self, unit: FlatUnit) -> bool:
        return self._backward_scope is None or id(unit) in self._backward_scope

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

    def _check_no_late_gradients(self) -> None:
        # A gradient that arrived after its unit was reduced would silently join the next step's reduction.
        late = [s.fqn for u in self.units if self._in_scope(u) for s in u.slots if s.full.grad is not None]
        if late:
            raise RuntimeError(
                f"Gradients for {late} arrived after their unit had been reduced. This happens when a sharded "
                "module's parameters are used outside its forward (e.g. by another module); wrap the modules so "
                "that the unit owning a parameter encloses every use of it."
            )

    def _restore_none_gradients(self) -> None:
        """Parameters no rank used this backward get ``None`` back, as in a single process (one host sync)."""
        counts = [u.used_counts for u in self._reduced_units if u.used_counts is not None and u.used_counts.numel()]
        if counts and not bool((torch.cat([c.to(self.root_unit.device) for c in counts]) > 0).all()):
            for unit in self._reduced_units:
                unit.drop_unused_grads()

    def _report_nonfinite(self) -> None:
        """Anomaly checking: name every parameter whose gradient was NaN or Inf on some rank, on every rank."""
        local = [name for u in self._reduced_units for name in u.nonfinite] + self._nonfinite_ignored
        self._nonfinite_ignored = []
        for unit in self._reduced_units:
            unit.nonfinite = []
        comms = [self.shard_comm] + ([self.replicate_comm] if self.replicate_comm is not None else [])
        found: dict[str, set[str]] = {}
        for name in local:
            found.setdefault(name, set()).add(f"rank {dist.get_rank() if dist.is_initialized() else 0}")
        for comm in comms:
            comm.agree(_TAG_ANOMALY)
            merged: dict[str, set[str]] = {}
            for other in comm.all_gather_object(found):
                for name, where in other.items():
                    merged.setdefault(name, set()).update(where)
            found = merged
        if found:
            listing = ", ".join(f"{name!r} ({', '.join(sorted(where))})" for name, where in sorted(found.items()))
            raise FloatingPointError(
                f"Non-finite gradient (NaN or Inf) in parameter(s) {listing}, found by anomaly checking before "
                "the gradients were reduced; the ranks named are those whose own gradient was not finite."
            )

    def _describe_tag(self, tag: int) -> str:
        fixed = {
            _TAG_IGNORED_GRAD: "all-reduce of an ignored parameter's gradient",
            _TAG_CLIP: "all-reduce of the gradient norm",
            _TAG_ANOMALY: "the end-of-backward anomaly report",
        }
        if tag in fixed:
            return fixed[tag]
        index, kind = divmod(tag, len(CollectiveKind))
        what = {
            CollectiveKind.ALL_GATHER: "all-gather of",
            CollectiveKind.REDUCE: "gradient reduction of",
            CollectiveKind.REPLICATE: "replica all-reduce of",
        }[CollectiveKind(kind)]
        name = self.units[index].name if 0 <= index < len(self.units) else f"#{index}"
        return f"{what} unit {name or '<root>'!r}"

    def _update_peak(self) -> None:
        stats = self.shard_comm.stats
        stats.peak_gathered_units = max(stats.peak_gathered_units, self._alive_units())

    # ------------------------------------------------------------------------------------- user utilities
    @contextmanager
    def unsharded(self, units: Iterable[FlatUnit] | None = None) -> Iterator[None]:
        """Hold full parameters of ``units`` (default: all) in their modules, e.g. for inspection; no autograd.
        Units unsharded before are left so; the others are resharded on exit."""
        units = list(self.units if units is None else units)
        was = [u.is_unsharded for u in units]
        try:
            with torch.no_grad():
                for unit in units:
                    unit.unshard()
            yield
        finally:
            for unit, keep in zip(units, was):
                if not keep:
                    unit.reshard()

    # ------------------------------------------------------------------------------------------- controls
    # Per-unit state read by the hooks; see [Note: engine controls]. Call each on every rank at the same point.
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
            comm.describe_tag = self._describe_tag
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
        return UnshardHandle(self, list(self.units)) if async_op else None

    def reshard(self) -> None:
        """Free every unit's full parameters now, kept ones included (torch FSDP2's ``reshard``, for the whole
        model); a prefetch or an ``unshard(async_op=True)`` in flight is completed first. Not during a backward."""
        if self._training_state is TrainingState.BACKWARD:
            raise RuntimeError(
                "ShardingEngine.reshard() was called during a backward: the units still computing their gradients "
                "need their full parameters. Call it between steps."
            )
        self._reshard_all()

    def _average_ignored_grad(self, grad: torch.Tensor, name: str) -> torch.Tensor:
        # An ignored parameter is whole on every rank; its incoming gradient (this backward's contribution, before
        # accumulation into .grad) is averaged like DDP's, so accumulation across micro-batches stays correct.
        if torch.is_anomaly_enabled() and not bool(torch.isfinite(grad).all()):
            self._nonfinite_ignored.append(name)
        grad = grad.clone()
        ranks = self.shard_comm.world_size
        self.shard_comm.agree(_TAG_IGNORED_GRAD)
        self.shard_comm.all_reduce(grad)
        if self.replicate_comm is not None and self.replicate_comm.world_size > 1:
            self.replicate_comm.agree(_TAG_IGNORED_GRAD)
            self.replicate_comm.all_reduce(grad)
            ranks *= self.replicate_comm.world_size
        return grad.div_(ranks)

    def slot_of(self, param: nn.Parameter) -> ParamSlot | None:
        """The ``ParamSlot`` of a parameter a unit shards (its name, layout, uses and full stand-in); None for any other
        parameter (ignored ones, or another model's)."""
        return self._slot_by_param.get(id(param))

    def is_managed(self, param: nn.Parameter) -> bool:
        """Whether the strategy handles ``param`` (sharded by a unit, or deliberately kept whole as ignored)."""
        return id(param) in self._slot_by_param or id(param) in self._ignored_ids

    def is_sharded(self, param: nn.Parameter) -> bool:
        slot = self._slot_by_param.get(id(param))
        return slot is not None and slot.layout.world_size > 1

    def layout_of(self, param: nn.Parameter) -> ShardLayout | None:
        """Which rows of ``param`` this rank holds (its ``ShardLayout``); None for a parameter no unit shards."""
        slot = self._slot_by_param.get(id(param))
        return slot.layout if slot is not None else None

    @property
    def training_state(self) -> TrainingState:
        """IDLE between steps, FORWARD or BACKWARD inside one (see [Note: the engine's training state])."""
        return self._training_state

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        parameters: Iterable[nn.Parameter],
        max_norm: float,
        norm_type: float = 2.0,
        *,
        stage_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """Clip gradients by the global norm over all shards: the value an unsharded run computes.

        Must be called on every rank of the shard group with the same parameters (it all-reduces one scalar).
        ``stage_group``: the ranks holding the other pipeline stages (different parameters): the norm is combined
        over it too, so every stage clips by the whole model's norm.
        """
        norm_type = float(norm_type)
        params = [p for p in parameters if p.grad is not None]
        sharded = [p.grad for p in params if self.is_sharded(p)]
        replicated = [p.grad for p in params if not self.is_sharded(p)]
        device = self.root_unit.device
        local = _norm_term(sharded, norm_type, device)
        self.shard_comm.agree(_TAG_CLIP)
        if math.isinf(norm_type):
            self.shard_comm.all_reduce(local, op=dist.ReduceOp.MAX)
            total = torch.maximum(local, _norm_term(replicated, norm_type, device))
            if stage_group is not None:
                _all_reduce_on(total, stage_group, dist.ReduceOp.MAX)
        else:
            self.shard_comm.all_reduce(local)
            total = local + _norm_term(replicated, norm_type, device)
            if stage_group is not None:
                _all_reduce_on(total, stage_group, dist.ReduceOp.SUM)
            total = total ** (1.0 / norm_type)
        # torch's own scaling by a given total norm groups the gradients by device and dtype: with cpu_offload the
        # sharded ones live in host memory, the replicated ones (ignored parameters) and the norm on the accelerator.
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    @torch.no_grad()
    def restore_unsharded(self, device: torch.device | str = "cpu") -> None:
        """Give every parameter its full value on ``device``, remove the engine's hooks and let go of the module.

        Afterwards the module is an ordinary one that computes exactly what the sharded one did: usable for
        inference on one rank, or by a new Trainer, which shards it afresh. Call it on every rank of the shard
        group (each unit is unsharded once); the engine cannot be used afterwards. Gradients are dropped: they were
        shards. Peak memory on the accelerator: one unit in full.
        """
        if self.closed:
            return
        self._finish_reductions()
        for unit in self.units:
            unit.reshard()
            fulls = unit.full_tensors()
            for slot, full in zip(unit.slots, fulls):
                slot.param.data = full.to(device)
                slot.param.grad = None
                for module, attr in slot.uses:
                    module._parameters[attr] = slot.param
            unit.release_buffers()
        self.remove_hooks()
        self.closed = True
        unwatch_optimizer_steps(self)
        detach_engine(self.root)

    def shard_of(self, slot: Any) -> torch.Tensor:
        """This rank's rows of a managed parameter: its data while sharded, a slice of its full value once the
        engine gave the module its parameters back (``trainer.save_checkpoint`` after ``fit`` still saves shards)."""
        if not self.closed:
            return slot.param.data
        return slot.layout.local_slice(slot.param.data).to(self.root_unit.shard_device)

    # ------------------------------------------------------------------------------------------ accounting
    def local_param_bytes(self) -> int:
        """Bytes of parameter data this rank holds between steps (its shards, padding excluded)."""
        return sum(u.local_param_bytes() for u in self.units)

    def full_param_bytes(self) -> int:
        """Bytes of the unsharded model's managed parameters."""
        return sum(u.full_param_bytes() for u in self.units)

    def held_grad_bytes(self) -> int:
        """Bytes of the full-size gradients units hold for a later reduction (gradient sync off)."""
        return sum(u.held_grad_bytes() for u in self.units)

    def local_grad_bytes(self) -> int:
        return sum(
            s.param.grad.numel() * s.param.grad.element_size()
            for u in self.units
            for s in u.slots
            if s.param.grad is not None
        )


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


# [Note: the global gradient norm]
# The norm of all gradients is a reduction of per-tensor norms: the sum of their p-th powers, or their maximum for
# the inf norm. Each rank computes that term for its shards, one all-reduce (SUM, or MAX) combines the ranks, and
# the term of the parameters every rank holds whole (ignored ones) is added once, after it. torch's public
# ``get_total_norm`` (torch >= 2.6) computes the same local term's root, but it is not used: it returns the norm in
# the gradients' dtype, so with low-precision shards (``precision="bf16-true"``) each rank's term would be rounded
# to bfloat16 before the ranks are combined (measured 0.03-0.5% off the float32 value, against 3e-7 for float32
# gradients), and its inf norm raises on an empty tensor, which a rank past the last row of a parameter holds.
# The per-tensor norms are torch's (``_foreach_norm``, the kernel ``get_total_norm`` uses too), combined in
# float32; the scaling by the total is torch's ``clip_grads_with_norm_``.
def _all_reduce_on(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp) -> None:
    """In place, on ``group``; through host memory where the group is gloo's and the tensor is not."""
    if dist.get_backend(group) == "gloo" and tensor.device.type != "cpu":
        host = tensor.cpu()
        dist.all_reduce(host, op=op, group=group)
        tensor.copy_(host)
    else:
        dist.all_reduce(tensor, op=op, group=group)


def _norm_term(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's part of the total ``norm_type``-norm of ``grads``: the sum of the per-tensor norms' p-th powers,
    or their maximum for the inf norm; zero for none (float32, on ``device``)."""
    if math.isinf(norm_type):
        grads = [g for g in grads if g.numel()]  # an empty shard adds nothing, and torch's inf norm refuses one
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([n.float() for n in torch._foreach_norm(grads, norm_type)])
    term = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
    return term.to(device)
