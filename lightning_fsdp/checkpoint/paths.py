"""Checkpoint paths: which format a path holds, and crash-safe replacement of checkpoint directories (written into a
temporary sibling, then swapped in with ``renameat2(RENAME_EXCHANGE)`` or renamed aside and in)."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys

from lightning_fsdp.checkpoint.atomic_io import (
    CheckpointIsDirectoryError,
    CheckpointLoadError,
    CheckpointNotFoundError,
    fsync_path,
    temp_path_for,
)

META_FILE = "meta.pt"  # Lightning's name (lightning.fabric.utilities.load._METADATA_FILENAME)
DCP_METADATA_FILE = ".metadata"  # written by torch.distributed.checkpoint
FULL, SHARDED, LOCAL = "full", "sharded", "local"


def local_rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def checkpoint_kind(path: str) -> str:
    """``"full"`` (a file), ``"sharded"`` (a directory with ``.metadata`` and ``meta.pt``) or ``"local"`` (a directory
    with ``meta.pt`` and ``rank-*.pt`` files). Raises an error naming the path if it is none of them."""
    if os.path.isfile(path):
        return FULL
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        hint = "" if os.path.isdir(parent) else f" (its directory {parent!r} does not exist either)"
        raise CheckpointNotFoundError(f"Checkpoint not found: {path!r}{hint}.", path)
    if not os.path.isdir(path):
        raise CheckpointLoadError(
            f"Checkpoint path {path!r} is neither a checkpoint file nor a checkpoint directory (it is a special file).",
            path,
        )
    names = set(os.listdir(path))
    if DCP_METADATA_FILE in names:
        if META_FILE not in names:
            raise CheckpointLoadError(
                f"Sharded checkpoint {path!r} is incomplete: {META_FILE!r} (the loops, callbacks and other "
                "non-tensor state) is missing; the directory was not written by a finished save.",
                path,
            )
        return SHARDED
    if META_FILE in names and any(n.startswith("rank-") and n.endswith(".pt") for n in names):
        return LOCAL
    if META_FILE in names:
        raise CheckpointLoadError(
            f"Checkpoint directory {path!r} has {META_FILE!r} but neither {DCP_METADATA_FILE!r} (a sharded "
            "checkpoint) nor any rank-N.pt file (a local checkpoint); shard files are missing.",
            path,
        )
    listing = sorted(names)
    shown = ", ".join(repr(n) for n in listing[:8]) + (", ..." if len(listing) > 8 else "")
    raise CheckpointIsDirectoryError(
        f"Checkpoint path {path!r} is a directory but not a checkpoint: it has no {DCP_METADATA_FILE!r} (sharded "
        f"checkpoint) and no {META_FILE!r} (local checkpoint); it contains [{shown}]. Pass a checkpoint file or a "
        "checkpoint directory written by state_dict_type='sharded' or 'local'.",
        path,
    )


def prepare_temp_dir(path: str) -> str:
    """Create an empty temporary directory next to ``path`` for a new checkpoint (called on rank 0)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = temp_path_for(path)
    if os.path.lexists(tmp):
        remove_path(tmp)
    os.makedirs(tmp)
    return tmp


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE). False where not supported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE) failed: {os.strerror(err)}")


def commit_directory(tmp: str, path: str) -> None:
    """Move the finished checkpoint directory ``tmp`` to ``path``, replacing what was there (file, directory or
    link) without a moment where a crash leaves neither a complete old nor a complete new checkpoint there, where the
    platform allows (otherwise the old one is kept aside under ``.{name}.old-{pid}`` until the new one is in place)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    _fsync_tree(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        remove_path(tmp)  # now holds the previous checkpoint
    else:
        aside = os.path.join(parent, f".{os.path.basename(path)}.old-{os.getpid()}")
        if os.path.lexists(aside):
            remove_path(aside)
        os.rename(path, aside)
        os.rename(tmp, path)
        remove_path(aside)
    fsync_path(parent)


def remove_stale_temps(path: str) -> None:
    """Delete ``.{name}.tmp-{pid}`` leftovers of saves to ``path`` whose process no longer exists."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    prefix = f".{name}.tmp-"
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix) :]
        if pid.isdigit() and not _alive(int(pid)):
            remove_path(os.path.join(parent, entry))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_path(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def remove_checkpoint_path(path: str) -> None:
    """Delete a checkpoint file or directory; a directory is renamed aside first, so a crash while deleting never
    leaves a half-deleted checkpoint under its name."""
    path = os.path.abspath(path)
    if os.path.isdir(path) and not os.path.islink(path):
        aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.removing-{os.getpid()}")
        os.rename(path, aside)
        shutil.rmtree(aside)
    elif os.path.lexists(path):
        os.unlink(path)


def _fsync_tree(folder: str) -> None:
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def file_problem(path: str, expected_min_size: int | None = None) -> str | None:
    """Why the shard file ``path`` cannot be read (missing, or shorter than the metadata says), or None."""
    if not os.path.exists(path):
        return f"the file {os.path.basename(path)!r} is missing"
    size = os.path.getsize(path)
    if expected_min_size is not None and size < expected_min_size:
        return (
            f"the file {os.path.basename(path)!r} is truncated: it has {size} bytes, but the checkpoint's metadata "
            f"needs at least {expected_min_size}"
        )
    if size == 0:
        return f"the file {os.path.basename(path)!r} is empty (0 bytes)"
    return None
