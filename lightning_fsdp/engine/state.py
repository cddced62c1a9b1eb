"""The runtime of a sharded model: forward/backward hooks, per-step state, gradient norm and accounting.

Per unit and step: gather before forward; free after forward (FULL_SHARD, except the root, whose parameters are
needed again as soon as backward starts); gather again when the gradient of the unit's output arrives; reduce the
gradients when the gradient of the unit's inputs has been computed, i.e. when the unit's whole backward is done;
free. That trigger does not depend on which parameters received gradients, so a parameter that one rank skips
(data-dependent control flow inside a unit) does not change the order of collectives between ranks. A callback
queued on the autograd engine finishes whatever a step left open (units whose inputs need no gradient, the root),
in a fixed unit order, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_fsdp.config import BackwardPrefetch, MixedPrecision, ShardingStrategy
from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.unit import FlatUnit

def _current_graph_task_id() -> int:
    """The id of the backward this thread is running, -1 outside any (torch has no public spelling of this)."""
    return torch._C._current_graph_task_id()


# Engines whose root may be gathered inside its own forward when an optimizer steps (manual optimization). torch
# offers only a global optimizer hook: one is registered for all engines, and holds them weakly.
_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()
_optimizer_hook_handle: Any = None


def _after_any_optimizer_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    for engine in list(_LIVE_ENGINES):
        engine._after_optimizer_step()


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
        self._in_backward = False
        self._handles: list[Any] = []
        # Prefetching follows the order units ran in during the first training step (identical on every rank, so
        # every rank issues the same prefetches). If the order changes later, an unused prefetch is completed and
        # freed at the end of the step: it wastes a gather, never gathers wrongly or deadlocks.
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
            unit.forward_depth = 0
            unit.forward_calls = 0  # outermost calls this step that will see a backward
            unit.backward_calls = 0
            unit.untracked_calls = 0  # calls whose inputs need no gradient: no signal when their backward ends
            unit.marked_call = False  # the open outermost call put a _PostBackward on its inputs
            unit.reduced = False
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
    #   caught exception (a user's try/except, Lightning's tuners) leaves no unit gathered or half-counted.
    # * A backward that raised never reaches ``_finish_backward``. The next root forward outside any backward
    #   sees that and abandons the step (``_abandon_step``) before starting a new one.
    # * A forward always computes with the current weights: every root forward starts by freeing whatever an
    #   earlier forward left gathered (the root, SHARD_GRAD_OP units, a forward whose backward never came), prefetches
    #   never outlive the forward or backward that issued them, and an optimizer step inside the root's forward
    #   (manual optimization) frees the root, which the next module using it gathers again.
    # * ``requires_grad`` is read at each unit's forward (``FlatUnit.sync_requires_grad``), so freezing and
    #   unfreezing at any time trains as in a single process.
    def _register_hooks(self, unit: FlatUnit) -> None:
        self._handles.append(
            unit.module.register_forward_pre_hook(
                lambda module, args, kwargs: self._pre_forward(unit, args, kwargs), with_kwargs=True, prepend=True
            )
        )
        self._handles.append(
            unit.module.register_forward_hook(lambda module, args, output: self._post_forward(unit, output),
                                              always_call=True)
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
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, _a, slots=slots: self._sync_root_slots(slots)))
            # Backward may start inside the root's forward too, and need the root again after an earlier backward
            # of the same training_step freed it: these modules' outputs gather it, as a unit's outputs do.
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
                self._handles.append(param.register_hook(lambda grad, name=name: self._average_ignored_grad(grad, name)))

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
        if first:
            if unit is self.root_unit:
                self._begin_root_forward()
            if not self._in_backward:
                unit.sync_requires_grad()
                if not self._order_frozen and unit is not self.root_unit and id(unit) not in self._position:
                    self._position[id(unit)] = len(self._order)
                    self._order.append(unit)
            self._make_room(unit)
            unit.gather()
            self._update_peak()
            if self.forward_prefetch and not self._in_backward:
                self._prefetch(self._neighbour(unit, +1))
        mp = self.mixed_precision
        changed = False
        if mp.param_dtype is not None and (
            mp.cast_forward_inputs or (unit is self.root_unit and mp.cast_root_forward_inputs)
        ):
            args, kwargs = _cast_floating(args, mp.param_dtype), _cast_floating(kwargs, mp.param_dtype)
            changed = True
        if first and unit.trainable_slots and torch.is_grad_enabled() and not self._in_backward:
            flat, spec = tree_flatten((args, kwargs))
            wanted = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not wanted:
                unit.untracked_calls += 1
            else:
                unit.forward_calls += 1
                unit.marked_call = True
                marked = _PostBackward.apply(lambda: self._post_backward(unit), *(flat[i] for i in wanted))
                for i, tensor in zip(wanted, marked):
                    flat[i] = tensor
                args, kwargs = tree_unflatten(flat, spec)
                changed = True
        return (args, kwargs) if changed else None

    def _begin_root_forward(self) -> None:
        if self._in_backward:
            if _current_graph_task_id() != -1:
                return  # the root recomputed inside backward (activation checkpointing): the step goes on
            self._abandon_step()
        # Whatever an earlier forward left gathered may predate an optimizer step: free it, gather afresh.
        self._reshard_all()
        self._hook_ignored_params()

    def _post_forward(self, unit: FlatUnit, output: Any) -> None:
        if unit.forward_depth == 0:
            return  # the hooks were added while this forward ran
        unit.forward_depth -= 1
        self._forward_depth -= 1
        if unit.forward_depth == 0 and not self._in_backward:
            self._end_forward(unit, output)
        if self._forward_depth == 0 and self.forward_prefetch and not self._in_backward:
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
            unit.forward_calls -= 1
            unit.untracked_calls += 1
        # No backward will come through this forward (eval, no_grad, nothing requires grad, or it raised).
        unit.reshard()

    def _sync_root_slots(self, slots: list) -> None:
        if self._in_backward:
            return
        root = self.root_unit
        root.sync_requires_grad(slots)
        if root.forward_depth > 0 and not root.is_gathered:
            root.gather()

    def _mark_root_use(self, output: Any) -> None:
        root = self.root_unit
        if root.forward_depth == 0 or self._in_backward or not torch.is_grad_enabled():
            return
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda _grad: self._pre_backward(root))

    def _start_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _after_optimizer_step(self) -> None:
        # Manual optimization steps inside the root's forward (training_step): full parameters gathered before the
        # step are stale. Freed, the modules show the user's updated parameters (weight clipping after a step
        # edits them), and the next module using them gathers them again.
        if self.closed or self._in_backward:
            return
        if self.root_unit.forward_depth > 0:
            self.root_unit.reshard()

    def reshard_idle(self) -> None:
        """Between forwards: free whatever an earlier forward left gathered (the root, SHARD_GRAD_OP units, a forward
        whose backward never came), so that the modules hold the user's parameters again. Checkpoint functions call
        it before reading parameters by name. Safe while a backward is still to come: backward gathers again."""
        if not (self.closed or self._in_backward or self._forward_depth > 0):
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
        self._in_backward = False

    def _pre_backward(self, unit: FlatUnit) -> None:
        self._start_backward()
        self._make_room(unit)
        unit.gather()
        self._update_peak()
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch(self._neighbour(unit, -1))

    def _post_backward(self, unit: FlatUnit) -> None:
        unit.backward_calls += 1
        if unit.backward_calls != unit.forward_calls or unit.untracked_calls or unit.reduced:
            # The unit ran more than once this step: wait for the backward of its first call. A call whose inputs
            # needed no gradient gives no signal when its backward ends: the end of backward reduces the unit.
            return
        # Free the full parameters before the reduction allocates its buffers (the gradients do not need them).
        unit.reshard()
        self._reduce(unit)
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch(self._neighbour(unit, -1))

    def _reduce(self, unit: FlatUnit) -> None:
        # One reduction in flight at a time: the previous unit's had this unit's whole backward to complete, and
        # waiting for it here bounds the full-size gradient buffers kept alive to two units'.
        self._finish_reductions()
        unit.reduce_grads()
        unit.reduced = True
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
        unit.start_gather(async_op=True)
        self._update_peak()

    def _make_room(self, unit: FlatUnit) -> None:
        """Before gathering ``unit``: drop prefetches the order no longer needs, to stay within the limit."""
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
                # (weight clipping after the step edits the shards), and the next module using the root gathers it.
                unit.reshard()
                if unit.trainable_slots and not unit.reduced:
                    self._reduce(unit)
            self._finish_reductions()
            self._check_no_late_gradients()
            self._restore_none_gradients()
            if torch.is_anomaly_enabled():
                self._report_nonfinite()
        finally:
            self._reduced_units.clear()
            self._begin_step()
            self._in_backward = False
            self._order_frozen = True

    def _begin_step(self) -> None:
        for unit in self.units:
            unit.reduced = False
            unit.forward_calls = 0
            unit.backward_calls = 0
            unit.untracked_calls = 0
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
        reports = [(self.shard_comm, self.shard_comm.rank)]
        if self.replicate_comm is not None:
            reports.append((self.replicate_comm, self.replicate_comm.rank))
        found: dict[str, set[str]] = {}
        for name in local:
            found.setdefault(name, set()).add(f"rank {dist.get_rank() if dist.is_initialized() else 0}")
        for comm, _rank in reports:
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
        fixed = {_TAG_IGNORED_GRAD: "all-reduce of an ignored parameter's gradient",
                 _TAG_CLIP: "all-reduce of the gradient norm", _TAG_ANOMALY: "the end-of-backward anomaly report"}
        if tag in fixed:
            return fixed[tag]
        index, kind = divmod(tag, 3)
        what = ("all-gather of", "gradient reduction of", "replica all-reduce of")[kind]
        name = self.units[index].name if 0 <= index < len(self.units) else f"#{index}"
        return f"{what} unit {name or '<root>'!r}"

    def _update_peak(self) -> None:
        stats = self.shard_comm.stats
        stats.peak_gathered_units = max(stats.peak_gathered_units, self._alive_units())

    # ------------------------------------------------------------------------------------- user utilities
    @contextmanager
    def gathered(self, units: Iterable[FlatUnit] | None = None) -> Iterator[None]:
        """Hold full parameters of ``units`` (default: all) in their modules, e.g. for inspection; no autograd."""
        units = list(self.units if units is None else units)
        was = [u.is_gathered for u in units]
        try:
            with torch.no_grad():
                for unit in units:
                    unit.gather()
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

    @torch.no_grad()
    def clip_grad_norm_(self, parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the global norm over all shards: the value an unsharded run computes.

        Must be called on every rank of the shard group with the same parameters (it all-reduces one scalar).
        """
        norm_type = float(norm_type)
        params = [p for p in parameters if p.grad is not None]
        sharded = [p.grad for p in params if self.is_sharded(p)]
        replicated = [p.grad for p in params if not self.is_sharded(p)]
        device = self.root_unit.device
        if math.isinf(norm_type):
            local = _max_abs(sharded, device)
            self.shard_comm.agree(_TAG_CLIP)
            self.shard_comm.all_reduce(local, op=dist.ReduceOp.MAX)
            total = torch.maximum(local, _max_abs(replicated, device))
        else:
            local = _pow_sum(sharded, norm_type, device)
            self.shard_comm.agree(_TAG_CLIP)
            self.shard_comm.all_reduce(local)
            total = (local + _pow_sum(replicated, norm_type, device)) ** (1.0 / norm_type)
        # torch's own scaling by a given total norm groups the gradients by device and dtype: with cpu_offload the
        # sharded ones live in host memory, the replicated ones (ignored parameters) and the norm on the accelerator.
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    @torch.no_grad()
    def restore_unsharded(self, device: torch.device | str = "cpu") -> None:
        """Give every parameter its full value on ``device``, remove the engine's hooks and let go of the module.

        Afterwards the module is an ordinary one that computes exactly what the sharded one did: usable for
        inference on one rank, or by a new Trainer, which shards it afresh. Call it on every rank of the shard
        group (each unit is gathered once); the engine cannot be used afterwards. Gradients are dropped: they were
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
        return sum(s.param.grad.numel() * s.param.grad.element_size()
                   for u in self.units for s in u.slots if s.param.grad is not None)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def _pow_sum(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, norm_type)
    return torch.stack([n.float() for n in norms]).pow(norm_type).sum().to(device)


def _max_abs(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    maxima = [g.detach().abs().max().float() if g.numel() else g.new_zeros((), dtype=torch.float32) for g in grads]
    return torch.stack(maxima).max().to(device)
