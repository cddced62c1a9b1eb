"""The engine: the hooks on a sharded model, its training state, and the scheduling of its units; each unit does its
own part of a phase (``FlatUnit.pre_forward`` ...). The phases: docs/how-it-works.md ("A training step").

[Note: the engine's training state]
``TrainingState`` (as FSDP2's): IDLE between steps, FORWARD while a unit's forward is open, BACKWARD from the first
gradient until ``_finish_backward``. The phases nest: under manual optimization backward runs inside the root's
forward (back to FORWARD after it); activation checkpointing recomputes forwards inside BACKWARD. A backward that
raised leaves BACKWARD; the next root forward outside a backward abandons that step."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from lightning_fsdp.engine.clip import clip_grad_norm_
from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.controls import (
    UnshardHandle,
    check_held_gradients,
    gradient_sync_off,
    hold_unsharded,
    secondary_group,
    unshard_and_keep,
)
from lightning_fsdp.engine.devices import device_runtime
from lightning_fsdp.engine.diagnostics import describe_collective, report_nonfinite
from lightning_fsdp.engine.host_memory import largest_backward_block
from lightning_fsdp.engine.ignored import IgnoredParams
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.options import (
    BackwardPrefetch,
    MixedPrecision,
    ShardingStrategy,
    check_flag,
    check_reshard_after_forward,
)
from lightning_fsdp.engine.records import ParamSlot, TrainingState
from lightning_fsdp.engine.registry import detach_engine, unwatch_optimizer_steps, watch_optimizer_steps
from lightning_fsdp.engine.streams import CollectiveStreams, streams_for
from lightning_fsdp.engine.tensor_parallel import split_pieces
from lightning_fsdp.engine.unit import FlatUnit, only_embedding_lookups


def outside_compile(hook: Callable[..., object]) -> Callable[..., object]:
    """``hook`` runs eagerly even when called from compiled code (see [Note: compiled modules])."""
    return torch.compiler.disable(hook, recursive=True, reason="fsdp_custom engine hook")


def _current_graph_task_id() -> int:
    """The id of the backward this thread is running, -1 outside any (torch has no public spelling of this)."""
    return torch._C._current_graph_task_id()


class ShardingEngine:
    """Owns the units of one root module and drives them from module hooks; its public methods are the user's
    controls (see [Note: engine controls]). Call them on every rank alike."""

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
        self._runtime = device_runtime(self.root_unit.device)
        self.shard_comm = shard_comm
        self.replicate_comm = replicate_comm
        self.sharding_strategy = sharding_strategy
        self.mixed_precision = mixed_precision or MixedPrecision()
        self._training_state = TrainingState.IDLE
        self._handles: list[RemovableHandle] = []
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self._order: list[FlatUnit] = []
        self._order_frozen = False
        # Off where several micro-batches' forwards precede their backwards (pipeline schedules); see ``_next_up``.
        self.keep_last_unit_for_backward = True
        self._prefetch_group: dict[int, int] = {}  # set_prefetch_groups: unit id -> group (none: one group)
        self._backward_scope: set[int] | None = None  # backward_scope: the units a backward concerns (None: all)
        self._position: dict[int, int] = {}
        self._slot_by_param = {id(s.param): s for u in units for s in u.slots}
        names = {id(p): name for name, p in root.named_parameters(remove_duplicate=False)}
        self._ignored = IgnoredParams(list(ignored_params or []), names, shard_comm, replicate_comm)
        self._reduced_units: list[FlatUnit] = []
        # See [Note: the root freed inside backward]: the root's parameters its backward reads, those whose gradient
        # this backward still awaits (None: the root is not freed early), and whether it was.
        self._root_reads = [s for s in self.root_unit.slots if not only_embedding_lookups([s])]
        self._root_awaited: set[int] | None = None
        self._root_freed_early = False
        self._largest_backward_block = largest_backward_block(units)  # whether freeing host memory lowers the peak
        # Whether the previous unit's reduction is finished before a unit's backward starts: on the host at scale, so
        # that one unit's full-size gradients are alive at a time instead of two (see the runtime's rule).
        self.finish_reduction_first = self._runtime.finishes_reduction_first(self._largest_backward_block)
        self._forward_depth = 0  # unit forwards open right now (outermost call of each, nested ones included)
        # reshard_after_forward=N: cached by size, as torch's groups are created once, by every rank.
        self.secondary_comm: Communicator | None = None
        self._secondary_comms: dict[int, Communicator] = {}
        streams = streams_for([unit.device for unit in units])
        for index, unit in enumerate(units):
            unit.index = index
            unit.streams = streams[unit.device]
            self._register_hooks(unit)
        self._host_copies = any(unit.pinned for unit in units)
        for comm in (shard_comm, replicate_comm):
            if comm is not None:
                comm.describe_tag = self._describe_collective
        self._ignored.hook_trainable()
        self._register_root_hooks()
        self.closed = False

    # What the hooks guarantee: docs/how-it-works.md ("Models that change between steps").
    #
    # [Note: calls from outside a step]
    # Calls outside a step (callbacks sampling, ``generate()``) unshard and reshard as in a step and must be made on
    # every rank; they record no prefetch order. A call on one rank alone needs ``unsharded()`` first.
    #
    # [Note: compiled modules] (docs/compile.md)
    # Every hook runs outside dynamo, as FSDP2's: a module compiled alone is one graph inside its unit's eager hooks;
    # inside a larger compiled region the hooks are graph breaks. Shapes never change, so nothing recompiles.
    def _register_hooks(self, unit: FlatUnit) -> None:
        self._handles.append(
            unit.module.register_forward_pre_hook(
                outside_compile(lambda module, args, kwargs: self._pre_forward(unit, args, kwargs)),
                with_kwargs=True,
                prepend=True,
            )
        )
        self._handles.append(
            unit.module.register_forward_hook(
                outside_compile(lambda module, args, output: self._post_forward(unit, output)), always_call=True
            )
        )

    def _register_root_hooks(self) -> None:
        root = self.root_unit
        # Manual optimization flips requires_grad inside the root's forward: the root's users resync when they run.
        users: dict[int, tuple[nn.Module, list]] = {}
        for slot in root.slots:
            for module, _attr in slot.uses:
                if module is not root.module:
                    users.setdefault(id(module), (module, []))[1].append(slot)
        for module, slots in users.values():
            self._handles.append(
                module.register_forward_pre_hook(
                    outside_compile(lambda _m, _a, slots=slots: self._sync_root_slots(slots))
                )
            )
            # A later backward of the same training_step needs the root again: these outputs unshard it (unless the
            # module's backward reads none of its parameters: [Note: an embedding's backward reads no weight]).
            reads = not only_embedding_lookups(slots)
            self._handles.append(
                module.register_forward_hook(
                    outside_compile(lambda _m, _a, output, reads=reads: self._mark_root_use(output, gather=reads))
                )
            )
        # No unit above the root starts its backward, which may begin before its forward ends: its gradients do.
        for slot in root.slots:
            # torch refuses hooks on tensors that need no gradient; this one stays when the parameter is unfrozen.
            frozen = not slot.full.requires_grad
            slot.full.requires_grad_(True)
            self._handles.append(
                slot.full.register_post_accumulate_grad_hook(lambda _p, slot=slot: self._root_gradient_ready(slot))
            )
            slot.full.requires_grad_(not frozen)
        watch_optimizer_steps(self)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._ignored.remove_hooks()

    def _pre_forward(self, unit: FlatUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        first = unit.forward_depth == 0
        # Counted first: the always-called post-forward hook undoes it even if what follows raises.
        unit.forward_depth += 1
        self._forward_depth += 1
        if self._training_state is TrainingState.IDLE:
            self._training_state = TrainingState.FORWARD
        if first and unit is self.root_unit:
            self._begin_root_forward()
        in_backward = self._training_state is TrainingState.BACKWARD
        if first:
            if not in_backward:
                unit.sync_requires_grad()
                # Only a training step records the prefetch order.
                if (
                    not self._order_frozen
                    and unit is not self.root_unit
                    and self.root_unit.forward_depth > 0
                    and id(unit) not in self._position
                ):
                    self._position[id(unit)] = len(self._order)
                    self._order.append(unit)
            self._make_room(unit)
        mp = self.mixed_precision
        cast = mp.param_dtype is not None and (
            mp.cast_forward_inputs or (unit is self.root_unit and mp.cast_root_forward_inputs)
        )
        changed = unit.pre_forward(
            args,
            kwargs,
            first=first,
            in_backward=in_backward,
            cast_dtype=mp.param_dtype if cast else None,
            on_backward_end=lambda: self._post_backward(unit),
        )
        if first:
            self._update_peak()
            if self.forward_prefetch and not in_backward:
                self._prefetch(self._neighbour(unit, +1))
        return changed

    def _begin_root_forward(self) -> None:
        if self._training_state is TrainingState.BACKWARD:
            if _current_graph_task_id() != -1:
                return  # the root recomputed inside backward (activation checkpointing): the step goes on
            self._abandon_step()
        # What an earlier forward left unsharded may predate an optimizer step (kept units: the step resharded them).
        self._reshard_all(spare_kept=True)
        self._ignored.hook_trainable()

    def _post_forward(self, unit: FlatUnit, output: object) -> None:
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
                # An unused prefetch would otherwise be completed later, with the weights of now.
                for other in self.units:
                    if other.is_prefetched and not other.kept:
                        other.reshard()

    def _end_forward(self, unit: FlatUnit, output: object) -> None:
        may_reshard = unit is not self.root_unit and not self._next_up(unit)
        unit.post_forward(output, may_reshard=may_reshard, on_backward_start=lambda: self._pre_backward(unit))

    def _next_up(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s backward comes first after this forward (last in the recorded order): resharding it
        would cost an all-gather nothing overlaps (docs/how-it-works.md, "A training step")."""
        return self.keep_last_unit_for_backward and self._order_frozen and bool(self._order) and unit is self._order[-1]

    def _sync_root_slots(self, slots: list[ParamSlot]) -> None:
        if self._training_state is TrainingState.BACKWARD:
            if self._root_freed_early:
                self.root_unit.unshard()  # a forward recomputed after the root was freed (activation checkpointing)
            return
        self.root_unit.sync_requires_grad(slots)
        # Also outside the root's forward (see [Note: calls from outside a step]).
        if not self.root_unit.is_unsharded:
            self.root_unit.unshard()

    def _mark_root_use(self, output: object, *, gather: bool) -> None:
        root = self.root_unit
        if root.forward_depth == 0 or self._training_state is TrainingState.BACKWARD or not torch.is_grad_enabled():
            return
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda _grad: self._pre_backward(root, gather=gather))

    def _start_backward(self) -> None:
        if self._training_state is not TrainingState.BACKWARD:
            self._training_state = TrainingState.BACKWARD
            self._root_awaited = self._root_reads_to_await()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    # [Note: the root freed inside backward]
    # The root's parameters sit outside every unit (the token embedding, the final norm, the head), so the root's
    # backward ends with the whole backward: kept until then, its full parameters would be alive through every other
    # unit's backward (at 0.84B, 500 MiB at the peak). A parameter's gradient is accumulated once every use of it in
    # the graph has sent its part, so no node of this backward reads it afterwards. Once that has happened to every
    # root parameter the backward reads (all but embedding lookups), the root is resharded right away; the lookups
    # still to come accumulate into the full-size stand-ins by their shape. A frozen parameter the backward reads
    # never says when its last read is: the root then stays until the end, as does a root that is kept
    # (``reshard_after_backward`` off, ``unshard()``). Anything that needs the root again inside the backward gathers
    # it as before: the gradient of a root user's output (a second backward through a retained graph) and a forward
    # recomputed by activation checkpointing. Those are the same calls on every rank: freeing makes no collective.
    def _root_reads_to_await(self) -> set[int] | None:
        root, reads = self.root_unit, self._root_reads
        if not reads or root.kept or not root.reshard_after_backward or not self._in_scope(root):
            return None
        if not all(slot.full.requires_grad for slot in reads):
            return None
        return {id(slot) for slot in reads}

    def _root_gradient_ready(self, slot: ParamSlot) -> None:
        self._start_backward()
        awaited = self._root_awaited
        if awaited is None or id(slot) not in awaited:
            return
        awaited.discard(id(slot))
        if not awaited:
            self._root_awaited = None
            if self.root_unit.is_unsharded and not self.root_unit.kept:
                self.root_unit.reshard()
                self._root_freed_early = True

    def _check_held_gradients(self, optimizer: Optimizer, *, late: bool) -> None:
        if not self.closed and self._training_state is not TrainingState.BACKWARD:
            check_held_gradients(self.units, optimizer, late=late)

    def _after_optimizer_step(self) -> None:
        # Full parameters unsharded before a step are stale (kept units; the root under manual optimization).
        if not self.closed and self._training_state is not TrainingState.BACKWARD:
            self._reshard_all()

    def reshard_idle(self) -> None:
        """Between forwards: reshard whatever an earlier forward left unsharded, so that the modules hold the user's
        parameters again (checkpoint functions call it before reading them by name)."""
        if not self.closed and self._training_state is TrainingState.IDLE:
            self._reshard_all()

    def _reshard_all(self, *, spare_kept: bool = False) -> None:
        """Reshard the root and every unit whose forward is not running, except kept ones with ``spare_kept``."""
        for unit in self.units:
            if (unit is self.root_unit or unit.forward_depth == 0) and not (spare_kept and unit.kept):
                unit.reshard()

    def _abandon_step(self) -> None:
        """A backward raised (on every rank) before it ended: drop what it left in flight and start clean."""
        for unit in self.units:
            unit.abandon()
        self._reduced_units.clear()
        self._ignored.nonfinite = []
        self._begin_step()
        self._end_backward_state()

    def _pre_backward(self, unit: FlatUnit, *, gather: bool = True) -> None:
        self._start_backward()
        self._make_room(unit)
        if self.finish_reduction_first:
            self.finish_reductions()
        if gather:
            unit.pre_backward()
        self._update_peak()
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_for_backward(self._neighbour(unit, -1))

    def _post_backward(self, unit: FlatUnit) -> None:
        if not unit.step_state.backward_ended():
            return  # not every call's backward has ended (or one cannot signal it: then _finish_backward reduces)
        if unit.post_backward(self.finish_reductions):
            self._reduced_units.append(unit)
        self._runtime.return_free_memory(self._largest_backward_block)  # the unit's activations are freed now
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch_for_backward(self._neighbour(unit, -1))

    def _prefetch_for_backward(self, unit: FlatUnit | None) -> None:
        if unit is not None and unit.backward_reads_parameters:  # [Note: an embedding's backward reads no weight]
            self._prefetch(unit)

    def finish_reductions(self) -> None:
        # Only the latest can be in flight: each waited for its predecessor.
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
                unit.free_after_backward()
                if unit.slots_to_reduce and not unit.step_state.reduced and unit.reduce_or_hold(self.finish_reductions):
                    self._reduced_units.append(unit)
            self.finish_reductions()
            if self._host_copies:
                self._wait_host_copies()
            self._check_no_late_gradients()
            self._restore_none_gradients()
            if torch.is_anomaly_enabled():
                local = [name for u in self._reduced_units for name in u.nonfinite] + self._ignored.nonfinite
                self._ignored.nonfinite = []
                for unit in self._reduced_units:
                    unit.nonfinite = []
                report_nonfinite(local, [c for c in (self.shard_comm, self.replicate_comm) if c is not None])
        finally:
            self._reduced_units.clear()
            self._begin_step()
            self._end_backward_state()
            self._order_frozen = True

    def _wait_host_copies(self) -> None:
        """cpu_offload on an accelerator: the host waits for the asynchronous copies before clipping or a step."""
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
        self._root_awaited, self._root_freed_early = None, False
        # The backward may have run inside the root's forward (manual optimization), which is still open.
        self._training_state = TrainingState.FORWARD if self._forward_depth > 0 else TrainingState.IDLE

    def _begin_step(self) -> None:
        for unit in self.units:
            if self._in_scope(unit):
                unit.begin_step()

    def _in_scope(self, unit: FlatUnit) -> bool:
        return self._backward_scope is None or id(unit) in self._backward_scope

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

    def _describe_collective(self, tag: int) -> str:
        return describe_collective(self.units, tag)

    def _update_peak(self) -> None:
        stats = self.shard_comm.stats
        stats.peak_gathered_units = max(stats.peak_gathered_units, self._alive_units())

    def slot_of(self, param: nn.Parameter) -> ParamSlot | None:
        """The ``ParamSlot`` of a parameter a unit shards (its name, layout, uses and full stand-in); None for any other
        parameter (ignored ones, or another model's)."""
        return self._slot_by_param.get(id(param))

    def is_managed(self, param: nn.Parameter) -> bool:
        """Whether the strategy handles ``param`` (sharded by a unit, or deliberately kept whole as ignored)."""
        return id(param) in self._slot_by_param or self._ignored.holds(param)

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

    # The user's controls (torch FSDP2's ``FSDPModule`` methods): see [Note: engine controls] in controls.py.
    @contextmanager
    def unsharded(self, units: Iterable[FlatUnit] | None = None) -> Iterator[None]:
        """Hold the full parameters of ``units`` (default: all) in their modules for the block (torch FSDP's
        ``summon_full_params``). Enter it on every rank; calls of the model inside it make no collective, so one
        rank may run the model alone. On exit, units that were sharded before are resharded. Use it between steps."""
        with hold_unsharded(list(self.units if units is None else units)):
            yield

    def set_requires_gradient_sync(self, requires: bool, units: Iterable[FlatUnit] | None = None) -> None:
        """Whether each unit's (default: all) backward reduces its gradients (torch FSDP2's name). With False the unit
        holds one full-size gradient sum, reduced once by the next backward with True; a step meanwhile raises."""
        check_flag(requires, "requires")
        for unit in self.units if units is None else units:
            unit.requires_gradient_sync = requires

    @contextmanager
    def no_sync(self, units: Iterable[FlatUnit] | None = None) -> Iterator[None]:
        """``set_requires_gradient_sync(False, units)`` inside the block, previous values restored on exit."""
        with gradient_sync_off(list(self.units if units is None else units)):
            yield

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
        secondary = None
        if not isinstance(value, bool):
            secondary = secondary_group(value, self.shard_comm, self._secondary_comms, self._describe_collective)
        self.secondary_comm = secondary
        for unit in self.units:
            unit.reshard_after_forward = bool(value)
            unit.secondary_comm = secondary

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather every unit now and keep it unsharded until ``reshard()`` or the next optimizer step (torch
        FSDP2's ``unshard``); with ``async_op``, the handle's ``wait()`` completes it. Call on every rank."""
        check_flag(async_op, "async_op")
        handle = unshard_and_keep(self.units, async_op=async_op, after_wait=self._update_peak)
        self._update_peak()
        return handle

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

    def clip_grad_norm_(
        self,
        parameters: Iterable[nn.Parameter],
        max_norm: float,
        norm_type: float = 2.0,
        *,
        stage_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """Clip gradients by the global norm over all shards (and over ``stage_group``, the other pipeline stages):
        the value an unsharded run computes (torch FSDP1's ``clip_grad_norm_``). Call on every rank. Returns the
        total norm before clipping, the same on every rank.

        Args:
            parameters: the parameters whose gradients to clip, the same on every rank (``model.parameters()``).
            max_norm: the largest total norm left.
            norm_type: the p of the p-norm (``inf``: the largest absolute value). Default: 2.0.
            stage_group: the group of the other pipeline stages, whose norms join the total. Default: None."""
        return clip_grad_norm_(
            parameters,
            max_norm,
            norm_type,
            shard_comm=self.shard_comm,
            is_sharded=self.is_sharded,
            device=self.root_unit.device,
            stage_group=stage_group,
            tensor_parallel=split_pieces({pid: s.tensor_parallel for pid, s in self._slot_by_param.items()}),
        )

    @torch.no_grad()
    def restore_unsharded(self, device: torch.device | str = "cpu") -> None:
        """Give every parameter its full value on ``device``, remove the engine's hooks and let go of the module
        (docs/how-it-works.md, "The model after a stage"). Call on every rank of the shard group; gradients are
        dropped. Peak memory on the accelerator: one unit in full."""
        if self.closed:
            return
        self.finish_reductions()
        device = torch.device(device)
        for unit in self.units:
            unit.restore_full_parameters(device)
        self.remove_hooks()
        self.closed = True
        unwatch_optimizer_steps(self)
        detach_engine(self.root)

    def shard_of(self, slot: ParamSlot) -> torch.Tensor:
        """This rank's rows of a managed parameter: its data while sharded, a slice of its full value once the
        engine gave the module its parameters back (``trainer.save_checkpoint`` after ``fit`` still saves shards)."""
        if not self.closed:
            return slot.param.data
        return slot.layout.local_slice(slot.param.data).to(self.root_unit.shard_device)

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
