"""``lightning-fsdp convert SRC DST [--to full|sharded]``: move checkpoints between formats in one process, without
a process group, holding the whole checkpoint in host memory (docs/checkpoints.md). SRC and DST may be fsspec URLs
(``s3://...``): a checkpoint on object storage is downloaded to a local temporary copy first."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from lightning_fsdp.checkpoint import Checkpoint
from lightning_fsdp.checkpoint.atomic_io import CheckpointLoadError
from lightning_fsdp.checkpoint.paths import FULL, SHARDED
from lightning_fsdp.checkpoint.remote import is_remote, local_copy, remote_exists
from lightning_fsdp.checkpoint.routing import FORMATS, format_on_disk

__all__ = ["convert", "load_as_full", "main"]

# The formats a conversion can write: a local checkpoint's layout is a running engine's, which this process lacks.
_TARGETS = [kind for kind, fmt in FORMATS.items() if fmt.writes_offline]


def load_as_full(src: str, *, trust_pickled_code: bool = False) -> Checkpoint:
    """Any checkpoint (full file, sharded or local directory) as a full checkpoint dict in Lightning's layout.

    Every file is unpickled by a restricted unpickler, which refuses (``UntrustedCheckpointError`` naming the file and
    the object) what would run code; ``trust_pickled_code=True`` unpickles them as they are, running whatever code
    they hold: only for files you trust."""
    weights_only = not check_trust(trust_pickled_code)
    with local_copy(os.fspath(src)) as local:  # a checkpoint on object storage: downloaded first
        return format_on_disk(local).read_as_full(local, weights_only=weights_only)


def check_trust(trust_pickled_code: object) -> bool:
    if not isinstance(trust_pickled_code, bool):
        raise TypeError(f"trust_pickled_code must be True or False, not {trust_pickled_code!r}.")
    return trust_pickled_code


def convert(
    src: str, dst: str, to: str | None = None, *, overwrite: bool = False, trust_pickled_code: bool = False
) -> str:
    """Convert ``src`` into ``dst``; ``to`` defaults to ``"full"`` for a directory and ``"sharded"`` for a file.
    Returns the format written. The output is written atomically (temporary name, then rename). ``src`` is read as
    :func:`load_as_full` reads it (restricted unless ``trust_pickled_code=True``)."""
    trusted = check_trust(trust_pickled_code)
    src, dst = os.fspath(src), os.fspath(dst)
    if same_path(src, dst):
        raise ValueError(f"Source and destination are the same path: {src!r}.")
    with local_copy(src) as local:  # a checkpoint on object storage: downloaded first
        source = format_on_disk(local)
        to = to or (SHARDED if source.kind == FULL else FULL)
        if to not in _TARGETS:
            raise ValueError(f"--to {to!r} is not valid; choose {' or '.join(map(repr, _TARGETS))}.")
        if path_exists(dst) and not overwrite:
            raise FileExistsError(f"Destination {dst!r} exists; pass --overwrite to replace it.")
        if source.kind == to:
            raise ValueError(f"{src!r} is already a {to} checkpoint.")
        checkpoint = source.read_as_full(local, weights_only=not trusted)
    FORMATS[to].write_full(checkpoint, dst)
    return to


def same_path(a: str, b: str) -> bool:
    """Whether two checkpoint paths (local paths or URLs) name the same place."""
    if is_remote(a) or is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)


def path_exists(path: str) -> bool:
    """Whether something is at ``path`` (a local path, or an object or directory on object storage)."""
    return remote_exists(path) if is_remote(path) else os.path.lexists(path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp convert",
        description="Convert a checkpoint between formats: a sharded or local checkpoint directory into one full "
        "file (loadable by plain Lightning), or a full file into a sharded directory (--to sharded).",
    )
    parser.add_argument("src", metavar="SRC", help="checkpoint file or directory to read")
    parser.add_argument("dst", metavar="DST", help="file or directory to write")
    parser.add_argument(
        "--to", choices=_TARGETS, default=None, help="output format (default: full for a directory, sharded for a file)"
    )
    add_output_arguments(parser, "SRC", "DST")
    return parser


def add_output_arguments(parser: argparse.ArgumentParser, source: str, output: str) -> None:
    """``--overwrite`` and ``--trust-pickled-code``, which ``convert`` and ``export`` share."""
    parser.add_argument("--overwrite", action="store_true", help=f"replace {output} if it exists")
    parser.add_argument(
        "--trust-pickled-code",
        action="store_true",
        help=f"unpickle {source}'s files without restriction, running any code they hold (only for a checkpoint you "
        "trust); by default an object that would run code is refused and named",
    )


def run_command(name: str, work: Callable[[], str], errors: tuple[type[Exception], ...]) -> int:
    """Run a subcommand: its report on stdout and exit code 0, or ``errors`` on stderr and exit code 1."""
    try:
        report = work()
    except errors as exc:
        print(f"lightning-fsdp {name}: error: {exc}", file=sys.stderr)
        return 1
    print(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def work() -> str:
        to = convert(args.src, args.dst, args.to, overwrite=args.overwrite, trust_pickled_code=args.trust_pickled_code)
        return f"Wrote a {to} checkpoint to {args.dst}"

    return run_command("convert", work, (CheckpointLoadError, ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
