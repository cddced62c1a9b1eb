"""A unit's gradient half, inherited by ``FlatUnit``: reducing its gradients across ranks into the shards' ``.grad``,
or holding them while gradient sync is off."""

from __future__ import annotations

from typing import Any

import torch

from lightning_fsdp.engine.comm import wait_works
from lightning_fsdp.engine.records import CollectiveKind, ParamSlot, PendingReduce


class GradientReduction:
    """The gradient methods of ``FlatUnit`` (its attributes are the unit's; see ``FlatUnit.__init__``)."""

    def reduce_grads(self) -> None:
        """Start averaging this step's full gradients across ranks, with one used-flag per parameter behind each
        rank's chunk; ``finish_reduce`` completes it. On an accelerator all of it is queued at once on the
        reduce-scatter stream (see [Note: collectives on their own streams])."""
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
                        # Freed once the copy-in is queued: not reused before this stream has read it.
                        streams.record_stream(grad, streams.reduce_scatter_stream)
            self._start_reduce()
            pending = self._pending_reduce
            wait_works(pending.works)  # NCCL, HCCL: this stream waits for the collectives, the host does not
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
            self.shard_comm.check_same_collective(self.tag(CollectiveKind.REDUCE))
            works, inputs = [], []
            for j in plan.direct:
                flat = grads[j].reshape(-1).to(self.reduce_dtype)
                if pre_divide:
                    flat = flat / ranks
                out = reduced[plan.offsets[j] : plan.offsets[j] + plan.slots[j].layout.padded_numel]
                works.append(self._reduce_scatter(out, flat))
                if self.reduce_wire_dtype is None:
                    inputs.append(flat)  # the wire reduction keeps its own narrow copy: the full gradient can go
            # Rank-major, each gradient padded to ceil(d0/N) rows; the flags end every rank's chunk.
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
            self.shard_comm.check_same_collective(self.tag(CollectiveKind.REDUCE))
            works, inputs = [self.shard_comm.all_reduce(reduced, async_op=True)], []
        self._pending_reduce = PendingReduce(works, reduced, inputs, staged_out, pre_divide, ranks, plan)

    def _used_flags(self, used: list[bool]) -> torch.Tensor:
        if not self.streams.active:
            return torch.tensor(used, dtype=self.compute_dtype, device=self.device)
        # Filled on the device: a blocking host-to-device copy would stall the host until the stream drained.
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
            wait_works(pending.works)
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
            regions = [
                reduced[plan.offsets[j] : plan.offsets[j] + plan.slots[j].layout.padded_numel] for j in plan.staged
            ]
            sizes = [r.numel() for r in regions] + [len(plan.slots)]
            torch.split_with_sizes_copy(pending.staged_out, sizes, out=regions + [reduced[plan.numel :]])
        if self.replicate_comm is not None and self.replicate_comm.world_size > 1:
            self.replicate_comm.check_same_collective(self.tag(CollectiveKind.REPLICATE))
            self.replicate_comm.all_reduce(reduced)
        if not pending.pre_divide:
            reduced.div_(pending.ranks)
        # Divided, the sums stay > 0 where some rank had a gradient, all the engine asks. A copy: a view would keep the
        # whole reduction buffer alive after zero_grad.
        used_counts = reduced[plan.numel :].clone()
        return self._to_shard_device(reduced[: plan.numel]), used_counts

    def _to_shard_device(self, reduced: torch.Tensor) -> torch.Tensor:
        if self.pinned and self.streams.active:
            # Offloaded from an accelerator: copied asynchronously into pinned memory, waited for before the host reads.
            host = torch.empty(reduced.shape, dtype=self.dtype, pin_memory=True)
            host.copy_(reduced.to(self.dtype), non_blocking=True)
            return host
        return reduced.to(self.shard_device, self.dtype)

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
