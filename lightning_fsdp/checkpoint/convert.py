"""``lightning-fsdp convert SRC DST [--to full|sharded]``: move checkpoints between formats, in one process.

* a sharded directory -> one full file in Lightning's layout (``state_dict`` with the unwrapped model's keys, plain
  ``torch.optim`` optimizer state), which plain Lightning (single device, DDP) and
  ``LightningModule.load_from_checkpoint`` load as well;
* a local directory -> one full file (the rank files are stitched together);
* a full file -> a sharded directory (``--to sharded``), loadable by ``fsdp_custom`` at any world size.

Runs without a process group (``torch.distributed.checkpoint`` in no-dist mode) and holds the whole checkpoint in
host memory. ``python -m lightning_fsdp.checkpoint.convert`` runs the same command.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any, Optional

from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO, CheckpointLoadError
from lightning_fsdp.checkpoint.common import to_index_keyed
from lightning_fsdp.checkpoint.paths import FULL, LOCAL, SHARDED, checkpoint_kind

__all__ = ["convert", "load_as_full", "main"]


def load_as_full(src: str, weights_only: Optional[bool] = False) -> dict[str, Any]:
    """Any checkpoint (full file, sharded or local directory) as a full checkpoint dict in Lightning's layout."""
    kind = checkpoint_kind(src)
    if kind == SHARDED:
        from lightning_fsdp.checkpoint.sharded import read_sharded_checkpoint_full

        return read_sharded_checkpoint_full(src, weights_only=weights_only)
    if kind == LOCAL:
        from lightning_fsdp.checkpoint.local import read_local_checkpoint_full

        return read_local_checkpoint_full(src, weights_only=weights_only)
    checkpoint = AtomicCheckpointIO().load_checkpoint(src, weights_only=weights_only)
    if not isinstance(checkpoint.get("state_dict"), Mapping):
        raise CheckpointLoadError(
            f"{src!r} is not a Lightning checkpoint: it has no 'state_dict' entry with the model's weights (its "
            f"entries: {sorted(map(str, checkpoint))}).",
            src,
        )
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [to_index_keyed(s) for s in checkpoint["optimizer_states"]]
    return checkpoint


def convert(src: str, dst: str, to: Optional[str] = None, *, overwrite: bool = False) -> str:
    """Convert ``src`` into ``dst``; ``to`` defaults to ``"full"`` for a directory and ``"sharded"`` for a file.
    Returns the format written. The output is written atomically (temporary name, then rename)."""
    src, dst = os.fspath(src), os.fspath(dst)
    kind = checkpoint_kind(src)
    to = to or (SHARDED if kind == FULL else FULL)
    if to not in (FULL, SHARDED):
        raise ValueError(f"--to {to!r} is not valid; choose 'full' or 'sharded'.")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"Source and destination are the same path: {src!r}.")
    if os.path.lexists(dst) and not overwrite:
        raise FileExistsError(f"Destination {dst!r} exists; pass --overwrite to replace it.")
    if kind == to:
        raise ValueError(f"{src!r} is already a {kind} checkpoint.")
    checkpoint = load_as_full(src)
    if to == FULL:
        if os.path.isdir(dst):
            from lightning_fsdp.checkpoint.paths import remove_checkpoint_path

            remove_checkpoint_path(dst)
        AtomicCheckpointIO().save_checkpoint(checkpoint, dst)
    else:
        from lightning_fsdp.checkpoint.sharded import save_sharded_from_full

        save_sharded_from_full(checkpoint, dst)
    return to


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp convert",
        description="Convert a checkpoint between formats: a sharded or local checkpoint directory into one full "
                    "file (loadable by plain Lightning), or a full file into a sharded directory (--to sharded).",
    )
    parser.add_argument("src", metavar="SRC", help="checkpoint file or directory to read")
    parser.add_argument("dst", metavar="DST", help="file or directory to write")
    parser.add_argument("--to", choices=[FULL, SHARDED], default=None,
                        help="output format (default: full for a directory, sharded for a file)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        written = convert(args.src, args.dst, args.to, overwrite=args.overwrite)
    except (CheckpointLoadError, ValueError, OSError) as exc:
        print(f"lightning-fsdp convert: error: {exc}", file=sys.stderr)
        return 1
    print(f"Wrote a {written} checkpoint to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
