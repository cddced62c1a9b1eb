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
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_fsdp.config import BackwardPrefetch, MixedPrecision, ShardingStrategy
from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.unit import CollectiveKind, FlatUnit


class TrainingState(Enum):
    """What the engine is doing (see [Note: the engine's training state])."""

    IDLE = auto()  # between steps: no unit forward open, no backward in flight
    FORWARD = auto()  # some unit's forward is open, no backward in flight
    BACKWARD = auto()  # a backward reached a unit; ends when ``_finish_backward`` has run


def _current_graph_task_id() -> int:
    """The id of the backward this thread is running, -1 outside any (torch has no public spelling of this)."""
    return torch._C._current_graph_task_id()


# Engines whose root may be unsharded inside its own forward when an optimizer steps (manual optimization). torch
# offers only a global optimizer hook: one is registered for all engines, and holds them weakly.
_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()
_optimizer_hook_handle: Any = None


def _after_any_optimizer_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    for engine in list(_LIVE_ENGINES):
        engine._after_optimizer_step()


def live_engines() -> list[ShardingEngine]:
    """Every engine not yet closed (``restore_unsharded``), in no particular order."""
    return [engine for engine in list(_LIVE_ENGINES) if not engine.closed]


def _watch_optimizer_steps(engine: ShardingEngine) -> None:
    global _optimizer_hook_handle
    _LIVE_ENGINES.add(engine)
    if _optimizer_hook_handle is None:
        _optimizer_hook_handle = register_optimizer_step_post_hook(_after_any_optimizer_step)


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
        self._position: dict[int, int] = {}
        self._slot_by_param = {id(s.param): s for u in units for s in u.slots}
        self.ignored_params = list(ignored_params or [])
        self._ignored_ids = {id(p) for p in self.ignored_params}
        names = {id(p): name for name, p in root.named_parameters(remove_duplicate=False)}
        self._reduced_units: list[FlatUnit] = []
        self._nonfinite_ignored: list[str] = []
        self._forward_depth = 0  # unit forwards open right now (outermost call of each, nested ones included)
        for index, unit in enumerate(units):
            unit.index = index
            self._register_hooks(unit)
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
    #   earlier forward left unsharded (the root, SHARD_GRAD_OP units, a forward whose backward never came),
    #   prefetches never outlive the forward or backward that issued them, and an optimizer step inside the root's
    #   forward (manual optimization) reshards the root, which the next module using it unshards again.
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
        _watch_optimizer_steps(self)

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
        # Whatever an earlier forward left unsharded may predate an optimizer step: reshard it, unshard afresh.
        self._reshard_all()
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
                    if other.is_prefetched:
                        other.reshard()

    def _end_forward(self, unit: FlatUnit, output: Any) -> None:
        marked, unit.marked_call = unit.marked_call, False
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and tensors:
            for tensor in tensors:
                tensor.register_hook(lambda _grad: self._pre_backward(unit))
            if unit.reshard_after_forward and unit is not self.root_unit:
                unit.reshard()
            return
        if marked:
            # The forward raised (its output is None then) or returned nothing that needs a gradient: no backward
            # will signal the end of this call, so the end of backward reduces the unit.
            unit.step_state.untrack_call(was_tracked=True)
        # No backward will come through this forward (eval, no_grad, nothing requires grad, or it raised).
        unit.reshard()

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

    def _after_optimizer_step(self) -> None:
        # Manual optimization steps inside the root's forward (training_step): full parameters unsharded before
        # the step are stale. Resharded, the modules show the user's updated parameters (weight clipping after a
        # step edits them), and the next module using them unshards them again.
        if self.closed or self._training_state is TrainingState.BACKWARD:
            return
        if self.root_unit.forward_depth > 0:
            self.root_unit.reshard()

    def reshard_idle(self) -> None:
        """Between forwards: reshard whatever an earlier forward left unsharded (the root, SHARD_GRAD_OP units, a
        forward whose backward never came), so that the modules hold the user's parameters again. Checkpoint
        functions call it before reading parameters by name. Safe while a backward is still to come: backward
        unshards again."""
        if not self.closed and self._training_state is TrainingState.IDLE:
            self._reshard_all()

    def _reshard_all(self) -> None:
        for unit in self.units:
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
        unit.reshard()
        self._reduce(unit)
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch(self._neighbour(unit, -1))

    def _reduce(self, unit: FlatUnit) -> None:
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
        return self._order[index] if 0 <= index < len(self._order) else None

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
            if other is not unit and other.is_prefetched:
                other.reshard()

    def _alive_units(self) -> int:
        return sum(1 for u in self.units if u is not self.root_unit and u.sharded and u.is_alive)

    def _finish_backward(self) -> None:
        try:
            for unit in reversed(self.units):
                # Inside the root's forward too (manual optimization): the modules then show the user's parameters
                # (weight clipping after the step edits the shards), and the next module using the root unshards it.
                unit.reshard()
                if unit.trainable_slots and not unit.step_state.reduced:
                    self._reduce(unit)
            self._finish_reductions()
            self._check_no_late_gradients()
            self._restore_none_gradients()
            if torch.is_anomaly_enabled():
                self._report_nonfinite()
        finally:
            self._reduced_units.clear()
            self._begin_step()
            self._end_backward_state()
            self._order_frozen = True

    def _end_backward_state(self) -> None:
        # The backward may have run inside the root's forward (manual optimization), which is still open.
        self._training_state = TrainingState.FORWARD if self._forward_depth > 0 else TrainingState.IDLE

    def _begin_step(self) -> None:
        for unit in self.units:
            unit.begin_step()

    def _check_no_late_gradients(self) -> None:
        # A gradient that arrived after its unit was reduced would silently join the next step's reduction.
        late = [s.fqn for u in self.units for s in u.slots if s.full.grad is not None]
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
        from lightning_fsdp.engine.sharding import detach_engine

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
        _LIVE_ENGINES.discard(self)
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
