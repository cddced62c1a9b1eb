"""Gradient clipping by the global norm over every shard (and pipeline stage): the norm an unsharded run computes.

[Note: the global gradient norm]
Each rank sums its shards' per-tensor norms to the p-th power (the maximum for inf) in float32, one all-reduce
combines the ranks, and the parameters every rank holds whole count once. Under tensor parallelism the pieces of
TP-split parameters are first summed over the TP ranks (one more all-reduce), TP-replicated ones count once. Not
torch's ``get_total_norm``: it rounds each rank's term to the gradients' dtype and its inf norm refuses an empty
shard (docs/decisions.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp.engine.comm import Communicator
from lightning_fsdp.engine.diagnostics import TAG_CLIP
from lightning_fsdp.engine.tensor_parallel import SplitPieces


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float,
    *,
    shard_comm: Communicator,
    is_sharded: Callable[[nn.Parameter], bool],
    device: torch.device,
    stage_group: dist.ProcessGroup | None = None,
    tensor_parallel: SplitPieces | None = None,
) -> torch.Tensor:
    """Clip gradients by the global norm over all shards; call on every rank of ``shard_comm``. ``is_sharded``: a
    shard, not a whole parameter; ``stage_group``: the other pipeline stages, so all clip by the whole model's norm;
    ``tensor_parallel``: the TP group, over which the pieces of TP-split parameters count on every rank (a
    TP-replicated parameter counts once)."""
    norm_type = float(norm_type)
    with_grads = [(p, grad) for p in parameters if (grad := p.grad) is not None]
    params = [p for p, _grad in with_grads]
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM

    def term(sharded: bool, split: bool) -> torch.Tensor:
        is_split = tensor_parallel.is_split if tensor_parallel is not None else lambda _p: False
        grads = [g for p, g in with_grads if is_sharded(p) == sharded and is_split(p) == split]
        return _norm_term(grads, norm_type, device)

    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b) if inf else a + b

    local, whole = term(True, False), term(False, False)
    if tensor_parallel is not None:
        # TP-split pieces: summed over the TP ranks first (one all-reduce for both kinds).
        split = torch.stack([term(True, True), term(False, True)])
        _all_reduce_on(split, tensor_parallel.group, op)
        local, whole = combine(local, split[0]), combine(whole, split[1])
    shard_comm.check_same_collective(TAG_CLIP)
    shard_comm.all_reduce(local, op=op)
    total = combine(local, whole)
    if stage_group is not None:
        _all_reduce_on(total, stage_group, op)
    if not inf:
        total = total ** (1.0 / norm_type)
    # torch's own scaling by a given total norm groups the gradients by device and dtype: with cpu_offload the
    # sharded ones live in host memory, the replicated ones (ignored parameters) and the norm on the accelerator.
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _all_reduce_on(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType) -> None:
    """In place, on ``group``; through host memory where the group is gloo's and the tensor is not."""
    if dist.get_backend(group) == "gloo" and tensor.device.type != "cpu":
        host = tensor.cpu()
        dist.all_reduce(host, op=op, group=group)
        tensor.copy_(host)
    else:
        dist.all_reduce(tensor, op=op, group=group)


def _norm_term(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's term of the total ``norm_type``-norm of ``grads`` (float32, on ``device``; zero for none)."""
    if math.isinf(norm_type):
        grads = [g for g in grads if g.numel()]  # an empty shard adds nothing, and torch's inf norm refuses one
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([n.float() for n in torch._foreach_norm(grads, norm_type)])
    term = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
    return term.to(device)
