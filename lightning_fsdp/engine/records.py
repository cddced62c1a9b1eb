"""The states of the engine and its units (torch FSDP2's ``_fsdp_common``), and the collectives in flight.

[Note: a unit's states]
``ShardedState``: where the parameters are; ``UnitStepState``: the calls this step, which decide when to reduce. The
controls' state outlives a step ([Note: engine controls]): ``kept``, the secondary shard (dropped by any reshard but
the next unshard's, as the shards may have changed) and held gradients (``ParamSlot.unsynced_grad``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum, auto
from typing import NamedTuple

import torch
from torch import nn

from lightning_fsdp.engine.comm import Communicator, Waitable
from lightning_fsdp.engine.layout import ShardLayout
from lightning_fsdp.engine.tensor_parallel import TensorParallelSpec
from lightning_fsdp.engine.wrap import ParamUse


class TrainingState(Enum):
    """What the engine is doing (see [Note: the engine's training state])."""

    IDLE = auto()  # between steps: no unit forward open, no backward in flight
    FORWARD = auto()  # some unit's forward is open, no backward in flight
    BACKWARD = auto()  # a backward reached a unit; ends when ``_finish_backward`` has run


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
    """A unit's calls this step; an untracked call (no input needs a gradient) leaves reducing to backward's end."""

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
        """Count one signalled end of backward; True when the unit can be reduced: every tracked call's backward
        ended, no call was untracked, and the reduction was not issued yet."""
        self.backward_calls += 1
        return self.backward_calls == self.forward_calls and not self.untracked_calls and not self.reduced


@dataclass(eq=False)
class ParamSlot:
    """One managed parameter: the user's Parameter object (holds the local shard) and where modules use it."""

    fqn: str
    param: nn.Parameter
    uses: list[ParamUse]
    layout: ShardLayout  # of the local tensor for a DTensor parameter: the rows its TP piece is split into
    # A DTensor parameter's place on the tensor-parallel mesh (see [Note: tensor parallelism composed with sharding]).
    tensor_parallel: TensorParallelSpec | None = None
    offset: int = 0  # element offset of this parameter's padded chunk in the flat shard buffer
    # The full-size stand-in the modules hold while unsharded: given by the unit when it builds its buffers.
    full: nn.Parameter = field(init=False)
    # Trainable in a forward of this step: its gradient may arrive though frozen since, so the reduction keeps it.
    in_graph: bool = False
    # What the engine last gave ``full``: a difference at the next sync is the user's flip through the module.
    synced_requires_grad: bool = True
    # Gradient sync off: the full-size gradient of the backwards since the last reduction (``FlatUnit.hold_grads``).
    unsynced_grad: torch.Tensor | None = None

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad

    @property
    def unsplit_shape(self) -> torch.Size:
        """The unsplit model's shape (a DTensor parameter's global shape): what full checkpoints hold."""
        return self.tensor_parallel.shape if self.tensor_parallel is not None else self.layout.shape

    def rows_of_unsplit(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor of ``unsplit_shape``: of its TP piece for a DTensor parameter."""
        piece = self.tensor_parallel.local_piece(full) if self.tensor_parallel is not None else full
        return self.layout.local_slice(piece)

    def take_full_grad(self) -> torch.Tensor | None:
        """The stand-in's gradient, taken from it: a plain tensor of the local shape (a DTensor one redistributed to
        the parameter's TP placements first, see ``TensorParallelSpec.local_grad``)."""
        grad, self.full.grad = self.full.grad, None
        if grad is not None and self.tensor_parallel is not None:
            grad = self.tensor_parallel.local_grad(grad)
        return grad


class ReducePlan(NamedTuple):
    """The parameters one gradient reduction carries and where each lands: one plan per set of trainable parameters,
    as ``requires_grad`` may change at any time (every rank freezes alike, so the plans match)."""

    slots: list[ParamSlot]
    offsets: list[int]  # element offset of each parameter's padded chunk in the reduction's output
    numel: int  # gradient elements per rank, padding included, before the used-flags
    direct: list[int]  # indices into ``slots`` reduced on their own, in place (large, rows split evenly)
    staged: list[int]  # indices packed through the padded rank-major copy

    @classmethod
    def of(cls, slots: list[ParamSlot], direct: list[int], staged: list[int]) -> ReducePlan:
        """The plan reducing ``slots``, each padded chunk after the previous one."""
        offsets, numel = [], 0
        for slot in slots:
            offsets.append(numel)
            numel += slot.layout.padded_numel
        return cls(slots, offsets, numel, direct, staged)


class PendingGather(NamedTuple):
    """An unshard's all-gathers in flight (see ``FlatUnit.start_unshard``)."""

    works: list[Waitable | None]
    inputs: list[torch.Tensor]  # kept alive until the collectives complete
    staged_out: torch.Tensor | None  # the staging buffer's output, copied into the full buffer when done
    ranks: int  # the ranks gathered over: the shard group's, or a secondary group's (each sent 1/ranks of the unit)
    # Recorded on the all-gather stream after the collectives; None on CPU.
    event: torch.Event | None = None


class SecondaryShard(NamedTuple):
    """This rank's part of the full parameters for an all-gather over ``comm`` (hpZ): per parameter, the padded
    chunks of the ``world_size / comm.world_size`` consecutive shard-group ranks whose rows it keeps."""

    comm: Communicator
    buffer: torch.Tensor


class PendingReduce(NamedTuple):
    """A gradient reduction in flight (see ``FlatUnit.reduce_grads``)."""

    works: list[Waitable | None]
    output: torch.Tensor  # this rank's reduced gradients, then one used-flag per parameter
    inputs: list[torch.Tensor]  # kept alive until the collectives complete
    staged_out: torch.Tensor | None  # the packed collective's output, copied into ``output`` when done
    pre_divide: bool
    ranks: int
    plan: ReducePlan
    # On an accelerator: the event after the post-reduce work, and what ``_post_reduce`` returned. None on CPU.
    event: torch.Event | None = None
    result: tuple[torch.Tensor, torch.Tensor] | None = None
