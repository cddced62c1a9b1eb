"""The engine: the hooks on a sharded model, its training state, and the scheduling of its units (order, prefetch,
one reduction in flight, the end of backward). Each unit does its own part of a phase (``FlatUnit.pre_forward`` ...).

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

"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_fsdp.engine.clip import clip_grad_norm_
from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.config import BackwardPrefetch, MixedPrecision, ShardingStrategy
from lightning_fsdp.engine.controls import EngineControls
from lightning_fsdp.engine.diagnostics import TAG_IGNORED_GRAD, describe_collective, report_nonfinite
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.registry import detach_engine, unwatch_optimizer_steps, watch_optimizer_steps
from lightning_fsdp.engine.restore import restore_full_parameters
from lightning_fsdp.engine.states import ParamSlot, TrainingState
from lightning_fsdp.engine.streams import CollectiveStreams, streams_for
from lightning_fsdp.engine.unit import FlatUnit


def outside_compile(hook: Callable) -> Callable:
    """``hook`` runs eagerly even when called from code that ``torch.compile`` compiles (see [Note: compiled
    modules])."""
    return torch.compiler.disable(hook, recursive=True, reason="fsdp_custom engine hook")


def _current_graph_task_id() -> int:
    """The id of the backward this thread is running, -1 outside any (torch has no public spelling of this)."""
    return torch._C._current_graph_task_id()


class ShardingEngine(EngineControls):
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
                comm.describe_tag = self._describe_collective
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
    #
    # [Note: calls from outside a step]
    # Under Lightning the root unit is the LightningModule and a step is its forward; its parameters outside any
    # Block (embeddings, heads, norms) are unsharded by the modules that use them. Code may call the model outside a
    # step (callbacks sampling at epoch end, checks in ``on_fit_start``, ``generate()``): each unit's hooks unshard
    # and reshard it as in a step, and the root is unsharded by the first module that uses it. Every rank must make
    # the same calls (they all-gather). Such calls do not record the prefetch order, and gradients held for the next
    # optimizer step are untouched. A call on one rank alone needs the full weights on that rank first:
    # ``unsharded()`` gathers them on every rank and keeps every unit unsharded until it exits, so the calls inside
    # it make no collective.
    #
    # [Note: compiled modules]
    # Every hook the engine registers runs outside dynamo (``outside_compile``), as torch's FSDP2 does with its own.
    # A module compiled on its own (``torch.compile(block)``, ``block.compile()``) is entered through
    # ``nn.Module.__call__``, which dynamo does not trace: the unit's hooks run eagerly around it and the compiled
    # frame is the module's forward alone, one graph with no collective in it. Inside a larger compiled region
    # (the whole model compiled) a unit's hooks are graph breaks at the unit's boundaries. The hooks only swap
    # parameters between fixed shard and full tensors of fixed shapes, so no guard sees a change and nothing
    # recompiles after the first step.
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
                module.register_forward_pre_hook(
                    outside_compile(lambda _m, _a, slots=slots: self._sync_root_slots(slots))
                )
            )
            # Backward may start inside the root's forward too, and need the root again after an earlier backward
            # of the same training_step resharded it: these modules' outputs unshard it, as a unit's outputs do.
            self._handles.append(
                module.register_forward_hook(outside_compile(lambda _m, _a, output: self._mark_root_use(output)))
            )
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
        if first and unit is self.root_unit:
            self._begin_root_forward()
        in_backward = self._training_state is TrainingState.BACKWARD
        if first:
            if not in_backward:
                unit.sync_requires_grad()
                # The order prefetching follows is a training step's: calls from outside one (a callback sampling
                # from a part of the model) do not record it.
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
        may_reshard = unit is not self.root_unit and not self._next_up(unit)
        unit.post_forward(output, may_reshard=may_reshard, on_backward_start=lambda: self._pre_backward(unit))

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
        # Also outside the root's forward: a callback or hook calling part of the model (``pl_module.model(x)``,
        # ``generate()``) on every rank. The root then stays unsharded until the next root forward, optimizer step or
        # ``reshard_idle``, each of which reshards it (see [Note: calls from outside a step]).
        if not root.is_unsharded:
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
        unit.pre_backward()
        self._update_peak()
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch(self._neighbour(unit, -1))

    def _post_backward(self, unit: FlatUnit) -> None:
        if not unit.step_state.backward_ended():
            return  # not every call's backward has ended (or one cannot signal it: then _finish_backward reduces)
        if unit.post_backward(self.finish_reductions):
            self._reduced_units.append(unit)
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch(self._neighbour(unit, -1))

    def finish_reductions(self) -> None:
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
                unit.free_after_backward()
                if unit.trainable_slots and not unit.step_state.reduced and unit.reduce_or_hold(self.finish_reductions):
                    self._reduced_units.append(unit)
            self.finish_reductions()
            if self._host_copies:
                self._wait_host_copies()
            self._check_no_late_gradients()
            self._restore_none_gradients()
            if torch.is_anomaly_enabled():
                local = [name for u in self._reduced_units for name in u.nonfinite] + self._nonfinite_ignored
                self._nonfinite_ignored = []
                for unit in self._reduced_units:
                    unit.nonfinite = []
                report_nonfinite(local, self._comms())
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

    def _comms(self) -> list[Communicator]:
        return [self.shard_comm] + ([self.replicate_comm] if self.replicate_comm is not None else [])

    def _update_peak(self) -> None:
        stats = self.shard_comm.stats
        stats.peak_gathered_units = max(stats.peak_gathered_units, self._alive_units())

    def _average_ignored_grad(self, grad: torch.Tensor, name: str) -> torch.Tensor:
        # An ignored parameter is whole on every rank; its incoming gradient (this backward's contribution, before
        # accumulation into .grad) is averaged like DDP's, so accumulation across micro-batches stays correct.
        if torch.is_anomaly_enabled() and not bool(torch.isfinite(grad).all()):
            self._nonfinite_ignored.append(name)
        grad = grad.clone()
        ranks = self.shard_comm.world_size
        self.shard_comm.agree(TAG_IGNORED_GRAD)
        self.shard_comm.all_reduce(grad)
        if self.replicate_comm is not None and self.replicate_comm.world_size > 1:
            self.replicate_comm.agree(TAG_IGNORED_GRAD)
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

    def clip_grad_norm_(
        self,
        parameters: Iterable[nn.Parameter],
        max_norm: float,
        norm_type: float = 2.0,
        *,
        stage_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """Clip gradients by the global norm over all shards (and over ``stage_group``, the other pipeline stages):
        the value an unsharded run computes. Call on every rank with the same parameters (see ``clip.py``)."""
        return clip_grad_norm_(
            parameters,
            max_norm,
            norm_type,
            shard_comm=self.shard_comm,
            is_sharded=self.is_sharded,
            device=self.root_unit.device,
            stage_group=stage_group,
        )

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
        self.finish_reductions()
        restore_full_parameters(self.units, device)
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
