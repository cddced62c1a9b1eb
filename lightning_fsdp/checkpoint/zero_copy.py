"""Handing DCP the shards without the copy its writer makes of views.

torch's ``FileSystemWriter`` clones every CPU tensor whose storage is larger than the tensor (so that ``torch.save``
does not write the whole storage), and keeps each clone until the rank's file is closed. Every sharded parameter
here is a view into its unit's flat shard buffer, so a save cloned the whole parameter shard: at 0.84B parameters
on 2 ranks, 3.3 s of a 10.7 s save and 1.2 GiB of extra memory per rank (docs/benchmarks.md, "Checkpoint save: where
the time goes"). :func:`exact_storage` gives such a view a storage of its own over the same memory (through
numpy, which wraps a pointer without copying), which DCP writes as it is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch
from torch.distributed.tensor import DTensor

_T = TypeVar("_T")


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or where it is a contiguous CPU view into a larger storage, an alias of the same memory
    whose storage is exactly its bytes. The alias keeps ``tensor``'s storage alive (numpy holds a reference)."""
    if (
        tensor.device.type != "cpu"
        or tensor.numel() == 0
        or tensor.untyped_storage().nbytes() == tensor.nbytes
        or not tensor.is_contiguous()
        or tensor.is_conj()
        or tensor.is_neg()
        or type(tensor) not in (torch.Tensor, torch.nn.Parameter)
    ):
        return tensor
    raw = tensor.detach().reshape(-1).view(torch.uint8)  # any dtype, as bytes numpy understands
    return torch.from_numpy(raw.numpy()).view(tensor.dtype).view(tensor.shape)


def _exact_value(value: object) -> object:
    if isinstance(value, DTensor):
        local = value.to_local()
        exact = exact_storage(local)
        if exact is local:
            return value
        return DTensor.from_local(
            exact, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    if isinstance(value, torch.Tensor):
        return exact_storage(value)
    if isinstance(value, Mapping):  # DCP reads any mapping as a dict
        return {k: _exact_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_exact_value(v) for v in value]
    return value


def with_exact_storages(state: _T) -> _T:
    """A copy of the nested mappings (as dicts) and lists of ``state``, not of the tensors, in which every view
    tensor is replaced by :func:`exact_storage`'s alias; other values are the same objects."""
    return _exact_value(state)  # type: ignore[return-value]
