"""Gradient reduction as free functions of explicit arguments, as torch FSDP2's ``foreach_reduce``: one unit's full
gradients averaged across ranks into its shards' ``.grad`` (``start_reduction``, then ``finish_reduction``), or held
while gradient sync is off (``hold_unsynced_grads``). ``FlatUnit`` calls them and keeps the reduction in flight."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from lightning_fsdp.engine.comm import Communicator, Waitable, wait_works
from lightning_fsdp.engine.records import ParamSlot, PendingReduce, ReducePlan
from lightning_fsdp.engine.streams import CollectiveStreams


class ReduceSettings(NamedTuple):
    """How one unit reduces its gradients (``FlatUnit.reduce_settings``): its groups, dtypes, devices and streams."""

    shard_comm: Communicator
    replicate_comm: Communicator | None  # hybrid sharding: the replicas' all-reduce after the reduce-scatter
    sharded: bool  # reduce-scatter over the shard group; False (NO_SHARD): one all-reduce
    grad_dtype: torch.dtype  # the full gradients' dtype: the unit's compute dtype
    reduce_dtype: torch.dtype  # summed in
    wire_dtype: torch.dtype | None  # sent as (see [Note: narrow on the wire, wide in the sum])
    device: torch.device  # the compute device
    shard_dtype: torch.dtype  # the shards' and so the reduced ``.grad``'s
    shard_device: torch.device
    pinned: bool  # cpu_offload from an accelerator: the reduced gradients go to pinned host memory
    streams: CollectiveStreams
    reduce_tag: int  # ``Communicator.check_same_collective`` tags of the reduction and of the replicas' all-reduce
    replicate_tag: int


def start_reduction(plan: ReducePlan, settings: ReduceSettings) -> tuple[PendingReduce, list[str] | None]:
    """Start averaging the full gradients of ``plan``'s parameters (this backward's plus the held ones) across ranks,
    with one used-flag per parameter behind each rank's chunk; ``finish_reduction`` completes it. On an accelerator
    all of it is queued at once on the reduce-scatter stream (see [Note: collectives on their own streams]). Also
    returns, under anomaly checking, the parameters whose local gradient was not finite (None when not checked)."""
    streams = settings.streams
    if not streams.active:
        return _issue_reduction(plan, settings)
    with streams.reduce_scatter_side() as compute:
        for slot in plan.slots:
            for grad in (slot.full.grad, slot.unsynced_grad):
                if isinstance(grad, DTensor):
                    grad = grad._local_tensor  # redistributed (if at all) by ``ParamSlot.take_full_grad`` below
                if grad is not None:
                    # Freed once the copy-in is queued: not reused before this stream has read it.
                    streams.record_stream(grad, streams.reduce_scatter_stream)
        pending, nonfinite = _issue_reduction(plan, settings)
        wait_works(pending.works)  # NCCL, HCCL: this stream waits for the collectives, the host does not
        grads, used_counts = _after_collectives(pending, settings)
        # Allocated on this stream, read by the compute stream (as .grad, and by the engine).
        if grads.device == settings.device:
            streams.record_stream(grads, compute)
        streams.record_stream(used_counts, compute)
        event = streams.record_event()
    # What the collectives read can go now: this stream is past them.
    done = pending._replace(works=[], inputs=[], staged_out=None, event=event, result=(grads, used_counts))
    return done, nonfinite


def _issue_reduction(plan: ReducePlan, settings: ReduceSettings) -> tuple[PendingReduce, list[str] | None]:
    grads = []
    used = []
    for slot in plan.slots:
        grad = _take_grad(slot, settings.grad_dtype)
        used.append(grad is not None)
        if grad is None:
            # Unused in this step on this rank; another rank may have used it, so it still takes part.
            grad = torch.zeros(slot.layout.shape, dtype=settings.grad_dtype, device=settings.device)
        grads.append(grad.reshape(slot.layout.rows, -1) if grad.dim() == 0 else grad)
    nonfinite = None
    if torch.is_anomaly_enabled():
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).tolist()
        nonfinite = [s.fqn for s, ok in zip(plan.slots, finite) if not ok]
    shard_comm, replicate_comm = settings.shard_comm, settings.replicate_comm
    ranks = shard_comm.world_size * (replicate_comm.world_size if replicate_comm else 1)
    flags = used_flags(used, settings.grad_dtype, settings.device, on_device=settings.streams.active)
    # float16 sums can overflow: divide before summing there, after summing everywhere else.
    pre_divide = settings.reduce_dtype == torch.float16
    if not settings.sharded:
        reduced = torch.cat([g.reshape(-1).to(settings.reduce_dtype) for g in grads] + [flags])
        if pre_divide:
            reduced.div_(ranks)
        shard_comm.check_same_collective(settings.reduce_tag)
        works = [shard_comm.all_reduce(reduced, async_op=True)]
        return PendingReduce(works, reduced, [], None, pre_divide, ranks, plan), nonfinite
    n = shard_comm.world_size
    k = len(grads)
    reduced = torch.empty(plan.numel + k, dtype=settings.reduce_dtype, device=settings.device)
    shard_comm.check_same_collective(settings.reduce_tag)
    works, inputs = [], []
    for j in plan.direct:
        flat = grads[j].reshape(-1).to(settings.reduce_dtype)
        if pre_divide:
            flat = flat / ranks
        out = reduced[plan.offsets[j] : plan.offsets[j] + plan.slots[j].layout.padded_numel]
        works.append(_reduce_scatter(out, flat, shard_comm, settings.wire_dtype))
        if settings.wire_dtype is None:
            inputs.append(flat)  # the wire reduction keeps its own narrow copy: the full gradient can go
    # Rank-major, each gradient padded to ceil(d0/N) rows; the flags end every rank's chunk.
    staged = [grads[j] for j in plan.staged] + [flags.expand(n, k)]
    flat_in = torch._chunk_cat(staged, dim=0, num_chunks=n).view(-1).to(settings.reduce_dtype)
    if pre_divide:
        flat_in.div_(ranks)
    staged_out = (
        torch.empty(flat_in.numel() // n, dtype=settings.reduce_dtype, device=settings.device)
        if plan.direct
        else reduced
    )
    works.append(_reduce_scatter(staged_out, flat_in, shard_comm, settings.wire_dtype))
    if settings.wire_dtype is None:
        inputs.append(flat_in)
    packed_out = None if staged_out is reduced else staged_out
    return PendingReduce(works, reduced, inputs, packed_out, pre_divide, ranks, plan), nonfinite


def used_flags(used: list[bool], dtype: torch.dtype, device: torch.device, *, on_device: bool) -> torch.Tensor:
    """One flag per parameter, 1 where this rank had its gradient. ``on_device`` (the stream path): filled on the
    device, as a blocking host-to-device copy would stall the host until the stream drained."""
    if not on_device:
        return torch.tensor(used, dtype=dtype, device=device)
    flags = torch.ones(len(used), dtype=dtype, device=device)
    for j, had_grad in enumerate(used):
        if not had_grad:
            flags[j].fill_(0)
    return flags


def _reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, comm: Communicator, wire_dtype: torch.dtype | None
) -> Waitable | None:
    if wire_dtype is None:
        return comm.reduce_scatter(output, full, async_op=True)
    return comm.reduce_scatter_wide(output, full, wire_dtype, async_op=True)


def _take_grad(slot: ParamSlot, grad_dtype: torch.dtype) -> torch.Tensor | None:
    """``slot``'s full gradient to reduce: this backward's plus what earlier ones held (gradient sync off)."""
    grad, held = slot.take_full_grad(), slot.unsynced_grad
    slot.unsynced_grad = None
    if held is None:
        return grad
    if grad is not None:
        held.add_(grad)
    return held.to(grad_dtype)


def hold_unsynced_grads(slots: list[ParamSlot], reduce_dtype: torch.dtype) -> None:
    """Gradient sync off: instead of reducing, add this backward's full gradients of ``slots`` to the ones held (no
    communication); the next reduction reduces the sum once. Held in ``reduce_dtype`` when that is the wider one
    (mixed precision), as torch's FSDP2 accumulates unsharded gradients."""
    for slot in slots:
        grad = slot.take_full_grad()
        if grad is None:
            continue
        if slot.unsynced_grad is None:
            # The gradient autograd accumulated belongs to this unit alone: kept as it is unless widened.
            slot.unsynced_grad = grad.to(torch.promote_types(grad.dtype, reduce_dtype))
        else:
            slot.unsynced_grad.add_(grad)


def finish_reduction(pending: PendingReduce, settings: ReduceSettings) -> tuple[torch.Tensor, list[bool]]:
    """Wait for the reduction ``start_reduction`` started and add its result to the shards' ``.grad``. Returns the
    used-flags' sums (> 0 where some rank had the gradient) and, per parameter of the plan, whether its shard had a
    ``.grad`` before (an earlier micro-batch's)."""
    if pending.event is None or pending.result is None:
        wait_works(pending.works)
        reduced, used_counts = _after_collectives(pending, settings)
    else:
        # Queued on the reduce-scatter stream by start_reduction: the compute stream waits for all of it first.
        settings.streams.wait_event(pending.event)
        reduced, used_counts = pending.result
    plan = pending.plan
    had_grad = [slot.param.grad is not None for slot in plan.slots]
    if pending.event is not None and settings.pinned and any(had_grad):
        # Offloaded and accumulating: the host adds to its gradients now, so the copy to it must be done.
        settings.streams.synchronize_event(pending.event)
    for slot, offset in zip(plan.slots, plan.offsets):
        layout = slot.layout
        grad = reduced[offset : offset + layout.local_numel].view(layout.local_shape)
        if slot.param.grad is None:
            slot.param.grad = grad
        else:
            slot.param.grad += grad
    return used_counts, had_grad


def _after_collectives(pending: PendingReduce, settings: ReduceSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Once the collectives are done: the packed parameters and the flags into their places, the replicas'
    all-reduce, the division. Returns this rank's flat gradients (the shards' dtype, on the shard device) and the
    used-flags' sums."""
    plan, reduced = pending.plan, pending.output
    if pending.staged_out is not None:
        regions = [reduced[plan.offsets[j] : plan.offsets[j] + plan.slots[j].layout.padded_numel] for j in plan.staged]
        sizes = [r.numel() for r in regions] + [len(plan.slots)]
        torch.split_with_sizes_copy(pending.staged_out, sizes, out=regions + [reduced[plan.numel :]])
    replicate_comm = settings.replicate_comm
    if replicate_comm is not None and replicate_comm.world_size > 1:
        replicate_comm.check_same_collective(settings.replicate_tag)
        replicate_comm.all_reduce(reduced)
    if not pending.pre_divide:
        reduced.div_(pending.ranks)
    # Divided, the sums stay > 0 where some rank had a gradient, all the engine asks. A copy: a view would keep the
    # whole reduction buffer alive after zero_grad.
    used_counts = reduced[plan.numel :].clone()
    return _to_shard_device(reduced[: plan.numel], settings), used_counts


def _to_shard_device(reduced: torch.Tensor, settings: ReduceSettings) -> torch.Tensor:
    if settings.pinned and settings.streams.active:
        # Offloaded from an accelerator: copied asynchronously into pinned memory, waited for before the host reads.
        host = torch.empty(reduced.shape, dtype=settings.shard_dtype, pin_memory=True)
        host.copy_(reduced.to(settings.shard_dtype), non_blocking=True)
        return host
    return reduced.to(settings.shard_device, settings.shard_dtype)
