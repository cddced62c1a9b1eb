"""One sharded unit: a module chosen by the wrap policy and the parameters it owns.

Between steps a unit holds one contiguous flat shard buffer; every managed parameter's ``.data`` is a view into it,
so the optimizer updates the buffer in place and the all-gather input needs no copy. While the unit computes, each
parameter is replaced in its module(s) by a full-size ``nn.Parameter`` whose data lives in the unit's full buffer.
Freeing a unit shrinks that buffer's storage to zero bytes; gathering again grows it back and refills it. Autograd
keeps references to the same tensor objects, so tensors it saved stay valid after a re-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_fsdp.engine.comm import Communicator, all_gather_flat
from lightning_fsdp.engine.shard import ShardLayout


# Kinds of a unit's collectives, for ``FlatUnit.tag``.
GATHER, REDUCE, REPLICATE = range(3)
_KINDS = 3


@dataclass(eq=False)
class ParamSlot:
    """One managed parameter: the user's Parameter object (holds the local shard) and where modules use it."""

    fqn: str
    param: nn.Parameter
    uses: list[tuple[nn.Module, str]]
    layout: ShardLayout
    offset: int = 0  # element offset of this parameter's padded chunk in the flat shard buffer
    full: nn.Parameter | None = None

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


class FlatUnit:
    """Gather, free and gradient reduction for one unit's parameters: flat collectives over its shard buffer."""

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
        shard_device: torch.device | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.shard_comm = shard_comm
        self.replicate_comm = replicate_comm
        self.sharded = sharded
        self.reshard_after_forward = reshard_after_forward
        # Trainable parameters first: the gradient buffer is then a prefix of the shard buffer's layout.
        self.slots = sorted(slots, key=lambda s: not s.trainable)
        self.trainable_slots = [s for s in self.slots if s.trainable]
        self.is_gathered = False
        self._pending: tuple | None = None  # an all-gather in flight: (work, input kept alive, output buffer)
        self._check_uniform_dtype()
        # Fixed now: once sharded, the parameters may live elsewhere (CPU offload).
        self.dtype = self.slots[0].param.dtype if self.slots else torch.float32
        self.device = self.slots[0].param.device if self.slots else torch.device("cpu")
        # Mixed precision: the shards keep their dtype (the master weights); gathers move and compute in
        # param_dtype, gradients are reduced in reduce_dtype.
        self.compute_dtype = param_dtype or self.dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        # CPU offload keeps the shards (and so their gradients and the optimizer state) in host memory.
        self.shard_device = shard_device or self.device
        self.index = 0  # position in the engine's unit list: names this unit's collectives for ``Communicator.agree``
        # After a reduction: per trainable parameter, how many ranks had a gradient for it (> 0: some rank used it),
        # and whether its shard already had a gradient (accumulation). Read once per backward by the engine.
        self.used_counts: torch.Tensor | None = None
        self._had_grad: list[bool] = []
        self.nonfinite: list[str] = []  # anomaly checking: parameters whose local gradient was not finite
        self._pending_reduce: tuple | None = None  # a reduction in flight: (work, output, input kept alive, ...)
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
        self.grad_numel = sum(s.layout.padded_numel for s in self.trainable_slots)
        n = self.world_size
        self.flat_shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.shard_device)
        # Unsharded units compute on the shard buffer itself and need no second copy of their parameters.
        # A NO_SHARD unit in full precision computes on its shard buffer directly.
        self._aliases_shard = not self.sharded and self.compute_dtype == self.dtype and self.shard_device == self.device
        full_numel = 0 if self._aliases_shard else n * self.shard_numel
        self.full_flat = torch.empty(full_numel, dtype=self.compute_dtype, device=self.device)
        self._split_sizes = [s.layout.padded_numel for s in self.slots]
        direct = self.sharded and len(self.slots) > 1
        self._direct = [i for i, slot in enumerate(self.slots)
                        if direct and n * slot.layout.padded_numel >= self.direct_gather_min_numel]
        self._staged = [i for i in range(len(self.slots)) if i not in self._direct]
        # The same for gradient reductions, where a parameter also needs rows that split evenly over the ranks: its
        # full gradient is then already the reduce-scatter's rank-major input, and needs no padded copy.
        self._direct_reduce = [j for j, slot in enumerate(self.trainable_slots)
                               if direct and slot.layout.shape and slot.layout.rows % n == 0
                               and n * slot.layout.padded_numel >= self.direct_gather_min_numel]
        self._staged_reduce = [j for j in range(len(self.trainable_slots)) if j not in self._direct_reduce]
        self._full_regions = []
        with torch.no_grad():
            for slot in self.slots:
                layout = slot.layout
                shard_view = self.flat_shard[slot.offset : slot.offset + layout.local_numel].view(layout.local_shape)
                shard_view.copy_(layout.local_slice(slot.param.data))
                full = nn.Parameter(torch.empty(0, dtype=self.compute_dtype, device=self.device),
                                    requires_grad=slot.param.requires_grad)
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

    # --------------------------------------------------------------------------------------- gather / free
    def _free_full(self) -> None:
        self.full_flat.untyped_storage().resize_(0)

    def gather(self) -> None:
        """Make every parameter of the unit full-size in its modules (one all-gather when sharded)."""
        if self.is_gathered:
            return
        if self._pending is None:
            self.start_gather(async_op=False)
        self._finish_gather()

    @property
    def is_alive(self) -> bool:
        """Full parameters allocated: gathered, or a (prefetch) gather in flight."""
        return self.is_gathered or self._pending is not None

    @property
    def is_prefetched(self) -> bool:
        """A gather was issued ahead of need and the unit has not been used yet."""
        return self._pending is not None

    def start_gather(self, *, async_op: bool = True) -> None:
        """Issue this unit's all-gather; with ``async_op`` it overlaps whatever runs until ``gather()``."""
        if self.is_alive:
            return
        self._pending = ()
        if self._aliases_shard or not self.slots:
            return
        shard = self.flat_shard.to(self.device, self.compute_dtype)  # no copy in full precision on one device
        if not self.sharded:
            self._allocate_full()
            with torch.no_grad():
                self.full_flat.copy_(shard)
            return
        n = self.world_size
        self.shard_comm.agree(self.tag(GATHER))
        if len(self.slots) == 1:
            # One parameter: rank-major and parameter-major layouts coincide, so gather in place.
            self._allocate_full()
            work = self.shard_comm.all_gather(self.full_flat, shard, async_op=async_op)
            self._pending = ([work], shard, None)
            return
        works = []
        if self._direct:
            self._allocate_full()
            for i in self._direct:
                slot = self.slots[i]
                chunk = shard[slot.offset : slot.offset + slot.layout.padded_numel]
                works.append(self.shard_comm.all_gather(self._full_regions[i].view(-1), chunk, async_op=async_op))
        gathered = None
        if self._staged:
            # The full buffer is allocated at copy-out, not now (unless a parameter is gathered in place): a
            # prefetched unit in flight then holds one unit-sized buffer (this staging one), not two.
            if self._direct:
                staged_in = torch.cat([shard[self.slots[i].offset : self.slots[i].offset + self._split_sizes[i]]
                                       for i in self._staged])
            else:
                staged_in = shard
            gathered = torch.empty(n * staged_in.numel(), dtype=self.compute_dtype, device=self.device)
            works.append(self.shard_comm.all_gather(gathered, staged_in, async_op=async_op))
            shard = (shard, staged_in)  # both kept alive until the gathers complete
        self._pending = (works, shard, gathered)

    def _allocate_full(self) -> None:
        storage = self.full_flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.full_flat.numel() * self.full_flat.element_size())

    def _finish_gather(self) -> None:
        pending, self._pending = self._pending, None
        if pending:
            works, _shard, gathered = pending
            for work in works:
                if work is not None:
                    work.wait()
            if gathered is not None:
                self._allocate_full()
                with torch.no_grad():
                    torch.split_with_sizes_copy(gathered.view(self.world_size, -1), self._staged_sizes, dim=1,
                                                out=self._staged_regions)
        self._install(full=True)
        self.is_gathered = True

    @torch.no_grad()
    def full_tensors(self) -> list[torch.Tensor]:
        """Every parameter in full, in the shards' (master) dtype, without touching the modules: for checkpoints."""
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

    def reshard(self) -> None:
        """Put the shards back into the modules and release the full parameters' memory."""
        if self._pending is not None:
            # A prefetch that was not used (the execution order changed): complete it, then drop it.
            self._finish_gather()
        if not self.is_gathered:
            return
        self._install(full=False)
        if not self._aliases_shard:
            self._free_full()
        self.is_gathered = False

    def _install(self, *, full: bool) -> None:
        for slot in self.slots:
            tensor = slot.full if full else slot.param
            for module, attr in slot.uses:
                module._parameters[attr] = tensor

    # ------------------------------------------------------------------------------------------ gradients
    def tag(self, kind: int) -> int:
        """This unit's collective of ``kind`` (GATHER, REDUCE, REPLICATE) as one integer for ``Communicator.agree``."""
        return self.index * _KINDS + kind

    def reduce_grads(self) -> None:
        """Start averaging this step's full gradients across ranks into the shards' ``.grad``; ``finish_reduce``
        completes it. The collective runs while backward goes on with other units.

        Each rank also contributes, per parameter, 1 if it has a gradient and 0 if not, packed behind its chunk of
        the same collective: the engine reads the sums at the end of backward and leaves ``.grad`` as ``None`` for
        parameters no rank used, as a single process would.
        """
        if not self.trainable_slots:
            return
        grads = []
        used = []
        for slot in self.trainable_slots:
            grad = slot.full.grad
            used.append(grad is not None)
            if grad is None:
                # Unused in this step on this rank; another rank may have used it, so it still takes part.
                grad = torch.zeros(slot.layout.shape, dtype=self.compute_dtype, device=self.device)
            grads.append(grad.reshape(slot.layout.rows, -1) if grad.dim() == 0 else grad)
            slot.full.grad = None
        if torch.is_anomaly_enabled():
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).tolist()
            self.nonfinite = [s.fqn for s, ok in zip(self.trainable_slots, finite) if not ok]
        n = self.world_size
        k = len(grads)
        ranks = self.shard_comm.world_size * (self.replicate_comm.world_size if self.replicate_comm else 1)
        flags = torch.tensor(used, dtype=self.compute_dtype, device=self.device)  # the gradients' dtype
        # float16 sums can overflow: divide before summing there, after summing everywhere else.
        pre_divide = self.reduce_dtype == torch.float16
        staged_out = None
        if self.sharded:
            reduced = torch.empty(self.grad_numel + k, dtype=self.reduce_dtype, device=self.device)
            self.shard_comm.agree(self.tag(REDUCE))
            works, inputs = [], []
            for j in self._direct_reduce:
                slot = self.trainable_slots[j]
                flat = grads[j].reshape(-1).to(self.reduce_dtype)
                if pre_divide:
                    flat = flat / ranks
                out = reduced[slot.offset : slot.offset + slot.layout.padded_numel]
                works.append(self.shard_comm.reduce_scatter(out, flat, async_op=True))
                inputs.append(flat)
            # _chunk_cat pads each gradient to ceil(d0/N) rows per rank and lays the ranks out one after another;
            # the flags, repeated once per rank, end every rank's chunk.
            staged = [grads[j] for j in self._staged_reduce] + [flags.expand(n, k)]
            flat_in = torch._chunk_cat(staged, dim=0, num_chunks=n).view(-1).to(self.reduce_dtype)
            if pre_divide:
                flat_in.div_(ranks)
            staged_out = torch.empty(flat_in.numel() // n, dtype=self.reduce_dtype, device=self.device) \
                if self._direct_reduce else reduced
            works.append(self.shard_comm.reduce_scatter(staged_out, flat_in, async_op=True))
            inputs.append(flat_in)
            if staged_out is reduced:
                staged_out = None
        else:
            reduced = torch.cat([g.reshape(-1).to(self.reduce_dtype) for g in grads] + [flags])
            if pre_divide:
                reduced.div_(ranks)
            self.shard_comm.agree(self.tag(REDUCE))
            works, inputs = [self.shard_comm.all_reduce(reduced, async_op=True)], []
        self._pending_reduce = (works, reduced, inputs, staged_out, pre_divide, ranks)

    def finish_reduce(self) -> None:
        """Wait for the reduction ``reduce_grads`` started and add its result to the shards' ``.grad``."""
        if self._pending_reduce is None:
            return
        works, reduced, _inputs, staged_out, pre_divide, ranks = self._pending_reduce
        self._pending_reduce = None
        for work in works:
            if work is not None:
                work.wait()
        if staged_out is not None:
            # Parameters reduced through the padded copy, and the flags: into their places in ``reduced``.
            regions = [reduced[s.offset : s.offset + s.layout.padded_numel]
                       for s in (self.trainable_slots[j] for j in self._staged_reduce)]
            sizes = [r.numel() for r in regions] + [len(self.trainable_slots)]
            torch.split_with_sizes_copy(staged_out, sizes, out=regions + [reduced[self.grad_numel :]])
        if self.replicate_comm is not None and self.replicate_comm.world_size > 1:
            self.replicate_comm.agree(self.tag(REPLICATE))
            self.replicate_comm.all_reduce(reduced)
        if not pre_divide:
            reduced.div_(ranks)
        # Divided, the sums stay > 0 exactly where some rank had a gradient, which is all the engine asks. A copy:
        # a view would keep the whole reduction buffer, which the gradients are views of, alive after zero_grad.
        self.used_counts = reduced[self.grad_numel :].clone()
        reduced = reduced[: self.grad_numel].to(self.shard_device, self.dtype)
        self._had_grad = [slot.param.grad is not None for slot in self.trainable_slots]
        for slot in self.trainable_slots:
            layout = slot.layout
            grad = reduced[slot.offset : slot.offset + layout.local_numel].view(layout.local_shape)
            if slot.param.grad is None:
                slot.param.grad = grad
            else:
                slot.param.grad += grad

    def drop_unused_grads(self) -> None:
        """After the engine saw that some parameter of this unit had no gradient on any rank: give it ``None``
        again (its reduced gradient is exactly zero) unless an earlier micro-batch had given it one."""
        used = self.used_counts.tolist() if self.used_counts is not None else []
        for slot, count, had in zip(self.trainable_slots, used, self._had_grad):
            if count == 0 and not had:
                slot.param.grad = None

    # ------------------------------------------------------------------------------------------- accounting
    def local_param_bytes(self) -> int:
        """Bytes of parameter data this rank holds between steps (its shards, padding excluded)."""
        return sum(s.layout.local_numel for s in self.slots) * self.flat_shard.element_size()

    def full_param_bytes(self) -> int:
        return sum(s.param.element_size() * s.layout.rows * s.layout.row_numel for s in self.slots)
