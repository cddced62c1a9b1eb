"""One sharded unit (torch FSDP2's ``FSDPParamGroup``): unshard, reshard and gradient reduction, each a flat
collective over the unit's buffers (the reduction's work: ``reduction.py``'s functions). ``.data`` views the flat
shard buffer, so the optimizer updates in place and the all-gather needs no copy-in; the stand-ins and freeing:
docs/how-it-works.md ("Shards", "A training step")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_fsdp.engine.comm import Communicator, Waitable, all_gather_flat, wait_works
from lightning_fsdp.engine.options import check_wire_narrower
from lightning_fsdp.engine.records import (
    CollectiveKind,
    ParamSlot,
    PendingGather,
    PendingReduce,
    ReducePlan,
    SecondaryShard,
    ShardedState,
    UnitStepState,
)
from lightning_fsdp.engine.reduction import ReduceSettings, finish_reduction, hold_unsynced_grads, start_reduction
from lightning_fsdp.engine.streams import INACTIVE, CollectiveStreams, pins_host_memory
from lightning_fsdp.engine.tensor_parallel import stand_in
from lightning_fsdp.engine.wrap import ParamUse


class FlatUnit:
    """Unshard, reshard and gradient reduction for one unit's parameters: flat collectives over its shard buffer."""

    # From 1 MiB of float32 a parameter is gathered on its own, in place; smaller ones share a staged collective.
    direct_gather_min_numel = 2**18

    def __init__(
        self,
        *,
        name: str,
        module: nn.Module,
        slots: list[ParamSlot],
        shard_comm: Communicator,
        replicate_comm: Communicator | None,
        sharded: bool,
        reshard_after_forward: bool,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        reduce_wire_dtype: torch.dtype | None = None,
        shard_device: torch.device | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.shard_comm = shard_comm
        self.replicate_comm = replicate_comm
        self.sharded = sharded
        self.reshard_after_forward = reshard_after_forward
        # Trainable-at-sharding parameters first: the local checkpoint format depends on this layout.
        self.slots = sorted(slots, key=lambda s: not s.trainable)
        self._plans: dict[tuple[bool, ...], ReducePlan] = {}
        self._last_plan: ReducePlan | None = None
        self.sharded_state = ShardedState.SHARDED
        self._pending_unshard: PendingGather | None = None  # UNSHARDING with collectives to wait for
        # The engine's controls (see [Note: a unit's states]).
        self.requires_gradient_sync = True  # read when the unit's backward ends: reduce, or hold the gradients
        self.reshard_after_backward = True  # read when the unit's backward ends: reshard, or stay (``kept``)
        self.secondary_comm: Communicator | None = None  # reshard after forward to this smaller group (hpZ)
        self.kept = False
        self.grads_unsynced = False
        self._secondary: SecondaryShard | None = None
        self._check_uniform_dtype()
        # Fixed now: once sharded, the parameters may live elsewhere (CPU offload).
        self.dtype = self.slots[0].param.dtype if self.slots else torch.float32
        self.device = self.slots[0].param.device if self.slots else torch.device("cpu")
        self.compute_dtype = param_dtype or self.dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.backward_reads_parameters = not only_embedding_lookups(self.slots)
        # See [Note: narrow on the wire, wide in the sum].
        if reduce_wire_dtype is not None:
            check_wire_narrower(reduce_wire_dtype, self.reduce_dtype)
        self.reduce_wire_dtype = reduce_wire_dtype
        # CPU offload: host shards, pinned when computing on an accelerator so that the copies are asynchronous.
        self.shard_device = shard_device or self.device
        offloaded = self.shard_device.type == "cpu" and self.device != self.shard_device
        self.pinned = offloaded and pins_host_memory(self.device)
        self.streams: CollectiveStreams = INACTIVE
        # Position in the engine's unit list: names this unit's collectives for ``Communicator.check_same_collective``.
        self.index = 0
        # Calls open now (nested and recomputed ones included); whether the outermost marked its inputs.
        self.forward_depth = 0
        self.marked_call = False
        self.step_state = UnitStepState()
        # After a reduction, per trainable parameter: how many ranks had a gradient; whether the shard had one.
        self.used_counts: torch.Tensor | None = None
        self._had_grad: list[bool] = []
        self.nonfinite: list[str] = []  # anomaly checking: parameters whose local gradient was not finite
        self._pending_reduce: PendingReduce | None = None
        # The flat buffers: each parameter's padded chunk at its offset in the shard, N of them in the full buffer.
        offset = 0
        for slot in self.slots:
            slot.offset = offset
            offset += slot.layout.padded_numel
        self.shard_numel = offset
        self.flat_shard = torch.zeros(offset, dtype=self.dtype, device=self.shard_device, pin_memory=self.pinned)
        # A NO_SHARD unit in full precision computes on its shard buffer directly.
        self._aliases_shard = not self.sharded and self.compute_dtype == self.dtype and self.shard_device == self.device
        full_numel = 0 if self._aliases_shard else self.world_size * self.shard_numel
        self.full_flat = torch.empty(full_numel, dtype=self.compute_dtype, device=self.device)
        self._split_sizes = [s.layout.padded_numel for s in self.slots]
        self._direct, self._staged = self._split_direct(self.slots, even_rows=False)
        self._full_regions = self._place_parameters()
        self._staged_sizes = [self._split_sizes[i] for i in self._staged]
        self._staged_regions = [] if self._aliases_shard else [self._full_regions[i] for i in self._staged]
        if not self._aliases_shard:
            self._free_full()

    def _check_uniform_dtype(self) -> None:
        kinds = {(s.param.dtype, s.param.device) for s in self.slots}
        if len(kinds) > 1:
            listing = ", ".join(f"{s.fqn}: {s.param.dtype} on {s.param.device}" for s in self.slots)
            raise ValueError(
                f"Unit {self.name!r} mixes parameter dtypes or devices ({listing}); one flat buffer needs one "
                "dtype and device. Wrap the differing modules as their own units or cast the model first."
            )

    @property
    def world_size(self) -> int:
        return self.shard_comm.world_size if self.sharded else 1

    @torch.no_grad()
    def _place_parameters(self) -> list[torch.Tensor]:
        """Copy each parameter's rows into the flat shard, whose view its ``.data`` becomes, and give it its full-size
        stand-in; returns each parameter's (N, padded chunk) region of the full buffer (none when they alias)."""
        n = self.world_size
        full_regions = []
        for slot in self.slots:
            layout = slot.layout
            shard_view = self.flat_shard[slot.offset : slot.offset + layout.local_numel].view(layout.local_shape)
            shard_view.copy_(layout.local_slice(slot.param.data))
            slot.synced_requires_grad = slot.param.requires_grad
            if not self._aliases_shard:
                region = self.full_flat[n * slot.offset : n * (slot.offset + layout.padded_numel)]
                full_regions.append(region.view(n, layout.padded_numel))
                full_view = region.view(layout.padded_full_shape)[: layout.rows].view(layout.shape)
            else:
                # Unsharded: the full parameter aliases the shard, so the optimizer's update is seen directly.
                full_view = shard_view.view(layout.shape)
            slot.full = stand_in(slot.tensor_parallel, full_view, slot.param.requires_grad)
            slot.param.data = shard_view
        return full_regions

    def sync_requires_grad(self, slots: list[ParamSlot] | None = None) -> None:
        """Give the full parameters (of ``slots``, default all) the user's current ``requires_grad``: called as the
        unit's forward starts, and for the root as each module using its parameters starts."""
        grad_enabled = torch.is_grad_enabled()
        for slot in self.slots if slots is None else slots:
            if slot.full.requires_grad != slot.synced_requires_grad:
                slot.param.requires_grad_(slot.full.requires_grad)
            wanted = slot.param.requires_grad
            if slot.full.requires_grad != wanted:
                slot.full.requires_grad_(wanted)
            slot.synced_requires_grad = wanted
            if wanted and grad_enabled:
                slot.in_graph = True

    def begin_step(self) -> None:
        """Forget this step: its calls, its reduction, and (unless gradients are held) which parameters took part."""
        self.step_state = UnitStepState()
        if not self.grads_unsynced:
            for slot in self.slots:
                slot.in_graph = False

    @property
    def slots_to_reduce(self) -> list[ParamSlot]:
        """The parameters this step's reduction carries: trainable now, or trainable in a forward of this step."""
        return self.reduce_plan().slots

    def reduce_plan(self) -> ReducePlan:
        key = tuple(s.param.requires_grad or s.in_graph for s in self.slots)
        plan = self._plans.get(key)
        if plan is None:
            slots = [s for s, on in zip(self.slots, key) if on]
            # Large gradients whose rows split evenly over the ranks are reduced on their own, with no padded copy.
            plan = self._plans[key] = ReducePlan.of(slots, *self._split_direct(slots, even_rows=True))
        return plan

    def _split_direct(self, slots: list[ParamSlot], *, even_rows: bool) -> tuple[list[int], list[int]]:
        """Indices of the ``slots`` large enough for a collective of their own (with ``even_rows``: whose rows also
        split evenly over the ranks), and of the others, which share one staged collective."""
        n = self.world_size
        many = self.sharded and len(self.slots) > 1
        direct = [
            j
            for j, slot in enumerate(slots)
            if many
            and n * slot.layout.padded_numel >= self.direct_gather_min_numel
            and (not even_rows or (bool(slot.layout.shape) and slot.layout.rows % n == 0))
        ]
        return direct, [j for j in range(len(slots)) if j not in direct]

    def _free_full(self) -> None:
        self.full_flat.untyped_storage().resize_(0)

    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @property
    def is_alive(self) -> bool:
        """Full parameters (or their staging buffer) allocated: unsharded, or an unshard in flight."""
        return self.sharded_state is not ShardedState.SHARDED

    @property
    def is_prefetched(self) -> bool:
        """An unshard was issued ahead of need and the unit has not been used yet."""
        return self.sharded_state is ShardedState.UNSHARDING

    def unshard(self) -> None:
        """Make every parameter of the unit full-size in its modules (one all-gather when sharded)."""
        if self.is_unsharded:
            return
        if not self.is_prefetched:
            self.start_unshard(async_op=False)
        self._finish_unshard()

    def start_unshard(self, *, async_op: bool = True) -> None:
        """Issue this unit's all-gather (over the secondary group when a forward left a secondary shard); with
        ``async_op`` it overlaps whatever runs until ``unshard()`` (see [Note: collectives on their own streams])."""
        if self.is_alive:
            return
        self.sharded_state = ShardedState.UNSHARDING
        secondary, self._secondary = self._secondary, None
        if self._aliases_shard or not self.slots:
            return
        streams = self.streams
        if not self.sharded:
            # No collective to overlap (NO_SHARD casting or offloading): a copy on the current stream.
            self._allocate_full()
            with torch.no_grad():
                self.full_flat.copy_(self._shard_on_device())
            return
        if not streams.active:
            self._pending_unshard = self._issue_unshard(secondary, async_op)  # CPU: on the current stream
            return
        if len(self.slots) == 1 or self._direct:
            # Written in place by a collective: allocated on the compute stream, which frees it (see the streams Note).
            self._allocate_full()
        with streams.all_gather_side():
            pending = self._issue_unshard(secondary, async_op, non_blocking=True)
            # NCCL, HCCL: this stream waits for the collectives, the host does not.
            wait_works(pending.works)
            event = streams.record_event()
        self._pending_unshard = pending._replace(works=[], event=event)

    def _issue_unshard(
        self, secondary: SecondaryShard | None, async_op: bool, *, non_blocking: bool = False
    ) -> PendingGather:
        if secondary is not None:
            comm, source = secondary.comm, secondary.buffer
        else:
            comm, source = self.shard_comm, self._shard_on_device(non_blocking)  # no copy in fp32
        # Each of the ``ranks`` ranks sends ``k`` consecutive padded chunks per parameter (k = 1 from the shards).
        ranks = comm.world_size
        k = self.world_size // ranks
        comm.check_same_collective(self.tag(CollectiveKind.ALL_GATHER))
        if len(self.slots) == 1:
            # One parameter: rank-major and parameter-major layouts coincide, so gather in place.
            self._allocate_full()
            work = comm.all_gather(self.full_flat, source, async_op=async_op)
            return PendingGather([work], [source], None, ranks)

        def piece(i: int) -> torch.Tensor:  # parameter i's k chunks in ``source``
            return source[k * self.slots[i].offset : k * (self.slots[i].offset + self._split_sizes[i])]

        works: list[Waitable | None] = []
        if self._direct:
            self._allocate_full()
            for i in self._direct:
                works.append(comm.all_gather(self._full_regions[i].view(-1), piece(i), async_op=async_op))
        inputs, gathered = [source], None
        if self._staged:
            # The full buffer waits for the copy-out: a prefetch in flight holds one unit-sized buffer, not two.
            staged_in = torch.cat([piece(i) for i in self._staged]) if self._direct else source
            gathered = torch.empty(ranks * staged_in.numel(), dtype=self.compute_dtype, device=self.device)
            works.append(comm.all_gather(gathered, staged_in, async_op=async_op))
            inputs.append(staged_in)
        return PendingGather(works, inputs, gathered, ranks)

    def _shard_on_device(self, non_blocking: bool = False) -> torch.Tensor:
        """The flat shard on the compute device in the compute dtype: the shard itself when neither changes.
        ``non_blocking`` (on the all-gather stream): a pinned host shard is copied asynchronously, then cast there."""
        if non_blocking and self.pinned:
            return self.flat_shard.to(self.device, non_blocking=True).to(self.compute_dtype)
        return self.flat_shard.to(self.device, self.compute_dtype)

    def _allocate_full(self) -> None:
        storage = self.full_flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.full_flat.numel() * self.full_flat.element_size())

    def _finish_unshard(self) -> None:
        pending, self._pending_unshard = self._pending_unshard, None
        if pending is not None:
            if pending.event is not None:
                self.streams.wait_event(pending.event)  # before any read of what the collectives wrote
            wait_works(pending.works)
            gathered, ranks = pending.staged_out, pending.ranks
            if gathered is not None:
                self._allocate_full()
                k = self.world_size // ranks  # chunks per parameter each rank sent
                with torch.no_grad():
                    torch.split_with_sizes_copy(
                        gathered.view(ranks, -1),
                        [k * size for size in self._staged_sizes],
                        dim=1,
                        out=[region.view(ranks, -1) for region in self._staged_regions],
                    )
                if pending.event is not None:
                    # Allocated on the all-gather stream, read here: not handed out again before this copy is done.
                    self.streams.record_stream(gathered, self.streams.current_stream())
        self._install(full=True)
        self.sharded_state = ShardedState.UNSHARDED

    @torch.no_grad()
    def full_tensors(self) -> list[torch.Tensor]:
        """Every parameter in full, in the shards' (master) dtype, without touching the modules: for checkpoints. A
        DTensor parameter's is this TP rank's piece in full (``TensorParallelSpec.full_tensor`` joins the pieces)."""
        if self.flat_shard.numel() < self.shard_numel:
            raise RuntimeError(
                f"Unit {self.name!r} no longer holds shards: its engine gave the module its full parameters back "
                "(ShardingEngine.restore_unsharded, called when a Trainer stage ends). Read the module's own "
                "state_dict() instead, or take full state dicts before the stage ends (e.g. in on_train_end)."
            )
        n = self.world_size
        gathered = torch.empty(n * self.shard_numel, dtype=self.dtype, device=self.device)
        if self.sharded and n > 1:
            # Not counted in CommStats, which describes training steps.
            all_gather_flat(gathered, self.flat_shard.to(self.device), group=self.shard_comm.group)
        else:
            gathered.copy_(self.flat_shard)
        pieces = gathered.view(n, self.shard_numel).split(self._split_sizes, dim=1)
        return [
            piece.reshape(slot.layout.padded_full_shape)[: slot.layout.rows].reshape(slot.layout.shape)
            for slot, piece in zip(self.slots, pieces)
        ]

    def reshard(self, *, secondary: Communicator | None = None) -> None:
        """Put the shards back into the modules and free the full parameters; ends ``kept``. ``secondary`` (after a
        forward, hpZ) first keeps a ``SecondaryShard`` for the next unshard; any other reshard drops it."""
        self.kept = False
        if self.is_prefetched:
            # A prefetch that was not used (the execution order changed): complete it, then drop it.
            self._finish_unshard()
        if not self.is_unsharded:
            self._secondary = None
            return
        self._secondary = self._take_secondary(secondary) if secondary is not None else None
        self._install(full=False)
        if not self._aliases_shard:
            self._free_full()
        self.sharded_state = ShardedState.SHARDED

    @torch.no_grad()
    def _take_secondary(self, comm: Communicator) -> SecondaryShard | None:
        if not self.sharded or self._aliases_shard or not self.slots or comm.world_size >= self.world_size:
            return None
        k = self.world_size // comm.world_size
        rows = slice(comm.rank * k, (comm.rank + 1) * k)  # this rank's position in its group: its block of chunks
        buffer = torch.empty(k * self.shard_numel, dtype=self.compute_dtype, device=self.device)
        torch.cat([region[rows].reshape(-1) for region in self._full_regions], out=buffer)
        return SecondaryShard(comm, buffer)

    def secondary_numel(self) -> int:
        """Elements of the secondary shard held now (0 when none)."""
        return self._secondary.buffer.numel() if self._secondary is not None else 0

    @torch.no_grad()
    def restore_full_parameters(self, device: torch.device) -> None:
        """Every parameter gets its full value on ``device`` and the flat buffers go (``restore_unsharded``); gradients
        are dropped. ``device="meta"`` keeps no values but still joins the gather (another rank may keep them); ties
        stay shared."""
        self.reshard()
        for slot, full in zip(self.slots, self.full_tensors()):
            param = slot.param
            param.grad = None
            if slot.tensor_parallel is not None:  # the DTensor parameter parallelize_module made, whole again
                param = slot.tensor_parallel.parameter(full.to(device), param.requires_grad)
                slot.param.data = slot.param.data.new_empty(0)
            elif device.type == "meta":  # a parameter's data cannot be swapped for a meta tensor (set_data refuses it)
                param = nn.Parameter(full.to(device), requires_grad=param.requires_grad)
                slot.param.data = slot.param.data.new_empty(0)  # the old object (the optimizer's) lets its shard go
            else:
                param.data = full.to(device)
            for module, attr in slot.uses:
                module._parameters[attr] = param
        self.flat_shard = torch.empty(0, dtype=self.dtype, device=self.shard_device)
        self.full_flat = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        self._full_regions, self._staged_regions = [], []
        self._plans.clear()
        self._secondary = None
        self.grads_unsynced = False
        for slot in self.slots:
            slot.unsynced_grad = None

    def _install(self, *, full: bool) -> None:
        for slot in self.slots:
            tensor = slot.full if full else slot.param
            for module, attr in slot.uses:
                module._parameters[attr] = tensor

    # Called by the engine's hooks in this order (docs/how-it-works.md, "A parameter's journey").
    def pre_forward(
        self,
        args: tuple,
        kwargs: dict,
        *,
        first: bool,
        in_backward: bool,
        cast_dtype: torch.dtype | None,
        on_backward_end: Callable[[], None],
    ) -> tuple[tuple, dict] | None:
        """Before the module's forward: unshard (the outermost call), cast floating inputs to ``cast_dtype``, and put
        a ``_PostBackward`` on the inputs that need a gradient, whose backward calls ``on_backward_end`` once the
        unit's whole backward is done. Returns the new ``(args, kwargs)``, or None when unchanged."""
        if first:
            self.unshard()
        changed = False
        if cast_dtype is not None:
            args, kwargs = _cast_floating(args, cast_dtype), _cast_floating(kwargs, cast_dtype)
            changed = True
        if first and self.slots_to_reduce and torch.is_grad_enabled() and not in_backward:
            flat, spec = tree_flatten((args, kwargs))
            wanted = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not wanted:
                self.step_state.untrack_call()
            else:
                self.step_state.track_call()
                self.marked_call = True
                marked = _PostBackward.apply(on_backward_end, *(flat[i] for i in wanted))
                for i, tensor in zip(wanted, marked):
                    flat[i] = tensor
                args, kwargs = tree_unflatten(flat, spec)
                changed = True
        return (args, kwargs) if changed else None

    def post_forward(self, output: object, *, may_reshard: bool, on_backward_start: Callable[[], None]) -> None:
        """After the outermost call's forward: hook the outputs that need a gradient (``on_backward_start``), and
        reshard if ``reshard_after_forward`` and ``may_reshard`` (not the root, nor the unit whose backward comes
        next). A forward no backward will follow reshards whatever the flags say."""
        marked, self.marked_call = self.marked_call, False
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and tensors:
            for tensor in tensors:
                tensor.register_hook(lambda _grad: on_backward_start())
            if self.reshard_after_forward and may_reshard and not self.kept:
                self.reshard(secondary=self.secondary_comm)
            return
        if marked:
            # Raised, or nothing needs a gradient: no backward signals this call, so the end of backward reduces.
            self.step_state.untrack_call(was_tracked=True)
        if not self.kept:
            self.reshard()

    def pre_backward(self) -> None:
        """The first gradient of the unit's outputs arrived: its backward needs the full parameters, unless it reads
        none of them ([Note: an embedding's backward reads no weight])."""
        if self.backward_reads_parameters:
            self.unshard()

    def post_backward(self, finish_previous_reduction: Callable[[], None]) -> bool:
        """The backward is done: free the full parameters, then ``reduce_or_hold``; True if a reduction started."""
        self.free_after_backward()
        return self.reduce_or_hold(finish_previous_reduction)

    def free_after_backward(self) -> None:
        """Reshard (kept with ``reshard_after_backward`` off) before the reduction allocates: it needs no parameters."""
        if self.kept:
            return
        if not self.reshard_after_backward and self.is_unsharded:
            self.kept = True
            return
        self.reshard()

    def reduce_or_hold(self, finish_previous_reduction: Callable[[], None]) -> bool:
        """Reduce this backward's gradients (with any held ones), or hold them while gradient sync is off; returns
        whether a reduction started. The previous one is finished first: one in flight bounds the full-size
        gradients alive to two units'."""
        if not self.requires_gradient_sync:
            self.hold_grads()
            self.step_state.reduced = True
            return False
        finish_previous_reduction()
        self.reduce_grads()
        self.step_state.reduced = True
        return True

    def reduce_grads(self) -> None:
        """Start averaging this step's full gradients across ranks into the shards (``start_reduction``);
        ``finish_reduce`` completes it."""
        plan = self.reduce_plan()
        if not plan.slots:
            return
        self.grads_unsynced = False
        self._pending_reduce, nonfinite = start_reduction(plan, self.reduce_settings())
        if nonfinite is not None:
            self.nonfinite = nonfinite

    def reduce_settings(self) -> ReduceSettings:
        """What this unit's reduction is given: fixed at sharding, but for the streams and the unit's index."""
        return ReduceSettings(
            shard_comm=self.shard_comm,
            replicate_comm=self.replicate_comm,
            sharded=self.sharded,
            grad_dtype=self.compute_dtype,
            reduce_dtype=self.reduce_dtype,
            wire_dtype=self.reduce_wire_dtype,
            device=self.device,
            shard_dtype=self.dtype,
            shard_device=self.shard_device,
            pinned=self.pinned,
            streams=self.streams,
            reduce_tag=self.tag(CollectiveKind.REDUCE),
            replicate_tag=self.tag(CollectiveKind.REPLICATE),
        )

    def hold_grads(self) -> None:
        """Gradient sync off: add this backward's full gradients to the ones held (``hold_unsynced_grads``)."""
        plan = self.reduce_plan()
        if plan.slots:
            self.grads_unsynced = True
            hold_unsynced_grads(plan.slots, self.reduce_dtype)

    def held_grad_bytes(self) -> int:
        """Bytes of the full-size gradients held for a later reduction (gradient sync off)."""
        held = [s.unsynced_grad for s in self.slots if s.unsynced_grad is not None]
        return sum(grad.numel() * grad.element_size() for grad in held)

    def finish_reduce(self) -> None:
        """Wait for the reduction ``reduce_grads`` started and add its result to the shards' ``.grad``."""
        pending, self._pending_reduce = self._pending_reduce, None
        if pending is not None:
            self.used_counts, self._had_grad = finish_reduction(pending, self.reduce_settings())
            self._last_plan = pending.plan

    def abandon(self) -> None:
        """After a backward that raised: complete whatever is in flight (every rank issued it), keep none of it."""
        pending, self._pending_reduce = self._pending_reduce, None
        if pending is not None:
            wait_works(pending.works)
            if pending.event is not None:
                self.streams.wait_event(pending.event)
        self.reshard()
        for slot in self.slots:
            slot.full.grad = None
        self.used_counts = None
        self.begin_step()

    def drop_unused_grads(self) -> None:
        """After the engine saw that some parameter of this unit had no gradient on any rank: give it ``None``
        again (its reduced gradient is exactly zero) unless an earlier micro-batch had given it one."""
        used = self.used_counts.tolist() if self.used_counts is not None else []
        slots = self._last_plan.slots if self._last_plan is not None else []
        for slot, count, had in zip(slots, used, self._had_grad):
            if count == 0 and not had:
                slot.param.grad = None

    def tag(self, kind: int) -> int:
        """This unit's collective of ``kind`` as one integer for ``Communicator.check_same_collective``
        (``describe_tag`` reads it)."""
        return self.index * len(CollectiveKind) + kind

    def local_param_bytes(self) -> int:
        """Bytes of parameter data this rank holds between steps (its shards, padding excluded)."""
        return sum(s.layout.local_numel for s in self.slots) * self.flat_shard.element_size()

    def full_param_bytes(self) -> int:
        return sum(s.param.element_size() * s.layout.rows * s.layout.row_numel for s in self.slots)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the gradients of those inputs are known: by then the
    autograd engine has run every node the unit's forward created (they were created later, and it runs ready nodes
    newest first), including the gradient accumulation of the unit's parameters."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.callback()
        return (None, *grads)


T = TypeVar("T")


def _cast_floating(tree: T, dtype: torch.dtype) -> T:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def only_embedding_lookups(slots: list[ParamSlot]) -> bool:
    """Whether every parameter of ``slots`` is the weight of a plain dense ``nn.Embedding`` and nothing else's.

    [Note: an embedding's backward reads no weight]
    A lookup's gradient is the output's gradient added into the looked-up rows: autograd saves the indices and the
    weight's size, never its values. So a unit whose parameters are only such weights (torchtitan's token-embedding
    unit) is not gathered for its backward, which comes last and so at the top of the gradients' memory: its
    full-size gradient is still made (autograd accumulates into the full-size stand-in, whose storage is empty, by
    its shape) and reduced as any other. ``nn.Embedding``'s own forward: a subclass that only changes the
    initialisation qualifies, one with a forward of its own may compute otherwise and does not. Not sparse (a sparse
    gradient is refused anyway), not a tensor-parallel piece (its lookup runs through DTensor), not tied to another
    module (the tied use may be a matmul, whose backward reads the weight). A forward recomputed inside backward
    (activation checkpointing) gathers the unit as every forward does."""
    return bool(slots) and all(is_embedding_lookup(slot.uses, slot.tensor_parallel is not None) for slot in slots)


def is_embedding_lookup(uses: list[ParamUse], tensor_parallel: bool) -> bool:
    """Whether a parameter used at ``uses`` is only ever a plain dense ``nn.Embedding``'s weight (see the Note above):
    its backward never reads it."""
    if tensor_parallel or not uses:
        return False
    for use in uses:
        module = use.module
        if not isinstance(module, nn.Embedding) or type(module).forward is not nn.Embedding.forward:
            return False
        if use.attr != "weight" or module.sparse:
            return False
    return True
