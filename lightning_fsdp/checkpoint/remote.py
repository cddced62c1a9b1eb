"""Checkpoints on object storage: any fsspec URL that is not a local path (``s3://`` through s3fs, ``gs://``,
``memory://``, ...). Object stores have no rename and no fsync, so a directory checkpoint there is committed by an
object written last instead (docs/checkpoints.md, "Object storage").

[Note: committed directories on object storage]
A sharded or local checkpoint at ``URL`` is laid out as::

    URL/commit.json             written last, by rank 0, once every rank's files are uploaded
    URL/<version>/.metadata     the files of the local layout (DCP files, rank-N.pt, meta.pt), under a fresh
    URL/<version>/...           version name per save

``commit.json`` names the format, the version and every file with its size. A single object PUT is atomic on S3, so
a reader sees either the previous commit (and the previous version's files, untouched by the new save) or the new
one; a save killed before it leaves no commit at a new path, or the previous one at an existing path. Readers refuse
a directory without ``commit.json``, naming it, and check every file it lists (missing or short: named). After the
commit, rank 0 deletes the other versions (the previous checkpoint, leftovers of saves that died). Removing a
checkpoint deletes ``commit.json`` first, so a removal cut short leaves a refused directory, never a partial one that
looks complete. A full checkpoint is one object, whose upload is atomic by itself (s3fs completes a multipart upload
only when the file is closed).

Every rank writes its part into a local temporary directory first (the code of the on-disk formats, unchanged) and
uploads it; reading downloads the committed files into a local temporary directory and reads them with the on-disk
code, so that the restricted unpickling and the damage checks of ``safe_load`` apply as they do on disk
(docs/decisions.md, "Object storage through local staging").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from lightning_fsdp.checkpoint.atomic_io import (
    AtomicCheckpointIO,
    CheckpointLoadError,
    CheckpointNotFoundError,
    is_local_path,
)
from lightning_fsdp.checkpoint.paths import FULL, LOCAL, META_FILE, SHARDED
from lightning_fsdp.collective import Collective

__all__ = [
    "COMMIT_FILE",
    "is_remote",
    "local_copy",
    "remote_exists",
    "remote_kind",
    "remove_remote_checkpoint",
    "remove_remote_directory",
    "staged_directory",
    "upload_directory",
    "write_remote_directory",
]

COMMIT_FILE = "commit.json"
_VERSION_PREFIX = "v-"
_STAGE_PREFIX = "lightning-fsdp-"


def is_remote(path: object) -> bool:
    """Whether ``path`` is an fsspec URL of a non-local file system (``s3://...``), not a local path."""
    return isinstance(path, (str, os.PathLike)) and not is_local_path(os.fspath(path))


def _fs(url: str) -> tuple[AbstractFileSystem, str]:
    """The file system of ``url`` and the path in it, its listings read afresh (another process may have written)."""
    fs, path = url_to_fs(url)
    fs.invalidate_cache()
    return fs, path.rstrip("/")


def _join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def remote_exists(url: str) -> bool:
    fs, path = _fs(url)
    return bool(fs.exists(path))


def _read_commit(fs: AbstractFileSystem, path: str, url: str) -> dict[str, Any] | None:
    try:
        with fs.open(_join(path, COMMIT_FILE), "rb") as f:
            commit = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointLoadError(
            f"Could not read checkpoint {url!r}: its commit object {COMMIT_FILE!r} is unreadable ({exc}).", url
        ) from exc
    if not isinstance(commit, dict) or commit.get("format") not in (SHARDED, LOCAL):
        raise CheckpointLoadError(
            f"Checkpoint {url!r}: {COMMIT_FILE!r} does not describe a sharded or local checkpoint ({commit!r}).", url
        )
    return commit


def remote_kind(url: str) -> str:
    """``"full"`` (one object), or the format a committed directory names. Raises naming the URL if there is
    nothing, or a directory without its commit object (a save that did not finish)."""
    fs, path = _fs(url)
    if fs.isfile(path):
        return FULL
    commit = _read_commit(fs, path, url)
    if commit is not None:
        return str(commit["format"])
    if not fs.exists(path):
        raise CheckpointNotFoundError(f"Checkpoint not found: {url!r}.", url)
    listing = sorted(os.path.relpath(p, path) for p in fs.find(path))
    shown = ", ".join(repr(n) for n in listing[:8]) + (", ..." if len(listing) > 8 else "")
    raise CheckpointLoadError(
        f"Checkpoint directory {url!r} is incomplete: its commit object {COMMIT_FILE!r} is missing, so the save "
        f"that wrote it did not finish (a checkpoint on object storage is complete only once {COMMIT_FILE!r} is "
        f"written, after every rank's files). It holds [{shown}].",
        url,
    )


def _committed_files(fs: AbstractFileSystem, path: str, url: str) -> tuple[str, dict[str, int]]:
    commit = _read_commit(fs, path, url)
    if commit is None:
        remote_kind(url)  # raises naming what is missing
        raise CheckpointLoadError(f"Checkpoint {url!r} is not a checkpoint directory.", url)
    version, files = str(commit["version"]), commit["files"]
    present = {os.path.relpath(p, _join(path, version)): int(fs.size(p)) for p in fs.find(_join(path, version))}
    for name, size in sorted(files.items()):
        if name not in present:
            raise CheckpointLoadError(
                f"Checkpoint {url!r} is damaged: the file {name!r} its {COMMIT_FILE!r} lists is missing.", url
            )
        if present[name] != size:
            raise CheckpointLoadError(
                f"Checkpoint {url!r} is damaged: the file {name!r} has {present[name]} bytes, its {COMMIT_FILE!r} "
                f"records {size}.",
                url,
            )
    return version, dict(files)


def _stage_dir(url: str) -> tuple[str, str]:
    """(a new local temporary folder, the path inside it named like the checkpoint)."""
    root = tempfile.mkdtemp(prefix=_STAGE_PREFIX)
    return root, os.path.join(root, os.path.basename(url.rstrip("/")) or "checkpoint")


@contextlib.contextmanager
def staged_directory(url: str) -> Iterator[str]:
    """The committed files of the directory checkpoint ``url``, downloaded into a local temporary directory (named
    like the checkpoint) that is deleted afterwards."""
    fs, path = _fs(url)
    version, files = _committed_files(fs, path, url)
    root, local = _stage_dir(url)
    try:
        os.makedirs(local)
        for name in files:
            target = os.path.join(local, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fs.get_file(_join(path, version, name), target)
        yield local
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """``path`` itself if it is local; otherwise a local temporary copy of the checkpoint at the URL (one file, or a
    committed directory's files), deleted afterwards."""
    if not is_remote(path):
        yield path
        return
    url = os.fspath(path)
    if remote_kind(url) != FULL:
        with staged_directory(url) as local:
            yield local
        return
    fs, remote = _fs(url)
    root, local = _stage_dir(url)
    try:
        fs.get_file(remote, local)
        yield local
    finally:
        shutil.rmtree(root, ignore_errors=True)


def upload_directory(local: str, url: str) -> dict[str, int]:
    """Upload every file under ``local`` to ``url`` (the same relative names); returns name -> size."""
    fs, path = _fs(url)
    sizes: dict[str, int] = {}
    for folder, _dirs, names in os.walk(local):
        for name in names:
            file = os.path.join(folder, name)
            relative = os.path.relpath(file, local).replace(os.sep, "/")
            fs.put_file(file, _join(path, relative))
            sizes[relative] = os.path.getsize(file)
    return sizes


def _commit(url: str, kind: str, version: str, files: Mapping[str, int]) -> None:
    """Write ``commit.json`` (the checkpoint becomes visible) and delete every other version under ``url``."""
    fs, path = _fs(url)
    commit = {"format": kind, "version": version, "files": dict(sorted(files.items()))}
    with fs.open(_join(path, COMMIT_FILE), "wb") as f:
        f.write(json.dumps(commit, indent=1).encode("utf-8"))
    if fs.isfile(path):  # a full checkpoint (one object) this directory replaces
        fs.rm_file(path)
    for entry in fs.ls(path, detail=False):
        name = os.path.basename(str(entry).rstrip("/"))
        if name != COMMIT_FILE and name != version:
            fs.rm(str(entry), recursive=True)


def write_remote_directory(
    url: str,
    kind: str,
    write_part: Callable[[str], None],
    meta: Callable[[], Mapping[str, object]],
    coll: Collective,
) -> None:
    """A directory checkpoint written to object storage on every rank ([Note: committed directories on object
    storage]): each rank runs ``write_part`` into a local temporary directory of its own (it must raise on every rank
    if it fails on one) and uploads it under a new version, rank 0 adds ``meta()`` as ``meta.pt``, then commits. A
    failure raises on every rank and leaves the previous commit in place."""
    url = coll.broadcast(os.fspath(url).rstrip("/"))
    version = coll.broadcast(f"{_VERSION_PREFIX}{uuid.uuid4().hex[:16]}")
    root, local = _stage_dir(url)
    try:
        os.makedirs(local)
        write_part(local)

        def upload() -> dict[str, int]:
            if coll.is_rank0:
                AtomicCheckpointIO().save_checkpoint(dict(meta()), os.path.join(local, META_FILE))
            return upload_directory(local, _join(url, version))

        try:
            uploaded = coll.run_agreed(upload)
        except Exception:
            _remove_version(url, version, coll)  # every rank has stopped uploading: run_agreed gathered them
            raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    files: dict[str, int] = {}
    for part in coll.all_gather(uploaded):
        files.update(part)
    problem: Exception | None = None
    if coll.is_rank0:
        try:
            _commit(url, kind, version, files)
        except Exception as exc:  # noqa: BLE001 - shared with every rank below
            problem = exc
            _remove_version(url, version, coll)
    coll.agree_from_rank0(problem)


def _remove_version(url: str, version: str, coll: Collective) -> None:
    """Rank 0 deletes what a failed save uploaded (best effort: the next commit deletes what is left)."""
    if not coll.is_rank0:
        return
    fs, path = _fs(url)
    with contextlib.suppress(OSError):
        if fs.exists(_join(path, version)):
            fs.rm(_join(path, version), recursive=True)


def remove_remote_directory(url: str) -> None:
    """Delete the directory checkpoint at ``url`` if there is one (its commit object first); an object at ``url``
    itself stays."""
    fs, path = _fs(url)
    if fs.exists(_join(path, COMMIT_FILE)):
        fs.rm_file(_join(path, COMMIT_FILE))
    if fs.isdir(path):
        fs.rm(path + "/", recursive=True)


def remove_remote_checkpoint(url: str) -> None:
    """Delete the checkpoint at ``url`` (one object, or a directory: its commit object first)."""
    fs, path = _fs(url)
    if fs.isfile(path):
        fs.rm_file(path)
    remove_remote_directory(url)
