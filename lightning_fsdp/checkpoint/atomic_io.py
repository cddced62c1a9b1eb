"""Crash-safe checkpoint files (write to a temporary file, fsync, rename into place), and load errors that name the
file and say what is wrong with it."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Callable
from typing import IO

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightning_fsdp.checkpoint import Checkpoint
from lightning_fsdp.collective import raised_alike_on_every_rank

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointIsDirectoryError",
    "CheckpointLoadError",
    "CheckpointNotFoundError",
    "UntrustedCheckpointError",
    "temp_path_for",
]

# How a user who trusts a refused file opts in, by name (every refusal ends with it).
TRUST_HINT = (
    "Nothing in the file was run. If you trust the file and where it came from, allow it by name: "
    "weights_only=False when resuming or loading (trainer.fit/validate/test/predict(..., weights_only=False)), "
    "--trust-pickled-code for `lightning-fsdp convert` and `export` (trust_pickled_code=True from Python); "
    "or allow just that class with torch.serialization.add_safe_globals([...]) and keep the rest restricted"
)


@raised_alike_on_every_rank
class CheckpointLoadError(RuntimeError):
    """A checkpoint file could not be loaded. ``path`` is the file; ``__cause__`` is the underlying error."""

    def __init__(self, message: str, path: _PATH) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[type[CheckpointLoadError], tuple[str, _PATH]]:
        # Picklable with its path: torch.distributed.checkpoint sends a rank's read error to the others.
        return type(self), (str(self), self.path)


@raised_alike_on_every_rank
class UntrustedCheckpointError(CheckpointLoadError):
    """A checkpoint file holds an object the restricted unpickler refused (it would run code, or is of a class not
    allowed); nothing in the file was run. ``path`` is the file."""


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


def is_local_path(path: _PATH) -> bool:
    return type(get_filesystem(path)).__name__ == "LocalFileSystem"


PICKLE_HEADS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # protocols 2 to 5


def file_head(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(2)  # "PK" for a zip archive, one of PICKLE_HEADS for a pickle


def _inspect(path: str, check_members: bool) -> tuple[bool, str]:
    """Why a file that exists could not be read by ``torch.load``, as far as the file itself tells, and whether it is
    intact: a complete zip archive (``check_members``: every member's checksum too) or a pickle's start. A refusal by
    the weights-only unpickler of an intact file is about an object in it, not about damage (torch reports garbage
    bytes as a refused object too)."""
    size = os.path.getsize(path)
    if size == 0:
        return False, "the file is empty (0 bytes)"
    head, file = file_head(path), f"the file ({size} bytes)"
    if head == b"PK":
        try:
            with zipfile.ZipFile(path) as archive:
                intact = not check_members or archive.testzip() is None
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            return False, (
                f"{file} is truncated or corrupt: it is not a complete PyTorch zip archive ({exc}); it was probably "
                "written by a save that did not finish"
            )
        return intact, f"{file} is a PyTorch zip archive, but its contents could not be read"
    if head in PICKLE_HEADS:
        return True, f"{file} is a legacy pickle checkpoint that could not be read (truncated or corrupt?)"
    return False, f"{file} is not a PyTorch checkpoint (it does not start like a zip archive or a pickle)"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The sentence of torch's weights-only error that names what it refused (torch wraps it in advice of its own).
_REFUSAL = re.compile(
    r"(Unsupported global: GLOBAL \S+ was not an allowed global by default\."
    r"|Trying to load unsupported GLOBAL \S+ whose module \S+ is blocked\."
    r"|Trying to call reduce for unrecognized function[^\n]*"
    r"|Can only (?:build|create new object)[^\n]*)"
)
_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


def refused_by_weights_only(exc: BaseException) -> str | None:
    """What torch's weights-only unpickler refused, in its own words (``Trying to load unsupported GLOBAL
    posix.system whose module posix is blocked.``), or None if ``exc`` is no such refusal."""
    if not isinstance(exc, pickle.UnpicklingError):
        return None
    text = _ANSI.sub("", str(exc))
    match = _REFUSAL.search(text)
    if match:
        return match.group(1)
    if "weights only load failed" in text.lower():  # another refusal (an opcode it does not read, ...)
        match = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
        return match.group(1) if match else "the weights-only unpickler could not read it"
    return None


def refused_global(words: str) -> str | None:
    """The dotted name of the refused global in a refusal's words (``posix.system``), if it names one."""
    match = _GLOBAL.search(words)
    return match.group(1) if match else None


def refusal_error(file: str, words: str, refuser: str = "torch.load(weights_only=True)") -> UntrustedCheckpointError:
    """The error for a file whose restricted unpickling refused an object: the file, the object, how to opt in."""
    name = refused_global(words)
    obj = f" ({name})" if name else ""
    return UntrustedCheckpointError(
        f"Could not load checkpoint {file!r}: {refuser} refused an object in it{obj}: {words} {TRUST_HINT}.", file
    )


def load_error(path: str, exc: BaseException) -> CheckpointLoadError:
    """The error for a ``torch.load`` of the existing file ``path`` that raised ``exc``: a refusal by the weights-only
    unpickler of an intact file (naming the object and the opt-in), or what is damaged about the file."""
    words = refused_by_weights_only(exc)
    intact, what = _inspect(path, check_members=words is not None)
    if words is not None and intact:
        return refusal_error(path, words)
    return CheckpointLoadError(
        f"Could not load checkpoint {path!r}: {what}. Underlying error: {type(exc).__name__}: {exc}", path
    )


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic (a killed save leaves the previous file as it was) and whose load
    errors name the file and the problem. Non-local paths (fsspec URLs) go to ``TorchCheckpointIO`` unchanged."""

    @override
    def save_checkpoint(self, checkpoint: Checkpoint, path: _PATH, storage_options: object = None) -> None:
        if storage_options is not None or not is_local_path(path):
            # TorchCheckpointIO refuses storage options (a TypeError) and writes remote paths through fsspec.
            return super().save_checkpoint(checkpoint, path, storage_options)
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
        fsync_path(folder)

    def _write(self, checkpoint: Checkpoint, f: IO[bytes]) -> None:
        """Serialise ``checkpoint`` into the open temporary file (a seam for tests and subclasses)."""
        torch.save(checkpoint, f)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> Checkpoint:
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
            raise load_error(path, exc) from exc
        if not isinstance(checkpoint, dict):
            raise CheckpointLoadError(
                f"Could not load checkpoint {path!r}: it holds a {type(checkpoint).__name__}, not a checkpoint dict; "
                "the file is corrupt or is not a Lightning checkpoint.",
                path,
            )
        return checkpoint
