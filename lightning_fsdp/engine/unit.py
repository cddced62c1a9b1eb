"""One sharded unit: a module chosen by the wrap policy and the parameters it owns (torch FSDP2's
``FSDPParamGroup``): unshard, reshard and gradient reduction, each a flat collective over the unit's buffers.

[Note: flat buffers and stand-in parameters]
Between steps a unit holds one contiguous flat shard buffer; every managed parameter's ``.data`` is a view into it,
so the optimizer updates the buffer in place and the all-gather input needs no copy. While the unit computes
(unsharded), each parameter is replaced in its module(s) by a full-size ``nn.Parameter`` stand-in whose data lives
in the unit's full buffer. Resharding shrinks that buffer's storage to zero bytes; unsharding again grows it back
and refills it. Autograd keeps references to the same tensor objects, so tensors it saved stay valid after a
re-unshard.

[Note: a unit's states]
``ShardedState`` says where the unit's parameters are (SHARDED, UNSHARDING: an all-gather issued ahead of need,
UNSHARDED); ``UnitStepState`` counts the unit's calls in the current training step, which decide when its
gradients can be reduced (see ``ShardingEngine``). Both are declared here; the engine only drives them. Three more
pieces of state outlive a step; the engine's controls set them (see [Note: engine controls] in ``state.py``):

* ``kept``: the unit stays unsharded (an explicit ``ShardingEngine.unshard``, or the end of a backward with
  ``reshard_after_backward`` off) until ``reshard()`` is called on it; the engine's own reshards leave it alone.
* the secondary shard (``reshard(secondary=comm)`` after a forward, ZeRO++ hpZ): this rank's 1/N of the full
  parameters, enough for the next unshard to all-gather over the N ranks of ``comm`` instead of the shard group.
  The next unshard consumes it; any other reshard drops it (the shards may have changed since).
* held gradients (``hold_grads``, gradient sync off): each parameter's full-size gradient summed over the backwards
  since the last reduction (``ParamSlot.unsynced_grad``), added to the next backward's before it is reduced; and
  ``grads_unsynced``, the same on every rank, which keeps the held parameters in the next reduction's plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum, auto
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_fsdp.engine.comm import Communicator, all_gather_flat
from lightning_fsdp.engine.config import check_wire_narrower
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.streams import INACTIVE, CollectiveStreams, pins_host_memory
from lightning_fsdp.engine.wrap import ParamUse


class CollectiveKind(IntEnum):
    """The kinds of a unit's collectives, for ``FlatUnit.tag``."""

    ALL_GATHER = 0  # unshard
    REDUCE = 1  # gradient reduction over the shard group
    REPLICATE = 2  # all-reduce of the reduced gradients across replicas (hybrid sharding)


class ShardedState(Enum):
    """Where a unit's parameters are (torch FSDP2's ``ShardedState``, plus the in-flight state of a prefetch)."""

    SHARDED = auto()  # the modules hold the shards; the full buffer has no storage
    UNSHARDING = auto()  # the all-gather was issued (a prefetch) and not yet waited on; the modules hold the shards
    UNSHARDED = auto()  # the modules hold the full-size stand-ins


@dataclass
class UnitStepState:
    """A unit's calls in the current training step; ``FlatUnit.begin_step`` starts it afresh.

    A call whose inputs need a gradient signals the end of its backward (a ``_PostBackward`` on its inputs); a call
    whose inputs need none (an untracked call) gives no such signal, so the end of backward reduces the unit.
    """

    forward_calls: int = 0  # outermost calls this step that will signal the end of their backward
    backward_calls: int = 0  # of those, how many have signalled
    untracked_calls: int = 0  # calls whose inputs need no gradient: no signal when their backward ends
    reduced: bool = False  # this step's gradient reduction was issued (or, gradient sync off, its gradients held)

    def track_call(self) -> None:
        self.forward_calls += 1

    def untrack_call(self, *, was_tracked: bool = False) -> None:
        """Count a call that will not signal; ``was_tracked``: it had been counted as one that would."""
        if was_tracked:
            self.forward_calls -= 1
        self.untracked_calls += 1

    def backward_ended(self) -> bool:
        """Count one signalled end of backward; True when the unit's gradients are complete and can be reduced: the
        backward of every tracked call ended (a unit that ran more than once this step waits for the backward of its
        first call), no call was untracked, and the reduction was not issued yet."""
        self.backward_calls += 1
        return self.backward_calls == self.forward_calls and not self.untracked_calls and not self.reduced


@dataclass(eq=False)
class ParamSlot:
    """One managed parameter: the user's Parameter object (holds the local shard) and where modules use it."""

    fqn: str
    param: nn.Parameter
    uses: list[ParamUse]
    layout: ShardLayout
    offset: int = 0  # element offset of this parameter's padded chunk in the flat shard buffer
    full: nn.Parameter | None = None
    # Took part with requires_grad=True in a forward of the current step: its gradient may still arrive even if the
    # user has frozen it since, so the step's reduction keeps a place for it.
    in_graph: bool = False
    # The requires_grad the engine last gave ``full``: if ``full`` differs at the next sync, the user flipped it
    # through the module while it was installed there (after a forward whose backward never came).
    synced_requires_grad: bool = True
    # Gradient sync off: the full-size gradient of the backwards since the last reduction (``FlatUnit.hold_grads``).
    unsynced_grad: torch.Tensor | None = None

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


class ReducePlan(NamedTuple):
    """The parameters one gradient reduction carries and where each lands: one plan per set of trainable parameters.

    ``requires_grad`` may change at any time (fine-tuning schedules, ``toggle_optimizer``), so the reduction's layout
    follows what is trainable now instead of what was trainable when the model was sharded; gradient memory follows
    it too. Every rank freezes the same parameters, so every rank builds the same plan and the collectives match.
    """

    slots: list[ParamSlot]
    offsets: list[int]  # element offset of each parameter's padded chunk in the reduction's output
    numel: int  # gradient elements per rank, padding included, before the used-flags
    direct: list[int]  # indices into ``slots`` reduced on their own, in place (large, rows split evenly)
    staged: list[int]  # indices packed through the padded rank-major copy


class PendingGather(NamedTuple):
    """An unshard's all-gathers in flight (see ``FlatUnit.start_unshard``)."""

    works: list[Any]
    inputs: list[torch.Tensor]  # kept alive until the collectives complete
    staged_out: torch.Tensor | None  # the staging buffer's output, copied into the full buffer when done
    ranks: int  # the ranks gathered over: the shard group's, or a secondary group's (each sent 1/ranks of the unit)
    # On an accelerator: recorded on the all-gather stream after the collectives (see [Note: collectives on their own
    # streams]); the compute stream waits for it before reading the full parameters. None on CPU.
    event: Any = None


class SecondaryShard(NamedTuple):
    """After a forward resharded to a smaller group (``FlatUnit.reshard(secondary=...)``): this rank's part of the
    full parameters for an all-gather over ``comm``. Laid out as the full buffer is (parameter after parameter), each
    parameter's piece being the padded chunks of the ``world_size / comm.world_size`` consecutive shard-group ranks
    whose rows this rank keeps: the pieces of ``comm``'s ranks, end to end, are the whole parameter."""

    comm: Communicator
    buffer: torch.Tensor


class PendingReduce(NamedTuple):
    """A gradient reduction in flight (see ``FlatUnit.reduce_grads``)."""

    works: list[Any]
    output: torch.Tensor  # this rank's reduced gradients, then one used-flag per parameter
    inputs: list[torch.Tensor]  # kept alive until the collectives complete
    staged_out: torch.Tensor | None  # the packed collective's output, copied into ``output`` when done
    pre_divide: bool
    ranks: int
    plan: ReducePlan
    # On an accelerator the post-reduce work is queued at once, on the reduce-scatter stream: ``event`` is recorded
    # after it, ``result`` is what ``_post_reduce`` returned. Both None on CPU (see [Note: collectives on their own
    # streams]).
    event: Any = None
    result: tuple[torch.Tensor, torch.Tensor] | None = None


class FlatUnit:
    """Unshard, reshard and gradient reduction for one unit's parameters: flat collectives over its shard buffer."""

    # Parameters whose full (padded) size reaches this many elements are all-gathered on their own, straight into
    # place: for one parameter the ranks' chunks laid end to end are its rows, so it needs no staging buffer and no
    # copy-out. Smaller ones share one collective through a staging buffer, which keeps the number of collectives
    # per unit small. 2**18 float32 elements are 1 MiB.
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
        # Parameters trainable at sharding time first (the shard layout of earlier releases; checkpoints of the local
        # format depend on it). Which parameters are reduced is decided per step: see ``ReducePlan``.
        self.slots = sorted(slots, key=lambda s: not s.trainable)
        self._plans: dict[tuple[bool, ...], ReducePlan] = {}
        self._last_plan: ReducePlan | None = None
        self.sharded_state = ShardedState.SHARDED
        self._pending_unshard: PendingGather | None = None  # UNSHARDING with collectives to wait for
        # The engine's controls (see [Note: a unit's states]); the engine sets them, the unit only applies them.
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
        # Mixed precision: the shards keep their dtype (the master weights); unshards move and compute in
        # param_dtype, gradients are reduced in reduce_dtype.
        self.compute_dtype = param_dtype or self.dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        # Sent in this narrower dtype, summed in reduce_dtype (see [Note: narrow on the wire, wide in the sum]).
        if reduce_wire_dtype is not None:
            check_wire_narrower(reduce_wire_dtype, self.reduce_dtype)
        self.reduce_wire_dtype = reduce_wire_dtype
        # CPU offload keeps the shards (and so their gradients and the optimizer state) in host memory.
        self.shard_device = shard_device or self.device
        # ... pinned when the units compute on an accelerator, so that the copies to and from it are asynchronous.
        offloaded = self.shard_device.type == "cpu" and self.device != self.shard_device
        self.pinned = offloaded and pins_host_memory(self.device)
        # The engine gives every unit the streams of its device (see [Note: collectives on their own streams]).
        self.streams: CollectiveStreams = INACTIVE
        self.index = 0  # position in the engine's unit list: names this unit's collectives for ``Communicator.agree``
        # The engine's view of the unit's forward: calls open right now (the outermost one, and nested or
        # recomputed ones inside it), and whether the open outermost call put a ``_PostBackward`` on its inputs.
        self.forward_depth = 0
        self.marked_call = False
        self.step_state = UnitStepState()
        # After a reduction: per trainable parameter, how many ranks had a gradient for it (> 0: some rank used it),
        # and whether its shard already had a gradient (accumulation). Read once per backward by the engine.
        self.used_counts: torch.Tensor | None = None
        self._had_grad: list[bool] = []
        self.nonfinite: list[str] = []  # anomaly checking: parameters whose local gradient was not finite
        self._pending_reduce: PendingReduce | None = None
        self._build_buffers()

    # ----------------------------------------------------------------------------------------------- layout
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

    def _build_buffers(self) -> None:
        offset = 0
        for slot in self.slots:
            slot.offset = offset
            offset += slot.layout.padded_numel
        self.shard_numel = offset
        n = self.world_size
        self.flat_shard = torch.zeros(
            self.shard_numel, dtype=self.dtype, device=self.shard_device, pin_memory=self.pinned
        )
        # Unsharded units compute on the shard buffer itself and need no second copy of their parameters.
        # A NO_SHARD unit in full precision computes on its shard buffer directly.
        self._aliases_shard = not self.sharded and self.compute_dtype == self.dtype and self.shard_device == self.device
        full_numel = 0 if self._aliases_shard else n * self.shard_numel
        self.full_flat = torch.empty(full_numel, dtype=self.compute_dtype, device=self.device)
        self._split_sizes = [s.layout.padded_numel for s in self.slots]
        direct = self.sharded and len(self.slots) > 1
        self._direct = [
            i
            for i, slot in enumerate(self.slots)
            if direct and n * slot.layout.padded_numel >= self.direct_gather_min_numel
        ]
        self._staged = [i for i in range(len(self.slots)) if i not in self._direct]
        self._full_regions = []
        with torch.no_grad():
            for slot in self.slots:
                layout = slot.layout
                shard_view = self.flat_shard[slot.offset : slot.offset + layout.local_numel].view(layout.local_shape)
                shard_view.copy_(layout.local_slice(slot.param.data))
                full = nn.Parameter(
                    torch.empty(0, dtype=self.compute_dtype, device=self.device), requires_grad=slot.param.requires_grad
                )
                slot.synced_requires_grad = slot.param.requires_grad
                if not self._aliases_shard:
                    region = self.full_flat[n * slot.offset : n * (slot.offset + layout.padded_numel)]
                    self._full_regions.append(region.view(n, layout.padded_numel))
                    full.data = region.view(layout.padded_full_shape)[: layout.rows].view(layout.shape)
                else:
                    # Unsharded: the full parameter aliases the shard, so the optimizer's update is seen directly.
                    full.data = shard_view.view(layout.shape)
                slot.full = full
                slot.param.data = shard_view
        if not self._aliases_shard:
            self._staged_sizes = [self._split_sizes[i] for i in self._staged]
            self._staged_regions = [self._full_regions[i] for i in self._staged]
            self._free_full()

    # --------------------------------------------------------------------------------------- trainability
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
        """Forget the current training step: its calls, its reduction, which parameters took part (unless their
        gradients are held for a later reduction: they take part in it)."""
        self.step_state = UnitStepState()
        if not self.grads_unsynced:
            for slot in self.slots:
                slot.in_graph = False

    @property
    def trainable_slots(self) -> list[ParamSlot]:
        """The parameters this step's reduction carries: trainable now, or trainable in a forward of this step."""
        return self.reduce_plan().slots

    def reduce_plan(self) -> ReducePlan:
        key = tuple(s.param.requires_grad or s.in_graph for s in self.slots)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan([s for s, on in zip(self.slots, key) if on])
        return plan

    def _make_plan(self, slots: list[ParamSlot]) -> ReducePlan:
        n = self.world_size
        offsets, numel = [], 0
        for slot in slots:
            offsets.append(numel)
            numel += slot.layout.padded_numel
        # Like unshards, large gradients are reduced on their own when their rows split evenly over the ranks: the
        # full gradient is then already the reduce-scatter's rank-major input and needs no padded copy.
        many = self.sharded and len(self.slots) > 1
        direct = [
            j
            for j, slot in enumerate(slots)
            if many
            and slot.layout.shape
            and slot.layout.rows % n == 0
            and n * slot.layout.padded_numel >= self.direct_gather_min_numel
        ]
        staged = [j for j in range(len(slots)) if j not in direct]
        return ReducePlan(slots, offsets, numel, direct, staged)

    # ------------------------------------------------------------------------------------- unshard / reshard
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
        """Issue this unit's all-gather; with ``async_op`` it overlaps whatever runs until ``unshard()``.

        From the shard group, or, when a forward left a secondary shard, over that smaller group (which uses it up).
        On an accelerator it is queued on the all-gather stream either way (see [Note: collectives on their own
        streams]), and ``unshard()`` makes the compute stream wait for it.
        """
        if self.is_alive:
            return
        self.sharded_state = ShardedState.UNSHARDING
        secondary, self._secondary = self._secondary, None
        if self._aliases_shard or not self.slots:
            return
        streams = self.streams
        if not streams.active or not self.sharded:
            # CPU; or no collective to overlap (NO_SHARD casting or offloading): on the current stream.
            self._issue_unshard(secondary, async_op)
            return
        if len(self.slots) == 1 or self._direct:
            # Written in place by a collective: the full buffer outlives the unshard and reshard frees it on the
            # compute stream, so it is allocated there, before switching (see [Note: collectives on their own streams]).
            self._allocate_full()
        with streams.all_gather_side():
            self._issue_unshard(secondary, async_op, non_blocking=True)
            _wait(self._pending_unshard.works)  # NCCL, HCCL: this stream waits for the collectives, the host does not
            event = streams.record_event()
        self._pending_unshard = self._pending_unshard._replace(works=[], event=event)

    def _issue_unshard(self, secondary: SecondaryShard | None, async_op: bool, *, non_blocking: bool = False) -> None:
        if secondary is not None:
            comm, source = secondary.comm, secondary.buffer
        else:
            comm, source = self.shard_comm, self._shard_on_device(non_blocking)  # no copy in fp32
            if not self.sharded:
                self._allocate_full()
                with torch.no_grad():
                    self.full_flat.copy_(source)
                return
        # Each of the ``ranks`` ranks sends ``k`` consecutive padded chunks per parameter (k = 1 from the shards).
        ranks = comm.world_size
        k = self.world_size // ranks
        comm.agree(self.tag(CollectiveKind.ALL_GATHER))
        if len(self.slots) == 1:
            # One parameter: rank-major and parameter-major layouts coincide, so gather in place.
            self._allocate_full()
            work = comm.all_gather(self.full_flat, source, async_op=async_op)
            self._pending_unshard = PendingGather([work], [source], None, ranks)
            return
        works = []
        if self._direct:
            self._allocate_full()
            for i in self._direct:
                piece = source[k * self.slots[i].offset : k * (self.slots[i].offset + self._split_sizes[i])]
                works.append(comm.all_gather(self._full_regions[i].view(-1), piece, async_op=async_op))
        inputs, gathered = [source], None
        if self._staged:
            # The full buffer is allocated at copy-out, not now (unless a parameter is gathered in place): a
            # prefetched unit in flight then holds one unit-sized buffer (this staging one), not two.
            if self._direct:
                staged_in = torch.cat(
                    [
                        source[k * self.slots[i].offset : k * (self.slots[i].offset + self._split_sizes[i])]
                        for i in self._staged
                    ]
                )
            else:
                staged_in = source
            gathered = torch.empty(ranks * staged_in.numel(), dtype=self.compute_dtype, device=self.device)
            works.append(comm.all_gather(gathered, staged_in, async_op=async_op))
            inputs.append(staged_in)
        self._pending_unshard = PendingGather(works, inputs, gathered, ranks)

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
            _wait(pending.works)
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
        """Every parameter in full, in the shards' (master) dtype, without touching the modules: for checkpoints."""
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
        """Put the shards back into the modules and release the full parameters' memory; ends ``kept``.

        ``secondary`` (after a forward, ZeRO++ hpZ): first keep this rank's part of the full parameters for an
        all-gather over that smaller group of ranks (see ``SecondaryShard``), which the next unshard uses. Any other
        reshard drops a secondary shard: the shards it was taken from may have changed since (an optimizer step).
        """
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

    def release_buffers(self) -> None:
        """Free the flat buffers once the parameters own their full values again (``restore_unsharded``)."""
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

    # ------------------------------------------------------------------------------------------ gradients
    def tag(self, kind: int) -> int:
        """This unit's collective of ``kind`` as one integer for ``Communicator.agree`` (``describe_tag`` reads it)."""
        return self.index * len(CollectiveKind) + kind

    def reduce_grads(self) -> None:
        """Start averaging this step's full gradients across ranks into the shards' ``.grad``; ``finish_reduce``
        completes it. The collective runs while backward goes on with other units.

        Each rank also contributes, per parameter, 1 if it has a gradient and 0 if not, packed behind its chunk of
        the same collective: the engine reads the sums at the end of backward and leaves ``.grad`` as ``None`` for
        parameters no rank used, as a single process would.

        On an accelerator all of it, the post-reduce work included, is queued at once on the reduce-scatter stream
        (see [Note: collectives on their own streams]); ``finish_reduce`` makes the compute stream wait for it.
        """
        streams = self.streams
        if not streams.active:
            self._start_reduce()
            return
        plan = self.reduce_plan()
        if not plan.slots:
            return
        with streams.reduce_scatter_side() as compute:
            for slot in plan.slots:
                for grad in (slot.full.grad, slot.unsynced_grad):
                    if grad is not None:
                        # Allocated on the compute stream, read by this one: freed as soon as the copy-in is queued,
                        # so not handed out again before this stream has read it.
                        streams.record_stream(grad, streams.reduce_scatter_stream)
            self._start_reduce()
            pending = self._pending_reduce
            _wait(pending.works)  # NCCL, HCCL: this stream waits for the collectives, the host does not
            grads, used_counts = self._post_reduce(pending)
            # Allocated on this stream, read by the compute stream (as .grad, and by the engine).
            if grads.device == self.device:
                streams.record_stream(grads, compute)
            streams.record_stream(used_counts, compute)
            event = streams.record_event()
        # What the collectives read can go now: this stream is past them.
        self._pending_reduce = pending._replace(
            works=[], inputs=[], staged_out=None, event=event, result=(grads, used_counts)
        )

    def _start_reduce(self) -> None:
        plan = self.reduce_plan()
        if not plan.slots:
            return
        grads = []
        used = []
        self.grads_unsynced = False
        for slot in plan.slots:
            grad = self._take_grad(slot)
            used.append(grad is not None)
            if grad is None:
                # Unused in this step on this rank; another rank may have used it, so it still takes part.
                grad = torch.zeros(slot.layout.shape, dtype=self.compute_dtype, device=self.device)
            grads.append(grad.reshape(slot.layout.rows, -1) if grad.dim() == 0 else grad)
        if torch.is_anomaly_enabled():
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).tolist()
            self.nonfinite = [s.fqn for s, ok in zip(plan.slots, finite) if not ok]
        n = self.world_size
        k = len(grads)
        ranks = self.shard_comm.world_size * (self.replicate_comm.world_size if self.replicate_comm else 1)
        flags = self._used_flags(used)  # the gradients' dtype
        # float16 sums can overflow: divide before summing there, after summing everywhere else.
        pre_divide = self.reduce_dtype == torch.float16
        staged_out = None
        if self.sharded:
            reduced = torch.empty(plan.numel + k, dtype=self.reduce_dtype, device=self.device)
            self.shard_comm.agree(self.tag(CollectiveKind.REDUCE))
            works, inputs = [], []
            for j in plan.direct:
                flat = grads[j].reshape(-1).to(self.reduce_dtype)
                if pre_divide:
                    flat = flat / ranks
                out = reduced[plan.offsets[j] : plan.offsets[j] + plan.slots[j].layout.padded_numel]
                works.append(self._reduce_scatter(out, flat))
                if self.reduce_wire_dtype is None:
                    inputs.append(flat)  # the wire reduction keeps its own narrow copy: the full gradient can go
            # _chunk_cat pads each gradient to ceil(d0/N) rows per rank and lays the ranks out one after another;
            # the flags, repeated once per rank, end every rank's chunk.
            staged = [grads[j] for j in plan.staged] + [flags.expand(n, k)]
            flat_in = torch._chunk_cat(staged, dim=0, num_chunks=n).view(-1).to(self.reduce_dtype)
            if pre_divide:
                flat_in.div_(ranks)
            staged_out = (
                torch.empty(flat_in.numel() // n, dtype=self.reduce_dtype, device=self.device)
                if plan.direct
                else reduced
            )
            works.append(self._reduce_scatter(staged_out, flat_in))
            if self.reduce_wire_dtype is None:
                inputs.append(flat_in)
            if staged_out is reduced:
                staged_out = None
        else:
            reduced = torch.cat([g.reshape(-1).to(self.reduce_dtype) for g in grads] + [flags])
            if pre_divide:
                reduced.div_(ranks)
            self.shard_comm.agree(self.tag(CollectiveKind.REDUCE))
            works, inputs = [self.shard_comm.all_reduce(reduced, async_op=True)], []
        self._pending_reduce = PendingReduce(works, reduced, inputs, staged_out, pre_divide, ranks, plan)

    def _used_flags(self, used: list[bool]) -> torch.Tensor:
        if not self.streams.active:
            return torch.tensor(used, dtype=self.compute_dtype, device=self.device)
        # No host-to-device copy on an accelerator: a blocking one makes the host wait until the stream (which has
        # just waited for the compute stream) drains, once per reduction. Fills queue without waiting.
        flags = torch.ones(len(used), dtype=self.compute_dtype, device=self.device)
        for j, had_grad in enumerate(used):
            if not had_grad:
                flags[j].fill_(0)
        return flags

    def _reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> Any:
        if self.reduce_wire_dtype is None:
            return self.shard_comm.reduce_scatter(output, full, async_op=True)
        return self.shard_comm.reduce_scatter_wide(output, full, self.reduce_wire_dtype, async_op=True)

    def _take_grad(self, slot: ParamSlot) -> torch.Tensor | None:
        """``slot``'s full gradient to reduce: this backward's plus what earlier ones held (gradient sync off)."""
        grad, held = slot.full.grad, slot.unsynced_grad
        slot.full.grad = slot.unsynced_grad = None
        if held is None:
            return grad
        if grad is not None:
            held.add_(grad)
        return held.to(self.compute_dtype)

    def hold_grads(self) -> None:
        """Gradient sync off: instead of reducing, add this backward's full gradients to the ones held (no
        communication); the next ``reduce_grads`` reduces the sum once. Held in the reduction's dtype when that is
        the wider one (mixed precision), as torch's FSDP2 accumulates unsharded gradients."""
        plan = self.reduce_plan()
        if not plan.slots:
            return
        self.grads_unsynced = True
        for slot in plan.slots:
            grad, slot.full.grad = slot.full.grad, None
            if grad is None:
                continue
            if slot.unsynced_grad is None:
                # The gradient autograd accumulated belongs to this unit alone: kept as it is unless widened.
                slot.unsynced_grad = grad.to(torch.promote_types(grad.dtype, self.reduce_dtype))
            else:
                slot.unsynced_grad.add_(grad)

    def held_grad_bytes(self) -> int:
        """Bytes of the full-size gradients held for a later reduction (gradient sync off)."""
        return sum(
            s.unsynced_grad.numel() * s.unsynced_grad.element_size() for s in self.slots if s.unsynced_grad is not None
        )

    def finish_reduce(self) -> None:
        """Wait for the reduction ``reduce_grads`` started and add its result to the shards' ``.grad``."""
        pending = self._pending_reduce
        if pending is None:
            return
        self._pending_reduce = None
        if pending.event is None:
            _wait(pending.works)
            reduced, self.used_counts = self._post_reduce(pending)
        else:
            # Queued on the reduce-scatter stream by reduce_grads: the compute stream waits for all of it first.
            self.streams.wait_event(pending.event)
            reduced, self.used_counts = pending.result
        plan = pending.plan
        self._last_plan = plan
        self._had_grad = [slot.param.grad is not None for slot in plan.slots]
        if pending.event is not None and self.pinned and any(self._had_grad):
            # Offloaded and accumulating: the host adds to its gradients now, so the copy to it must be done.
            self.streams.synchronize_event(pending.event)
        for slot, offset in zip(plan.slots, plan.offsets):
            layout = slot.layout
            grad = reduced[offset : offset + layout.local_numel].view(layout.local_shape)
            if slot.param.grad is None:
                slot.param.grad = grad
            else:
                slot.param.grad += grad

    def _post_reduce(self, pending: PendingReduce) -> tuple[torch.Tensor, torch.Tensor]:
        """Once the collectives are done: the packed parameters and the flags into their places, the replicas'
        all-reduce, the division. Returns this rank's flat gradients (the shards' dtype, on the shard device) and the
        used-flags' sums."""
        plan, reduced = pending.plan, pending.output
        if pending.staged_out is not None:
            # Parameters reduced through the padded copy, and the flags: into their places in ``reduced``.
            regions = [
                reduced[plan.offsets[j] : plan.offsets[j] + plan.slots[j].layout.padded_numel] for j in plan.staged
            ]
            sizes = [r.numel() for r in regions] + [len(plan.slots)]
            torch.split_with_sizes_copy(pending.staged_out, sizes, out=regions + [reduced[plan.numel :]])
        if self.replicate_comm is not None and self.replicate_comm.world_size > 1:
            self.replicate_comm.agree(self.tag(CollectiveKind.REPLICATE))
            self.replicate_comm.all_reduce(reduced)
        if not pending.pre_divide:
            reduced.div_(pending.ranks)
        # Divided, the sums stay > 0 exactly where some rank had a gradient, which is all the engine asks. A copy:
        # a view would keep the whole reduction buffer, which the gradients are views of, alive after zero_grad.
        used_counts = reduced[plan.numel :].clone()
        return self._to_shard_device(reduced[: plan.numel]), used_counts

    def _to_shard_device(self, reduced: torch.Tensor) -> torch.Tensor:
        if self.pinned and self.streams.active:
            # Offloaded from an accelerator: into pinned host memory, asynchronously on the reduce-scatter stream. The
            # host waits for it before reading it (the end of backward, or an accumulation in finish_reduce).
            host = torch.empty(reduced.shape, dtype=self.dtype, pin_memory=True)
            host.copy_(reduced.to(self.dtype), non_blocking=True)
            return host
        return reduced.to(self.shard_device, self.dtype)

    def abandon(self) -> None:
        """After a backward that raised: complete whatever is in flight (every rank issued it), keep none of it."""
        pending, self._pending_reduce = self._pending_reduce, None
        if pending is not None:
            _wait(pending.works)
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

    # ------------------------------------------------------------------------------------------- accounting
    def local_param_bytes(self) -> int:
        """Bytes of parameter data this rank holds between steps (its shards, padding excluded)."""
        return sum(s.layout.local_numel for s in self.slots) * self.flat_shard.element_size()

    def full_param_bytes(self) -> int:
        return sum(s.param.element_size() * s.layout.rows * s.layout.row_numel for s in self.slots)


def _wait(works: list[Any]) -> None:
    """Wait for a collective's work handles (None where it completed synchronously, e.g. on one rank)."""
    for work in works:
        if work is not None:
            work.wait()
