"""Writing the shards through DCP without the work its writer does that no reader of these files uses.

- **The clone of views.** torch's ``FileSystemWriter`` clones every CPU tensor whose storage is larger than the
  tensor (so that ``torch.save`` does not write the whole storage), and keeps each clone until the rank's file is
  closed. Every sharded parameter here is a view into its unit's flat shard buffer, so a save cloned the whole
  parameter shard: at 0.84B parameters on 2 ranks, 3.3 s of a 10.7 s save and 1.5 GiB of extra memory per rank
  (docs/benchmarks.md, "Checkpoint save and load at 0.84B"). :func:`exact_storage` gives such a view a storage of
  its own over the same memory (through numpy, which wraps a pointer without copying), which DCP writes as it is.
- **The CRC-32 of every record.** ``torch.save`` computes a CRC-32 of each tensor's bytes for its zip record (3.3
  GB/s on one core here: 1.4 s per rank at 0.84B). ``torch.load``, which every reader of a sharded checkpoint goes
  through (DCP, this package's loader, ``convert``, Lightning's ``consolidate_checkpoint``), never checks it, and a
  ``.distcp`` file is a concatenation of records that zip tools cannot open; :func:`without_crc32` turns it off
  (torch's own switch, ``torch.serialization.set_crc32_options``) for the save only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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


_CRC32_LOCK = threading.Lock()  # a save in the background (async_checkpoint) and one on the training thread


@contextmanager
def without_crc32() -> Iterator[None]:
    """``torch.save`` without the CRC-32 of each record while the block runs (process-wide: torch has one switch),
    then the previous setting back."""
    with _CRC32_LOCK:
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(before)
