"""``lightning-fsdp export CHECKPOINT OUT_DIR``: any checkpoint's model weights as a Hugging Face style safetensors
directory (what ``save_pretrained`` writes), optimizer state and loops left behind (docs/checkpoints.md).

[Note: streaming export]
A checkpoint is read tensor by tensor, never whole: a full or local file memory-mapped, a sharded directory with one
``dcp.load`` per tensor. The split into files is planned from the shapes alone, so each tensor is written as soon as
it is read and dropped before the next; peak memory is about the largest tensor. Tied weights are written under both
names (``from_pretrained`` re-ties them when the config says so; dropping one would lose it where it does not).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from fsspec.core import url_to_fs

from lightning_fsdp.checkpoint.atomic_io import CheckpointLoadError, load_error
from lightning_fsdp.checkpoint.common import numel
from lightning_fsdp.checkpoint.convert import add_output_arguments, check_trust, run_command, same_path
from lightning_fsdp.checkpoint.full import model_weights
from lightning_fsdp.checkpoint.local import RankFiles, unsplit_shape
from lightning_fsdp.checkpoint.paths import (
    FULL,
    LOCAL,
    SHARDED,
    commit_directory,
    file_problem,
    prepare_temp_dir,
    remove_path,
    remove_stale_temps,
)
from lightning_fsdp.checkpoint.remote import is_remote, local_copy, remote_exists, remove_remote_checkpoint
from lightning_fsdp.checkpoint.routing import format_on_disk
from lightning_fsdp.checkpoint.safe_load import check_shard_files, dcp_load, read_dcp_metadata
from lightning_fsdp.checkpoint.sharded import dcp_entries
from lightning_fsdp.collective import Collective
from lightning_fsdp.engine.host_memory import trim_heap

__all__ = ["DTYPES", "export_safetensors", "main", "parse_dtype", "parse_size"]

SINGLE_FILE = "model.safetensors"  # transformers' SAFE_WEIGHTS_NAME
INDEX_FILE = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
CONFIG_FILE = "config.json"

# The names --dtype accepts. Only floating-point tensors are cast (integer and bool buffers keep their dtype), as
# transformers' torch_dtype does.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*", re.IGNORECASE)
_SIZE_HELP = (
    "a number of bytes, or a number with a unit: B, KB, MB, GB, TB (powers of 1000, as transformers reads "
    "'5GB') or KiB, MiB, GiB, TiB (powers of 1024), e.g. '5GB' or '500MiB'"
)


def parse_size(value: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a string such as ``"5GB"`` (5 * 10**9) or ``"500MiB"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"max_shard_size must be an int or a string, not {type(value).__name__} ({value!r}).")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"max_shard_size {value!r} is not a size; give {_SIZE_HELP}.")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"max_shard_size {value!r} must be positive; give {_SIZE_HELP}.")
    return size


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype floating-point tensors are cast to (None: keep each tensor's own)."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and value not in DTYPES.values():
            raise ValueError(f"dtype {value} is not supported; choose one of {_dtype_choices()}.")
        return value
    if isinstance(value, str):
        name = value.lower().removeprefix("torch.")
        if name in DTYPES:
            return DTYPES[name]
    raise ValueError(f"dtype {value!r} is not valid; choose one of {_dtype_choices()}.")


def _dtype_choices() -> str:
    return ", ".join(repr(n) for n in DTYPES)


def _read_config(config: str | os.PathLike[str] | Mapping[str, object]) -> dict[str, object]:
    """``config.json``'s content from a dict, a file, or a directory holding ``config.json``."""
    if isinstance(config, Mapping):
        return dict(config)
    path = os.fspath(config)
    file = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        where = f"the directory {path!r} has no {CONFIG_FILE!r}" if os.path.isdir(path) else f"{path!r} does not exist"
        raise FileNotFoundError(f"config: {where}; give a config.json file, a directory holding one, or a dict.")
    try:
        with open(file, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"config: {file!r} is not a JSON file ({type(exc).__name__}: {exc}).") from exc
    if not isinstance(content, dict):
        raise ValueError(f"config: {file!r} holds a JSON {type(content).__name__}, not an object (a model config).")
    return content


class TensorInfo(NamedTuple):
    """One tensor of the checkpoint's ``state_dict``, as known before it is read."""

    key: str  # the checkpoint's key
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Source(NamedTuple):
    """The model weights of one checkpoint: what tensors it has (from metadata alone), and each one on request."""

    tensors: list[TensorInfo]  # in the checkpoint's order
    skipped: list[str]  # non-tensor entries (safetensors holds tensors only)
    read: Callable[[str], torch.Tensor]


def _source(infos: Mapping[str, TensorInfo | None], read: Callable[[str], torch.Tensor]) -> _Source:
    """The source of the entries ``infos`` describes (None: not a tensor), in their order."""
    tensors = [info for info in infos.values() if info is not None]
    return _Source(tensors, [key for key, info in infos.items() if info is None], read)


def _mmap_load(file: str, weights_only: bool) -> Any:  # whatever the file holds: callers check it
    """``torch.load`` with the file memory-mapped (a tensor's bytes are read when it is used, not at load)."""
    problem = file_problem(file)
    if problem is not None:
        raise CheckpointLoadError(f"Could not read {file!r}: {problem}.", file)
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the file (and a refused object)
        raise load_error(file, exc) from exc


def _full_source(path: str, weights_only: bool) -> _Source:
    state = model_weights(_mmap_load(path, weights_only), path)
    infos = {
        k: TensorInfo(k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for k, v in state.items()
    }
    return _source(infos, state.__getitem__)


def _sharded_source(path: str, weights_only: bool) -> _Source:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(path, weights_only)
    check_shard_files(path, metadata)
    infos: dict[str, TensorInfo | None] = {}
    flat_keys: dict[str, str] = {}
    for flat, (where, storage) in dcp_entries(metadata, saved_order=True).items():
        if where[0] != "model" or len(where) != 2:
            continue  # optimizer state
        key = str(where[1])
        flat_keys[key] = flat
        if isinstance(storage, TensorStorageMetadata):
            infos[key] = TensorInfo(key, tuple(int(s) for s in storage.size), storage.properties.dtype)
        else:
            infos[key] = None

    def read(key: str) -> torch.Tensor:
        info = infos[key]
        assert info is not None  # read for the tensors only
        target = torch.empty(info.shape, dtype=info.dtype)
        # One entry: DCP plans reads of this tensor's chunks only (every rank file that holds rows of it).
        dcp_load({flat_keys[key]: target}, path, Collective(alone=True), weights_only)
        return target

    return _source(infos, read)


def _local_source(path: str, weights_only: bool) -> _Source:
    files = RankFiles(path, weights_only, _mmap_load)
    infos: dict[str, TensorInfo | None] = {}
    for key, entry in files.entries.items():
        if entry["shape"] is None:
            infos[key] = None
        else:
            dtype = getattr(torch, str(entry["dtype"]).removeprefix("torch."))
            infos[key] = TensorInfo(key, unsplit_shape(entry), dtype)
    return _source(infos, files.full)


_SOURCES: dict[str, Callable[[str, bool], _Source]] = {
    FULL: _full_source,
    SHARDED: _sharded_source,
    LOCAL: _local_source,
}


class _Planned(NamedTuple):
    """A tensor of the export: where it comes from, its name in the output, what it is written as."""

    key: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def _output_names(
    tensors: list[TensorInfo], prefix: str, rename: Callable[[str], str] | None, dtype: torch.dtype | None
) -> list[_Planned]:
    planned: list[_Planned] = []
    seen: dict[str, str] = {}  # output name -> the checkpoint key it came from
    for info in tensors:
        name = info.key.removeprefix(prefix)
        if rename is not None:
            name = rename(name)
            if not isinstance(name, str) or not name:
                raise TypeError(f"rename({info.key.removeprefix(prefix)!r}) returned {name!r}; it must return a name.")
        if name in seen:
            raise ValueError(
                f"Checkpoint keys {seen[name]!r} and {info.key!r} both become {name!r} after the name mapping "
                f"(prefix {prefix!r}{', rename' if rename is not None else ''}); the output needs distinct names."
            )
        seen[name] = info.key
        out_dtype = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
        nbytes = numel(info.shape) * out_dtype.itemsize
        planned.append(_Planned(info.key, name, tuple(info.shape), out_dtype, nbytes))
    return planned


def _split(planned: list[_Planned], max_bytes: int) -> list[list[_Planned]]:
    """Consecutive tensors into files of at most ``max_bytes`` (a larger tensor gets a file of its own), in order,
    as huggingface_hub's ``split_torch_state_dict_into_shards`` does."""
    files: list[list[_Planned]] = []
    current: list[_Planned] = []
    size = 0
    for item in planned:
        if current and size + item.nbytes > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(item)
        size += item.nbytes
    if current or not files:
        files.append(current)
    return files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# After reading a tensor of at least this size, glibc's free heap pages go back to the kernel (trim_heap): glibc
# raises its mmap threshold after a large block is freed, so the next tensor-sized blocks (the tensor being read, DCP's
# temporary copy of each chunk) come from the heap, where freed memory stays resident; without this an export's
# resident set grows by several tensors (tests/checkpoint/test_export.py measures it). Smaller blocks come from the
# heap anyway and do not move the threshold; trimming after each would only cost time on models with many small ones.
_TRIM_AFTER_BYTES = 2**20


# safetensors' names of torch's dtypes (the format's "dtype" field).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _header(items: list[_Planned]) -> bytes:
    """A safetensors file's header for ``items`` laid out in order: 8 bytes of little-endian header length, then the
    JSON (names, dtypes, shapes, byte offsets), padded with spaces to a multiple of 8 as safetensors writes it."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        if item.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{item.name!r} has dtype {item.dtype}, which safetensors cannot store.")
        entries[item.name] = {
            "dtype": _SAFETENSORS_DTYPES[item.dtype],
            "shape": list(item.shape),
            "data_offsets": [offset, offset + item.nbytes],
        }
        offset += item.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_files(source: _Source, files: list[list[_Planned]], names: list[str], folder: str) -> None:
    """Write each file tensor by tensor ([Note: streaming export]); ``safetensors.torch.save_file`` would need a whole
    file's tensors in memory at once. safetensors' own reader checks what is written here (tests)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; exporting on a big-endian machine is not supported.")
    for items, file_name in zip(files, names):
        with open(os.path.join(folder, file_name), "wb") as f:
            f.write(_header(items))
            for item in items:
                tensor = source.read(item.key).detach().to(item.dtype).contiguous()
                if tuple(tensor.shape) != item.shape:
                    raise CheckpointLoadError(
                        f"{item.key!r} has shape {tuple(tensor.shape)} in the checkpoint's data but {item.shape} in "
                        "its metadata; the checkpoint is damaged.",
                        folder,
                    )
                if tensor.numel():
                    f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)  # the tensor's own memory, no copy
                del tensor
                if item.nbytes >= _TRIM_AFTER_BYTES:
                    trim_heap()  # the read's temporaries: see the comment on _TRIM_AFTER_BYTES
            f.flush()
            os.fsync(f.fileno())


def _write_json(obj: object, file: str) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def export_safetensors(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    prefix: str = "",
    rename: Callable[[str], str] | None = None,
    config: str | os.PathLike[str] | Mapping[str, object] | None = None,
    overwrite: bool = False,
    trust_pickled_code: bool = False,
) -> list[str]:
    """Write the model weights of ``checkpoint`` (a full file, a sharded or a local directory) to ``out_dir`` as a
    Hugging Face style safetensors directory, streaming (see ``[Note: streaming export]``). Returns the paths of the
    files written, in ``out_dir``.

    ``max_shard_size``: the most bytes per safetensors file (``"5GB"`` like transformers, or ``"500MiB"``, or an int);
    a tensor larger than it gets a file of its own. ``dtype``: cast floating-point tensors (one of :data:`DTYPES`).
    Names: each output name is ``rename(key.removeprefix(prefix))`` (``prefix="model."`` turns a LightningModule's
    ``model.model.layers.0...`` into transformers' ``model.layers.0...``). ``config``: ``config.json`` to copy into
    the output (a file, a directory holding one, or a dict). ``overwrite``: replace an existing ``out_dir``.
    ``trust_pickled_code``: unpickle the checkpoint's files without restriction, running any code they hold (only
    for a checkpoint you trust); by default an object that would run code raises ``UntrustedCheckpointError`` naming
    the file and the object, and no output is left behind.
    """
    checkpoint, out_dir = os.fspath(checkpoint), os.fspath(out_dir)
    # Every argument is checked before anything is read or written.
    max_bytes = parse_size(max_shard_size)
    cast = parse_dtype(dtype)
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a string, not {type(prefix).__name__} ({prefix!r}).")
    if rename is not None and not callable(rename):
        raise TypeError(f"rename must be a function from name to name, not {type(rename).__name__} ({rename!r}).")
    weights_only = not check_trust(trust_pickled_code)
    config_content = _read_config(config) if config is not None else None
    if same_path(checkpoint, out_dir):
        raise ValueError(f"The checkpoint and the output directory are the same path: {checkpoint!r}.")
    # On object storage: the checkpoint is downloaded first, the output written locally and then uploaded.
    with local_copy(checkpoint) as source_path, _local_output(out_dir, overwrite) as out_path:
        written = _export(
            source_path, out_path, max_bytes, cast, prefix, rename, weights_only, config_content, overwrite
        )
    return [f"{out_dir.rstrip('/')}/{name}" if is_remote(out_dir) else os.path.join(out_dir, name) for name in written]


@contextlib.contextmanager
def _local_output(out_dir: str, overwrite: bool) -> Iterator[str]:
    """``out_dir`` if it is local; for a URL a local temporary directory whose files are uploaded to ``out_dir``
    once the export is complete (the safetensors files first, the index and config last)."""
    if not is_remote(out_dir):
        yield out_dir
        return
    if remote_exists(out_dir) and not overwrite:
        raise FileExistsError(f"Output directory {out_dir!r} exists; pass overwrite=True (--overwrite) to replace it.")
    root = tempfile.mkdtemp(prefix="lightning-fsdp-export-")
    try:
        local = os.path.join(root, "out")
        yield local
        last = {INDEX_FILE, CONFIG_FILE}
        names = sorted(os.listdir(local), key=lambda name: (name in last, name))
        if remote_exists(out_dir):
            remove_remote_checkpoint(out_dir)
        fs, path = url_to_fs(out_dir)
        for name in names:
            fs.put_file(os.path.join(local, name), f"{path.rstrip('/')}/{name}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _export(
    checkpoint: str,
    out_dir: str,
    max_bytes: int,
    cast: torch.dtype | None,
    prefix: str,
    rename: Callable[[str], str] | None,
    weights_only: bool,
    config_content: Mapping[str, Any] | None,
    overwrite: bool,
) -> list[str]:
    """The export of the local ``checkpoint`` into the local ``out_dir``; returns the names of the files written."""
    # format_on_disk raises naming the path if it holds no checkpoint.
    source = _SOURCES[format_on_disk(checkpoint).kind](checkpoint, weights_only)
    if os.path.lexists(out_dir) and not overwrite:
        raise FileExistsError(f"Output directory {out_dir!r} exists; pass overwrite=True (--overwrite) to replace it.")
    if source.skipped:
        warnings.warn(
            f"Export of {checkpoint!r}: the state_dict entries {source.skipped} are not tensors; safetensors holds "
            "tensors only, so they are left out.",
            stacklevel=2,
        )
    planned = _output_names(source.tensors, prefix, rename, cast)
    files = _split(planned, max_bytes)
    names = _file_names(len(files))

    remove_stale_temps(out_dir)
    tmp = prepare_temp_dir(out_dir)
    try:
        _write_files(source, files, names, tmp)
        written = list(names)
        if len(files) > 1:
            weight_map = {item.name: name for items, name in zip(files, names) for item in items}
            index = {"metadata": {"total_size": sum(item.nbytes for item in planned)}, "weight_map": weight_map}
            _write_json(index, os.path.join(tmp, INDEX_FILE))
            written.append(INDEX_FILE)
        if config_content is not None:
            _write_json(config_content, os.path.join(tmp, CONFIG_FILE))
            written.append(CONFIG_FILE)
        commit_directory(tmp, out_dir)
    except BaseException:
        remove_path(tmp)
        raise
    return written


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp export",
        description="Export a checkpoint's model weights (a full file, a sharded or a local directory) as a Hugging "
        "Face style directory of safetensors files plus index, loadable by transformers' from_pretrained. Reads the "
        "checkpoint tensor by tensor.",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file or directory to read")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write")
    parser.add_argument(
        "--max-shard-size", default="5GB", help="most bytes per safetensors file, e.g. 5GB (default), 500MiB"
    )
    parser.add_argument("--dtype", default=None, help=f"cast floating-point tensors to this dtype: {', '.join(DTYPES)}")
    parser.add_argument(
        "--strip-prefix",
        default="",
        metavar="PREFIX",
        help="remove PREFIX from the start of every name (model. for a LightningModule holding the model as "
        "self.model)",
    )
    parser.add_argument("--config", default=None, help="config.json to copy into OUT_DIR, or a directory holding one")
    add_output_arguments(parser, "CHECKPOINT", "OUT_DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def work() -> str:
        written = export_safetensors(
            args.checkpoint,
            args.out_dir,
            max_shard_size=args.max_shard_size,
            dtype=args.dtype,
            prefix=args.strip_prefix,
            config=args.config,
            overwrite=args.overwrite,
            trust_pickled_code=args.trust_pickled_code,
        )
        return f"Wrote {len(written)} file(s) to {args.out_dir}: {', '.join(os.path.basename(w) for w in written)}"

    return run_command("export", work, (CheckpointLoadError, ValueError, TypeError, OSError))


if __name__ == "__main__":
    sys.exit(main())
