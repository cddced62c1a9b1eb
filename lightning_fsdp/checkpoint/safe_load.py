"""Reading a sharded checkpoint's files without running code they hold (docs/checkpoints.md, "Loading checkpoints
you did not write"): ``.metadata`` through :class:`MetadataUnpickler` (DCP's metadata classes only; see
docs/decisions.md), storage paths confined to the directory, and non-tensor ``.distcp`` entries read with the
caller's ``weights_only`` (torch's own planner uses ``weights_only=False``)."""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pathlib
import pickle
import warnings
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_fsdp.checkpoint.atomic_io import (
    PICKLE_HEADS,
    CheckpointLoadError,
    UntrustedCheckpointError,
    file_head,
    refusal_error,
    refused_by_weights_only,
    refused_global,
)
from lightning_fsdp.checkpoint.paths import DCP_METADATA_FILE, file_problem
from lightning_fsdp.collective import Collective

__all__ = [
    "MetadataUnpickler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "check_shard_files",
    "confine_storage",
    "dcp_load",
    "metadata_globals",
    "read_dcp_metadata",
    "restricted",
]

_TRUE = ("1", "y", "yes", "true")


def restricted(weights_only: bool | None) -> bool:
    """Whether a read is restricted: ``weights_only`` True, or None (unset) where ``torch.load``'s default is
    weights-only (it is, unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set); ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
    restricts every read, as it does ``torch.load``'s."""
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        return True
    if weights_only is None:
        return os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in _TRUE
    return bool(weights_only)


@contextlib.contextmanager
def alone_on_purpose(coll: Collective) -> Iterator[None]:
    """Without a process group DCP warns "torch.distributed is disabled ..."; here that is on purpose."""
    with warnings.catch_warnings():
        if not coll.distributed:
            warnings.simplefilter("ignore", UserWarning)
        yield


@lru_cache(maxsize=1)
def metadata_globals() -> dict[str, object]:
    """Everything a DCP ``.metadata`` pickle names, by the name it is pickled under: the metadata dataclasses, the
    per-file storage record, ``torch.Size``, dtypes, layouts (by name), memory formats (an enum) and the path of the
    checkpoint (``StorageMeta.checkpoint_id``). Each is data: building one runs no code of the file's choosing."""
    from torch.distributed.checkpoint import filesystem, metadata

    objects: list[type] = [
        metadata.Metadata,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        torch.Size,
        collections.OrderedDict,
    ]
    names: dict[str, object] = {f"{obj.__module__}.{obj.__qualname__}": obj for obj in objects}
    names["torch.serialization._get_layout"] = torch.serialization._get_layout  # a lookup of torch.strided etc.
    names.update({str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)})  # "torch.float32"
    for cls in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath, pathlib.WindowsPath):
        # Pickled under "pathlib" before Python 3.13 and "pathlib._local" since.
        names[f"pathlib.{cls.__name__}"] = names[f"pathlib._local.{cls.__name__}"] = cls
    return names


class RefusedGlobalError(pickle.UnpicklingError):
    """:class:`MetadataUnpickler` refused to look up a global; ``name`` is its dotted name."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"GLOBAL {name} is not one of the classes DCP's checkpoint metadata is made of, nor allowed with "
            "torch.serialization.add_safe_globals."
        )
        self.name = name


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that looks up only :func:`metadata_globals` and the globals the user allowed with
    ``torch.serialization.add_safe_globals``; any other global (``os.system``, ``builtins.eval``, ...) is refused
    before it is looked up, so nothing in the file runs. Persistent ids are refused by ``pickle.Unpickler`` itself."""

    def find_class(self, module: str, name: str) -> object:
        full = f"{module}.{name}"
        allowed = metadata_globals().get(full)
        if allowed is None:
            allowed = _user_safe_globals().get(full)
        if allowed is None:
            raise RefusedGlobalError(full)
        return allowed


def _user_safe_globals() -> dict[str, object]:
    out: dict[str, object] = {}
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        out[name] = obj
    return out


def confine_storage(path: str, metadata: Metadata) -> None:
    """Every storage record of ``metadata`` names a file inside the directory ``path`` (a relative path that does not
    climb out of it) and a non-negative byte range; otherwise raise naming ``.metadata`` and the path it names."""
    file = os.path.join(path, DCP_METADATA_FILE)
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        raise CheckpointLoadError(
            f"Could not read sharded checkpoint {path!r}: its metadata {file!r} has no storage records (it holds a "
            f"{type(storage).__name__}); it is not the metadata of a complete save.",
            file,
        )
    for index, info in storage.items():
        relative = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        where = getattr(index, "fqn", index)
        if not isinstance(relative, str) or not _inside(relative):
            raise CheckpointLoadError(
                f"Refused sharded checkpoint {path!r}: its metadata {file!r} stores {where!r} in {relative!r}, which "
                "is not a file inside the checkpoint directory; a checkpoint names only files of its own.",
                file,
            )
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            raise CheckpointLoadError(
                f"Could not read sharded checkpoint {path!r}: its metadata {file!r} stores {where!r} at offset "
                f"{offset!r} length {length!r} of {relative!r}, which is no byte range; the metadata is corrupt.",
                file,
            )


def _inside(relative: str) -> bool:
    if not relative or "\0" in relative or os.path.isabs(relative) or pathlib.PureWindowsPath(relative).anchor:
        return False
    normal = os.path.normpath(relative)
    return normal not in (".", os.pardir) and not normal.startswith(os.pardir + os.sep)


def read_dcp_metadata(path: str, weights_only: bool | None = None) -> Metadata:
    """The directory's DCP metadata, unpickled by :class:`MetadataUnpickler` unless ``weights_only`` is False, its
    storage paths confined to the directory. A refused object, a damaged file and a stray path each raise naming
    ``.metadata``."""
    file = os.path.join(path, DCP_METADATA_FILE)
    try:
        with open(file, "rb") as f:  # unrestricted: the caller trusts the file by name
            metadata = MetadataUnpickler(f).load() if restricted(weights_only) else pickle.load(f)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the file
        if isinstance(exc, RefusedGlobalError) and file_head(file) in PICKLE_HEADS:
            words = f"Unsupported global: GLOBAL {exc.name} is not part of DCP's checkpoint metadata."
            raise refusal_error(file, words, "the restricted unpickler of DCP metadata") from exc
        problem = file_problem(file) or "it is truncated or corrupt"
        raise CheckpointLoadError(
            f"Could not read sharded checkpoint {path!r}: {problem} ({DCP_METADATA_FILE!r}, "
            f"{type(exc).__name__}: {exc}).",
            file,
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointLoadError(
            f"Could not read sharded checkpoint {path!r}: {DCP_METADATA_FILE!r} holds a {type(metadata).__name__}, "
            "not DCP metadata; it is truncated or corrupt.",
            file,
        )
    confine_storage(path, metadata)
    return metadata


def check_shard_files(path: str, metadata: Metadata) -> None:
    """Every file the metadata refers to exists and is long enough (a missing or truncated shard names its file)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        file = os.path.join(path, relative)
        problem = file_problem(file, size)
        if problem is not None:
            raise CheckpointLoadError(
                f"Sharded checkpoint {path!r} is damaged: {problem}. Every rank's shard file is needed to load it.",
                file,
            )


class _RecordingFileSystem(FileSystem):
    """DCP's local file system, remembering the last file it opened (the one a failing read was reading)."""

    opened: str | None = None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        self.opened = os.fspath(path)
        with super().create_stream(path, mode) as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata`` with :func:`read_dcp_metadata` (restricted unless
    ``weights_only`` is False, storage confined to the directory) instead of ``pickle.load``, and reports a refusal
    while reading a ``.distcp`` file naming that file."""

    def __init__(self, path: str, weights_only: bool | None) -> None:
        super().__init__(path)
        self.fs = self._recording = _RecordingFileSystem()
        self.weights_only = weights_only

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # torch's signature
        metadata = read_dcp_metadata(os.fspath(self.path), self.weights_only)
        storage_meta = metadata.storage_meta
        if storage_meta is None:  # what FileSystemReader.read_metadata does after reading
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except pickle.UnpicklingError as exc:
            words = refused_by_weights_only(exc)
            file = self._recording.opened or os.fspath(self.path)
            if words is None or refused_global(words) is None:  # damage, not a refused object: _read_failure says
                raise
            raise refusal_error(file, words) from exc


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (no flattening) whose non-tensor entries are read with ``torch.load(weights_only=...)``
    as the caller chose (torch's own uses ``weights_only=False``)."""

    def __init__(self, weights_only: bool | None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.weights_only = restricted(weights_only)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=self.weights_only)


def dcp_load(targets: STATE_DICT_TYPE, path: str, coll: Collective, weights_only: bool | None = None) -> None:
    """Fill ``targets`` (DCP's flat keys -> a tensor or DTensor to read into, or None for a non-tensor entry, which
    is replaced by the stored object) from the directory; a plain tensor receives the whole stored tensor. Reads are
    restricted unless ``weights_only`` is False; a refused object raises :class:`UntrustedCheckpointError` naming its
    file on every rank."""
    if not targets:
        return
    reader = SafeFileSystemReader(path, weights_only)
    planner = SafeLoadPlanner(weights_only)
    try:
        with alone_on_purpose(coll):
            dcp.load(
                targets, storage_reader=reader, planner=planner, process_group=coll.group, no_dist=not coll.distributed
            )
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises the same one on every rank
        refused = _refusal(exc, coll.rank)
        if refused is not None:
            raise refused from exc
        raise CheckpointLoadError(
            f"Could not read sharded checkpoint {path!r}: a shard file could not be read (truncated or corrupt?). "
            f"Underlying error: {_read_failure(exc)}",
            path,
        ) from exc


def _failures(exc: BaseException) -> dict[int, BaseException]:
    """Each failing rank's exception of a DCP read (``CheckpointException`` keeps (exception, traceback) pairs)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(exc, CheckpointException) or not isinstance(failures, Mapping):
        return {}
    return {rank: f[0] if isinstance(f, tuple) else f for rank, f in failures.items()}


def _refusal(exc: BaseException, rank: int) -> UntrustedCheckpointError | None:
    """This rank's refusal, else another rank's (marked with its rank), else None."""
    if isinstance(exc, UntrustedCheckpointError):
        return exc
    refused = {r: e for r, e in _failures(exc).items() if isinstance(e, UntrustedCheckpointError)}
    if rank in refused:
        return UntrustedCheckpointError(str(refused[rank]), refused[rank].path)
    for other, error in sorted(refused.items()):
        return UntrustedCheckpointError(f"{error} [raised on rank {other}]", error.path)
    return None


def _read_failure(exc: BaseException) -> str:
    """What went wrong in a DCP read, short. ``CheckpointException`` (a ``BaseException``, so ``except Exception``
    does not see it) carries each failing rank's exception; its own text is only the list of ranks."""
    failures = _failures(exc)
    if not failures:
        return f"{type(exc).__name__}: {exc}"
    parts = []
    for rank, error in sorted(failures.items()):
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if isinstance(error, pickle.UnpicklingError):  # torch's text would suggest weights_only=False
            text = "the stored bytes are not a serialized tensor (the shard data is corrupt)"
        parts.append(f"rank {rank}: {type(error).__name__}: {text[:300]}")
    return "; ".join(parts)
