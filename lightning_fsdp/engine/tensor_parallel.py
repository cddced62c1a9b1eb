"""DTensor parameters: torch's tensor parallelism (``parallelize_module``) inside the engine's units.

[Note: tensor parallelism composed with sharding]
As torch's FSDP2 composes with TP (``_fsdp_param.py``: ``_init_sharding_spec_tp``, ``init_unsharded_param``,
``_get_grad_inner_tensor``): a parameter ``parallelize_module`` placed on the tensor-parallel mesh is a DTensor whose
LOCAL tensor is this TP rank's piece. The engine shards that local tensor over the data-parallel group by rows, exactly
as it shards a plain parameter (``layout.py``), and the optimizer steps plain tensors: the user's module holds a plain
``nn.Parameter`` of this rank's rows. When the unit is unsharded the module gets a DTensor stand-in over the unit's
full buffer, with the parameter's TP placements, built without autograd (``TensorParallelSpec.dtensor``), so that
TP's own collectives run inside DTensor ops and the gradient lands as a DTensor on the stand-in. Before the
data-parallel reduce-scatter that gradient is redistributed to the parameter's placements where it differs (a
``Partial`` gradient of a TP-replicated parameter under sequence parallelism: the all-reduce over TP happens there),
and only its local tensor is reduced, over data-parallel ranks only."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True, eq=False)
class TensorParallelSpec:
    """Where a DTensor parameter lives on the tensor-parallel mesh: its 1-D mesh, placements and global shape."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size  # the unsplit parameter's
    stride: tuple[int, ...]

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def is_split(self) -> bool:
        """Whether each TP rank holds a different piece (a ``Shard`` placement): its gradient norm counts on every TP
        rank; a replicated parameter's counts once."""
        return any(not isinstance(p, Replicate) for p in self.placements)

    def dtensor(self, local: torch.Tensor) -> DTensor:
        """A DTensor over ``local`` itself (same storage, no autograd edge to it), in ``local``'s dtype."""
        meta = TensorMeta(self.shape, self.stride, local.dtype)
        return DTensor(local, DTensorSpec(self.mesh, self.placements, tensor_meta=meta), requires_grad=False)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The stand-in's gradient as this TP rank's local tensor of the parameter's placements (a collective over TP
        where the placements differ: every TP rank calls it for the same parameters in the same order)."""
        if isinstance(grad, DTensor):
            if tuple(grad.placements) != self.placements:
                grad = grad.redistribute(self.mesh, self.placements)
            grad = grad.to_local()
        if isinstance(grad, AsyncCollectiveTensor):
            grad = grad.wait()
        return grad

    def full_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """The unsplit value from every TP rank's ``local`` piece (a collective over TP)."""
        return self.dtensor(local).full_tensor()

    def local_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's piece of the unsplit ``full`` value (no collective)."""
        spec = DTensorSpec(self.mesh, self.placements, tensor_meta=TensorMeta(self.shape, self.stride, full.dtype))
        return (
            DTensor.from_local(full, self.mesh, [Replicate()], run_check=False)
            .redistribute(spec.mesh, spec.placements)
            .to_local()
        )

    def piece_region(self) -> tuple[slice, ...]:
        """Where this TP rank's piece lies in the unsplit tensor, one slice per dim (no collective): what a loader
        reads of an unsplit file (``pretrained.py``). torch's own rule (DTensor's local shape and global offset)."""
        local_shape, offset = compute_local_shape_and_global_offset(self.shape, self.mesh, self.placements)
        return tuple(slice(start, start + size) for start, size in zip(offset, local_shape, strict=True))

    def parameter(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """A DTensor parameter as ``parallelize_module`` makes, holding ``local`` (the module's own after a stage)."""
        value = DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )
        return nn.Parameter(value, requires_grad=requires_grad)


def tensor_parallel_spec(param: torch.Tensor, fqn: str) -> TensorParallelSpec | None:
    """The spec of a DTensor parameter (None for a plain one); refuses what the engine cannot compose with."""
    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"Parameter {fqn!r} is a DTensor on a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; the engine shards over "
            "data-parallel ranks itself and composes with a 1-D tensor-parallel mesh only. Parallelize the model "
            "on the tensor-parallel sub-mesh (device_mesh['tensor_parallel'])."
        )
    return TensorParallelSpec(mesh, tuple(param.placements), param.shape, tuple(param.stride()))


def local_parameter(param: nn.Parameter) -> nn.Parameter:
    """A plain parameter holding a DTensor parameter's local tensor (what the optimizer will step)."""
    assert isinstance(param, DTensor)
    with torch.no_grad():
        local = param.to_local()
    return nn.Parameter(local.detach(), requires_grad=param.requires_grad)


class SplitPieces(NamedTuple):
    """What gradient clipping needs to know of a model's tensor parallelism."""

    group: dist.ProcessGroup  # the TP ranks
    is_split: Callable[[nn.Parameter], bool]  # whether a managed parameter holds a piece of a TP-split one


def split_pieces(specs: Mapping[int, TensorParallelSpec | None]) -> SplitPieces | None:
    """From the managed parameters' specs (by parameter id): the one TP group they all live on and which of them are
    TP-split; None without tensor parallelism."""
    groups = {id(g): g for g in (s.group for s in specs.values() if s is not None)}
    if len(groups) > 1:
        raise ValueError(
            "The model's DTensor parameters live on several tensor-parallel groups; parallelize every module on "
            "the same tensor-parallel mesh (device_mesh['tensor_parallel'])."
        )
    if not groups:
        return None
    split = {pid for pid, s in specs.items() if s is not None and s.is_split}
    return SplitPieces(next(iter(groups.values())), lambda p: id(p) in split)


def stand_in(spec: TensorParallelSpec | None, full_view: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """The full-size parameter the modules hold while a unit is unsharded, viewing ``full_view`` (refilled by each
    unshard): a DTensor with the TP placements for a DTensor parameter."""
    if spec is not None:
        return nn.Parameter(spec.dtensor(full_view), requires_grad=requires_grad)
    full = nn.Parameter(full_view.new_empty(0), requires_grad=requires_grad)
    full.data = full_view
    return full
