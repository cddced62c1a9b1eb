"""``lightning-fsdp convert SRC DST [--to full|sharded]``: move checkpoints between formats, in one process.

* a sharded directory -> one full file in Lightning's layout (``state_dict`` with the unwrapped model's keys, plain
  ``torch.optim`` optimizer state), which plain Lightning (single device, DDP) and
  ``LightningModule.load_from_checkpoint`` load as well;
* a local directory -> one full file (the rank files are stitched together);
* a full file -> a sharded directory (``--to sharded``), loadable by ``fsdp_custom`` at any world size.

Runs without a process group (``torch.distributed.checkpoint`` in no-dist mode) and holds the whole checkpoint in
host memory. Every file is read by a restricted unpickler (``torch.load(weights_only=True)``, and ``safe_load``'s for
DCP files), which refuses, naming the file and the object, anything that would run code when unpickled;
``--trust-pickled-code`` (``trust_pickled_code=True``) lifts that for a file its user trusts.
``python -m lightning_fsdp.checkpoint.convert`` runs the same command.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lightning_fsdp.checkpoint.atomic_io import CheckpointLoadError
from lightning_fsdp.checkpoint.formats import FORMATS, format_on_disk
from lightning_fsdp.checkpoint.paths import FULL, SHARDED

__all__ = ["convert", "load_as_full", "main"]

# The formats a conversion can write: a local checkpoint's layout is a running engine's, which this process lacks.
_TARGETS = [kind for kind, fmt in FORMATS.items() if fmt.writes_offline]


def load_as_full(src: str, *, trust_pickled_code: bool = False) -> dict[str, Any]:
    """Any checkpoint (full file, sharded or local directory) as a full checkpoint dict in Lightning's layout.

    Every file is unpickled by a restricted unpickler, which refuses (``UntrustedCheckpointError`` naming the file and
    the object) what would run code; ``trust_pickled_code=True`` unpickles them as they are, running whatever code
    they hold: only for files you trust."""
    return format_on_disk(src).read_as_full(src, weights_only=not _trusted(trust_pickled_code))


def _trusted(trust_pickled_code: Any) -> bool:
    if not isinstance(trust_pickled_code, bool):
        raise TypeError(f"trust_pickled_code must be True or False, not {trust_pickled_code!r}.")
    return trust_pickled_code


def convert(
    src: str, dst: str, to: str | None = None, *, overwrite: bool = False, trust_pickled_code: bool = False
) -> str:
    """Convert ``src`` into ``dst``; ``to`` defaults to ``"full"`` for a directory and ``"sharded"`` for a file.
    Returns the format written. The output is written atomically (temporary name, then rename). ``src`` is read as
    :func:`load_as_full` reads it (restricted unless ``trust_pickled_code=True``)."""
    trusted = _trusted(trust_pickled_code)
    src, dst = os.fspath(src), os.fspath(dst)
    source = format_on_disk(src)
    to = to or (SHARDED if source.kind == FULL else FULL)
    if to not in _TARGETS:
        raise ValueError(f"--to {to!r} is not valid; choose {' or '.join(map(repr, _TARGETS))}.")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"Source and destination are the same path: {src!r}.")
    if os.path.lexists(dst) and not overwrite:
        raise FileExistsError(f"Destination {dst!r} exists; pass --overwrite to replace it.")
    if source.kind == to:
        raise ValueError(f"{src!r} is already a {to} checkpoint.")
    FORMATS[to].write_full(source.read_as_full(src, weights_only=not trusted), dst)
    return to


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
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument(
        "--trust-pickled-code",
        action="store_true",
        help="unpickle SRC's files without restriction, running any code they hold (only for a checkpoint you "
        "trust); by default an object that would run code is refused and named",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        written = convert(
            args.src, args.dst, args.to, overwrite=args.overwrite, trust_pickled_code=args.trust_pickled_code
        )
    except (CheckpointLoadError, ValueError, OSError) as exc:
        print(f"lightning-fsdp convert: error: {exc}", file=sys.stderr)
        return 1
    print(f"Wrote a {written} checkpoint to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
