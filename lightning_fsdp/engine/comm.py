"""The engine's collectives, behind one small interface that also counts the bytes it moves.

[Note: which collectives]
Reductions are SUM then an explicit division: ``AVG`` and ``PREMUL_SUM`` are missing on some backends, and older gloo
silently returned SUM for them. Under anomaly checking ``Communicator.check_same_collective`` precedes every
collective, so ranks that disagree raise, naming what each was about to do, instead of hanging.

[Note: narrow on the wire, wide in the sum]
``reduce_wire_dtype`` (``reduce_scatter_wide``): docs/options.md, and why an all-to-all: docs/decisions.md.

[Note: collectives on gloo]
The form each backend gets is ``backends.py``'s [Note: the capability table]; ``Communicator`` reads its row once.
The engine's own groups of CPU ranks on one host all-gather and reduce-scatter (float32/float64) through shared
memory instead ([Note: the shared-memory exchange] in shared_memory.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from lightning_fsdp.engine.backends import FLAT, CollectiveForms, Gather, ReduceScatter, as_carried, forms_for
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.shared_memory import SharedMemoryExchange, shared_memory_wanted


class Waitable(Protocol):
    """A collective in flight: a ``torch.distributed.Work`` or a ``Pending``."""

    def wait(self) -> object: ...


T = TypeVar("T")

# From this size on, an all-to-all form's reduction runs in place ([Note: a large reduction in place]); glibc maps
# blocks this large afresh (engine/host_memory.py), so the all-to-all's receive buffer would add to the resident set.
IN_PLACE_REDUCE_BYTES = 32 * 2**20


def _torch_flat(name: str, old_name: str) -> Callable[..., Waitable | None]:
    # torch 2.13 renamed the flat collectives; older releases only have the *_tensor names. Looked up per call.
    return getattr(dist, name, None) or getattr(dist, old_name)


def _settle(pending: Pending, async_op: bool) -> Pending | None:
    """``pending`` for an ``async_op`` caller to wait on; otherwise waited for here (None)."""
    if async_op:
        return pending
    pending.wait()
    return None


def all_gather_flat(
    output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Waitable | None:
    """``all_gather_into_tensor`` in the form ``group``'s backend has (``backends.py``): ``output`` (N *
    tensor.numel(),) receives every rank's ``tensor`` in rank order. Not counted in any ``CommStats``."""
    return Communicator(group, tensor.device).gather_uncounted(output, tensor, async_op=async_op)


@dataclass
class CommStats:
    """Input bytes this rank put into each kind of training-step collective since ``reset`` (not checkpoints')."""

    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0
    all_gather_calls: int = 0
    reduce_scatter_calls: int = 0
    all_reduce_calls: int = 0
    # Most non-root units alive (unsharded or unsharding) at once; the root stays unsharded into backward by design.
    peak_gathered_units: int = 0

    def reset(self) -> None:
        for counter in fields(self):
            setattr(self, counter.name, counter.default)


class Pending:
    """Collectives in flight as one handle: ``wait()`` waits for ``works`` (see ``wait_naming_timeout``), then runs
    ``finish`` once, the local step that completes the result; ``keep``: what the collectives read, alive until then."""

    def __init__(
        self,
        works: Sequence[Waitable],
        finish: Callable[[], object] | None = None,
        timeout_ms: int | None = None,
        keep: object = None,
    ) -> None:
        self._works, self._finish, self._timeout_ms, self._keep = list(works), finish, timeout_ms, keep

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            wait_naming_timeout(work, self._timeout_ms)
        finish, self._finish, self._keep = self._finish, None, None
        if finish is not None:
            finish()


def wait_naming_timeout(work: Waitable, timeout_ms: int | None) -> None:
    """``work.wait()``, naming the group's timeout when gloo's broadcast or all-to-all times out (their error,
    unlike its all-gather's, does not say how long it waited)."""
    try:
        work.wait()
    except RuntimeError as error:
        if timeout_ms is None or "timeout" not in str(error).lower():
            raise
        raise RuntimeError(
            f"{error}: a gloo collective of the sharding engine waited past its process group's timeout "
            f"({timeout_ms} ms); another rank stopped, hung, or did not issue the same collective"
        ) from error


def _gloo_timeout_ms(group: dist.ProcessGroup | None) -> int | None:
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return int(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() * 1000)
    except (AttributeError, RuntimeError):
        return None


class Communicator:
    """Collectives over one process group (the shard group), with byte accounting. ``forms``: the row of the
    capability table to use (default: the group's backend's, see ``backends.py``)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        forms: CollectiveForms | None = None,
    ) -> None:
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.device = device or torch.device("cpu")  # where this group's collectives take tensors (NCCL: GPU)
        if forms is None:
            forms = forms_for(dist.get_backend(group), self.device) if distributed and self.world_size > 1 else FLAT
        self.forms = forms
        # Broadcasts and all-to-all fail on gloo without naming the timeout (see wait_naming_timeout).
        self._timeout_ms = _gloo_timeout_ms(group) if forms is not FLAT else None
        self._global_ranks = (
            [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]
            if distributed
            else [0]
        )
        self.exchange: SharedMemoryExchange | None = None
        self.stats = CommStats()
        # Turns a ``check_same_collective`` tag into words for the error message; the engine installs one that names
        # units.
        self.describe_tag: Callable[[int], str] = lambda tag: f"collective #{tag}"

    def use_shared_memory(self) -> bool:
        """Route this group's all-gathers and float reduce-scatters through the same-host exchange where its ranks
        share ``/dev/shm`` (CPU groups on gloo or MPI; [Note: the shared-memory exchange]). Collective: every rank
        of the group calls it at the same point. True where the exchange is in use."""
        if self.world_size > 1 and self.forms is not FLAT and self.device.type == "cpu" and shared_memory_wanted():
            self.exchange = SharedMemoryExchange.for_group(self.group, self.rank, self._global_ranks, self._timeout_ms)
        return self.exchange is not None

    def _exchange_here(self) -> SharedMemoryExchange | None:
        """The same-host exchange where this thread may issue into it (the one that made it), else None: gloo."""
        return self.exchange if self.exchange is not None and self.exchange.usable_here() else None

    def check_same_collective(self, tag: int) -> None:
        """Under anomaly checking, confirm every rank is about to issue the same collective (``tag``): otherwise a
        unit run on some ranks only pairs unrelated collectives, a hang or a silent mix of tensors. One small
        all-gather per collective."""
        if self.world_size == 1 or not torch.is_anomaly_enabled():
            return
        mine = torch.tensor([tag], dtype=torch.int64, device=self.device)
        every = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        self.gather_uncounted(every, mine)
        tags = every.tolist()
        if len(set(tags)) > 1:
            listing = "; ".join(f"rank {r}: {self.describe_tag(t)}" for r, t in enumerate(tags))
            raise RuntimeError(
                f"Ranks are about to issue different collectives ({listing}). A wrapped module ran on some ranks "
                "but not on others (control flow that depends on the data differs between ranks). Every rank must "
                "run the same sharded units in the same order; parameters skipped inside a unit are fine."
            )

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj`` in rank order (pickled; for small reports, not tensors of the step)."""
        if self.world_size == 1:
            return [obj]
        out = [obj] * self.world_size  # placeholders: every entry is overwritten with that rank's object
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False) -> Waitable | None:
        """``output`` (N * shard.numel(),) gets every rank's ``shard`` in rank order; wait on an ``async_op`` handle."""
        self.stats.all_gather_bytes += shard.numel() * shard.element_size()
        self.stats.all_gather_calls += 1
        return self.gather_uncounted(output, shard, async_op=async_op)

    def gather_uncounted(self, output: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False) -> Waitable | None:
        """``all_gather`` without counting it in ``stats`` (checks, checkpoints)."""
        if self.world_size == 1:
            output.copy_(shard)
            return None
        exchange = self._exchange_here()
        if exchange is not None:
            return _settle(Pending(exchange.all_gather(output, shard)), async_op)  # it names the timeout itself
        form = self.forms.gather_form(self.world_size)
        output, shard = as_carried(output, self.forms), as_carried(shard, self.forms)
        if form is Gather.FLAT:
            gather = _torch_flat("all_gather_single", "all_gather_into_tensor")
            return gather(output, shard, group=self.group, async_op=async_op)
        chunks = output.view(self.world_size, -1)
        if form is Gather.LIST:
            works = Pending([dist.all_gather(list(chunks), shard.reshape(-1), group=self.group, async_op=True)])
        else:
            chunks[self.rank].copy_(shard.reshape(-1))
            works = Pending(
                [
                    dist.broadcast(chunk, src=src, group=self.group, async_op=True)
                    for chunk, src in zip(chunks, self._global_ranks)
                ],
                timeout_ms=self._timeout_ms,
            )
        return _settle(works, async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, *, async_op: bool = False) -> Waitable | None:
        """SUM-reduce ``full`` (N * output.numel(),) across ranks into this rank's slice, ``output``; with
        ``async_op``, keep ``full`` alive and wait on the returned handle (if any) before reading ``output``.
        ``full`` may be overwritten (see [Note: a large reduction in place])."""
        exchange = None
        if self.world_size > 1 and self.forms.reduce_scatter_form(full.dtype) is ReduceScatter.ALL_TO_ALL:
            exchange = self._exchange_here()
            if exchange is None:  # gloo's or MPI's all-to-all forms, which count what they send
                if full.numel() * full.element_size() >= IN_PLACE_REDUCE_BYTES and self.forms.carries(full.dtype):
                    return self._reduce_in_place(output, full, async_op)
                return self.reduce_scatter_wide(output, full, full.dtype, async_op=async_op)
        self.stats.reduce_scatter_bytes += full.numel() * full.element_size()
        self.stats.reduce_scatter_calls += 1
        if exchange is not None:
            return _settle(Pending(exchange.reduce_scatter(output, full)), async_op)
        if self.world_size == 1:
            output.copy_(full)
            return None
        scatter = _torch_flat("reduce_scatter_single", "reduce_scatter_tensor")
        return scatter(output, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def _reduce_in_place(self, output: torch.Tensor, full: torch.Tensor, async_op: bool) -> Pending | None:
        """[Note: a large reduction in place]
        Where the backend's form is an all-to-all and a local sum (gloo, MPI), the all-to-all needs a receive buffer
        as large as ``full``: a second full-size gradient alive through the reduction (192 MiB per Block at 0.84B on 2
        ranks). From ``IN_PLACE_REDUCE_BYTES`` on, ``full`` is all-reduced in place and this rank's slice copied out
        instead: twice the bytes on the wire, yet on gloo the faster of the two at these sizes (2 ranks: 29 against
        38 ms at 32 MiB, 143 against 203 ms at 192 MiB; 4 ranks: 53 against 58 ms, 106 against 115 ms at 64 MiB),
        while below it the all-to-all is (10 against 17 ms at 12 MiB). docs/decisions.md, "Host memory at scale"."""
        self.stats.reduce_scatter_bytes += full.numel() * full.element_size()
        self.stats.reduce_scatter_calls += 1
        work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        rows = full.view(self.world_size, -1)[self.rank]
        pending = Pending([work], lambda: output.copy_(rows), self._timeout_ms, keep=full)
        return _settle(pending, async_op)

    def reduce_scatter_wide(
        self, output: torch.Tensor, full: torch.Tensor, wire_dtype: torch.dtype, *, async_op: bool = False
    ) -> Pending | None:
        """``reduce_scatter`` sending ``full`` as ``wire_dtype``, summed in ``output``'s dtype (see [Note: narrow on
        the wire, wide in the sum]); ``full`` may be freed on return, the handle's ``wait()`` writes ``output``."""
        wire = full.to(wire_dtype)
        self.stats.reduce_scatter_bytes += wire.numel() * wire.element_size()
        self.stats.reduce_scatter_calls += 1
        if self.world_size == 1:
            output.copy_(full)  # nothing travels, so nothing is rounded
            return None
        received = torch.empty_like(wire)
        work = dist.all_to_all_single(
            as_carried(received, self.forms), as_carried(wire, self.forms), group=self.group, async_op=True
        )
        pending = Pending(
            [work],
            # Rank order, the same on every rank: row r is rank r's chunk of this rank's shard.
            lambda: torch.sum(received.view(self.world_size, -1), dim=0, dtype=output.dtype, out=output),
            self._timeout_ms,
            keep=wire,
        )
        return _settle(pending, async_op)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, *, async_op: bool = False
    ) -> Waitable | None:
        widen = self.world_size > 1 and not self.forms.carries(tensor.dtype)
        sent = tensor.float() if widen else tensor
        self.stats.all_reduce_bytes += sent.numel() * sent.element_size()
        self.stats.all_reduce_calls += 1
        if self.world_size == 1:
            return None
        work = dist.all_reduce(sent, op=op, group=self.group, async_op=async_op or widen)
        # A dtype the backend cannot carry travels as float32: the sum is written back, rounded once, when done.
        return _settle(Pending([work], lambda: tensor.copy_(sent)), async_op) if widen else work

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0) -> None:
        """``tensor`` of this group's rank ``src_rank`` on every rank of the group (``sync_module_states``)."""
        if self.world_size > 1:
            # The source by its global rank, which every torch release accepts (group_src is recent).
            source = dist.get_global_rank(self.group, src_rank) if self.group is not None else src_rank
            dist.broadcast(as_carried(tensor, self.forms), src=source, group=self.group)


def gather_rows(local: torch.Tensor, layout: ShardLayout, comm: Communicator) -> torch.Tensor:
    """One sharded tensor in full: this rank's rows of ``layout`` all-gathered over ``comm``'s group (every rank of it
    must call this). For checkpoints and averaged copies: not counted in ``CommStats``, which describes training."""
    padded = torch.zeros((layout.chunk_rows, layout.row_numel), dtype=local.dtype, device=local.device)
    padded[: layout.local_rows] = local.reshape(layout.local_rows, layout.row_numel)
    out = torch.empty((comm.world_size * layout.chunk_rows, layout.row_numel), dtype=local.dtype, device=local.device)
    comm.gather_uncounted(out, padded)
    return out[: layout.rows].reshape(layout.shape)


def wait_works(works: list[Waitable | None]) -> None:
    """Wait for a collective's work handles (None where it completed synchronously, e.g. on one rank)."""
    for work in works:
        if work is not None:
            work.wait()
