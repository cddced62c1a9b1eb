"""Crash-safe checkpoint files: write to a temporary file, fsync, then rename it into place.

``AtomicCheckpointIO`` is a drop-in ``TorchCheckpointIO``: a process killed while saving leaves the previous file at
the path untouched (at worst a stale ``.{name}.tmp-{pid}`` file next to it), and loading a missing, misplaced or
damaged file raises an error that names the file and says what is wrong with it.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Callable
from typing import IO, Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightning_fsdp.collective import raised_alike_on_every_rank

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointIsDirectoryError",
    "CheckpointLoadError",
    "CheckpointNotFoundError",
    "temp_path_for",
]


@raised_alike_on_every_rank
class CheckpointLoadError(RuntimeError):
    """A checkpoint file could not be loaded. ``path`` is the file; ``__cause__`` is the underlying error."""

    def __init__(self, message: str, path: _PATH) -> None:
        super().__init__(message)
        self.path = path


@raised_alike_on_every_rank
class CheckpointNotFoundError(CheckpointLoadError, FileNotFoundError):
    """The checkpoint path does not exist (also a ``FileNotFoundError``)."""


@raised_alike_on_every_rank
class CheckpointIsDirectoryError(CheckpointLoadError, IsADirectoryError):
    """The checkpoint path is a directory, not a full-checkpoint file (also an ``IsADirectoryError``)."""


def temp_path_for(path: _PATH, pid: int | None = None) -> str:
    """The temporary file a save to ``path`` writes first: ``.{basename}.tmp-{pid}`` in the same directory."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp-{os.getpid() if pid is None else pid}")


def fsync_path(path: str) -> None:
    """Make a file's data, or a directory's entries (a rename into it), durable; best effort where the platform
    cannot open or fsync it (directories on some systems)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_dir(folder: str) -> None:
    fsync_path(folder or ".")


def is_local_path(path: _PATH) -> bool:
    return type(get_filesystem(path)).__name__ == "LocalFileSystem"


def _describe_damage(path: str) -> str:
    """Why a file that exists could not be read by ``torch.load``, as far as the file itself tells."""
    size = os.path.getsize(path)
    if size == 0:
        return "the file is empty (0 bytes)"
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            return (
                f"the file ({size} bytes) is truncated or corrupt: it is not a complete PyTorch zip archive "
                f"({exc}); it was probably written by a save that did not finish"
            )
        return f"the file ({size} bytes) is a PyTorch zip archive, but its contents could not be read"
    if head[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"):
        return f"the file ({size} bytes) is a legacy pickle checkpoint that could not be read (truncated or corrupt?)"
    return f"the file ({size} bytes) is not a PyTorch checkpoint (it does not start like a zip archive or a pickle)"


def _container_intact(path: str) -> bool:
    """Whether the file is a complete zip archive or starts like a pickle: then a refusal by the weights-only
    unpickler is about an object in it, not about damage (torch reports garbage bytes as a refused object too)."""
    with open(path, "rb") as f:
        head = f.read(2)
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                return archive.testzip() is None
        except (zipfile.BadZipFile, OSError, EOFError):
            return False
    return head in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic and whose load errors name the file and the problem.

    A save writes ``torch.save`` output to ``.{basename}.tmp-{pid}`` in the target's directory, flushes and fsyncs
    it, renames it onto the target with ``os.replace`` (atomic for a rename within one directory) and fsyncs the
    directory. On any exception the temporary file is removed and the previous checkpoint is left as it was.
    Non-local paths (``s3://`` and other fsspec URLs) are handed to ``TorchCheckpointIO`` unchanged.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{self.__class__.__name__}`. Please implement your custom `CheckpointIO`"
                " to define how you'd like to use `storage_options`."
            )
        if not is_local_path(path):
            return super().save_checkpoint(checkpoint, path)
        path = os.path.abspath(os.fspath(path))
        if os.path.isdir(path):
            raise IsADirectoryError(f"Cannot save a full checkpoint to {path!r}: it is an existing directory.")
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = temp_path_for(path)
        try:
            with open(tmp, "wb") as f:
                self._write(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
            raise
        fsync_dir(folder)

    def _write(self, checkpoint: dict[str, Any], f: IO[bytes]) -> None:
        """Serialise ``checkpoint`` into the open temporary file (a seam for tests and subclasses)."""
        torch.save(checkpoint, f)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if not is_local_path(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        path = os.fspath(path)
        if not os.path.exists(path):
            parent = os.path.dirname(os.path.abspath(path))
            hint = "" if os.path.isdir(parent) else f" (its directory {parent!r} does not exist either)"
            raise CheckpointNotFoundError(f"Checkpoint file not found: {path!r}{hint}.", path)
        if os.path.isdir(path):
            raise CheckpointIsDirectoryError(
                f"Checkpoint path {path!r} is a directory, but a full checkpoint is a single file. Pass the "
                "checkpoint file itself (a directory would be a sharded or local checkpoint, which "
                f"{type(self).__name__} does not read).",
                path,
            )
        try:
            with open(path, "rb") as f:
                checkpoint = torch.load(f, map_location=map_location, weights_only=weights_only)
        except Exception as exc:  # noqa: BLE001 - re-raised with the file named; the original is kept as __cause__
            if (
                isinstance(exc, pickle.UnpicklingError)
                and "weights_only" in str(exc).lower().replace(" ", "_")
                and _container_intact(path)
            ):
                problem = (
                    "torch.load(weights_only=True) refused an object in it; load it with weights_only=False "
                    "if you trust the file"
                )
            else:
                problem = _describe_damage(path)
            raise CheckpointLoadError(
                f"Could not load checkpoint {path!r}: {problem}. Underlying error: {type(exc).__name__}: {exc}",
                path,
            ) from exc
        if not isinstance(checkpoint, dict):
            raise CheckpointLoadError(
                f"Could not load checkpoint {path!r}: it holds a {type(checkpoint).__name__}, not a checkpoint dict; "
                "the file is corrupt or is not a Lightning checkpoint.",
                path,
            )
        return checkpoint
