"""Which form of each flat collective the engine issues on each process-group backend, and which dtypes a backend
carries: the capability table ``comm.py`` reads.

[Note: the capability table]
NCCL and HCCL have the flat collectives and every dtype. gloo on CPU has them, but slow (its all-gather copies out of
a temporary, its reduce-scatter is emulated): broadcasts and all-to-all take half the time (docs/decisions.md), and
from 32 MiB on a reduction is an all-reduce in place instead (comm.py's [Note: a large reduction in place]); it
keeps its own reduce-scatter below float32, where a local float32 sum would be more exact than NCCL's. MPI has
neither flat collective (pytorch/pytorch#85628) and carries no half dtype: such tensors travel as uint8 bytes where
the collective only moves data, and an all-reduce of them runs in float32."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Gather(enum.Enum):
    FLAT = "all_gather_into_tensor"
    BROADCAST = "a broadcast per rank"
    LIST = "all_gather into the output's chunks"


class ReduceScatter(enum.Enum):
    FLAT = "reduce_scatter_tensor"
    ALL_TO_ALL = "all_to_all_single and a local sum"


BROADCAST_GATHER_MAX_RANKS = 8


@dataclass(frozen=True)
class CollectiveForms:
    """One row of the table. ``carried``: the dtypes the backend takes as they are (None: every dtype)."""

    gather: Gather = Gather.FLAT
    reduce_scatter: ReduceScatter = ReduceScatter.FLAT  # float32 / float64
    reduce_scatter_narrow: ReduceScatter = ReduceScatter.FLAT  # every other dtype
    carried: frozenset[torch.dtype] | None = None

    def gather_form(self, world_size: int) -> Gather:
        if self.gather is Gather.BROADCAST and world_size > BROADCAST_GATHER_MAX_RANKS:
            return Gather.FLAT
        return self.gather

    def reduce_scatter_form(self, dtype: torch.dtype) -> ReduceScatter:
        return self.reduce_scatter if dtype in (torch.float32, torch.float64) else self.reduce_scatter_narrow

    def carries(self, dtype: torch.dtype) -> bool:
        return self.carried is None or dtype in self.carried


FLAT = CollectiveForms()

# torch's ProcessGroupMPI datatype map (ProcessGroupMPI.cpp, mpiDatatype).
MPI_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64})

# gloo's row applies to CPU tensors only; any backend not listed, and gloo on another device, gets FLAT.
TABLE: dict[str, CollectiveForms] = {
    "gloo": CollectiveForms(Gather.BROADCAST, ReduceScatter.ALL_TO_ALL, ReduceScatter.FLAT),
    "mpi": CollectiveForms(Gather.LIST, ReduceScatter.ALL_TO_ALL, ReduceScatter.ALL_TO_ALL, MPI_DTYPES),
}


def forms_for(backend: str, device: torch.device) -> CollectiveForms:
    """The row of ``TABLE`` for a process group of ``backend`` whose collectives take tensors on ``device``."""
    if backend == "gloo" and device.type != "cpu":
        return FLAT
    return TABLE.get(backend, FLAT)


def as_carried(tensor: torch.Tensor, forms: CollectiveForms) -> torch.Tensor:
    """``tensor`` itself where the backend carries its dtype, else a view of its bytes (for collectives that only
    move data: writes into the view write ``tensor``; the first dimension keeps its length)."""
    if forms.carries(tensor.dtype):
        return tensor
    if tensor.is_complex() or not forms.carries(torch.uint8):
        carried = ", ".join(sorted(map(str, forms.carried or ())))
        raise TypeError(f"The process group's backend cannot carry {tensor.dtype} tensors; it carries {carried}.")
    return (tensor if tensor.dim() else tensor.view(1)).view(torch.uint8)
