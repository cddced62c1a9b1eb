"""Choosing a checkpoint format: by ``state_dict_type`` for saving, by what is on disk for loading."""

from __future__ import annotations

import enum
from typing import Any

from lightning_fsdp.checkpoint.common import CheckpointFormat
from lightning_fsdp.checkpoint.full import FullFormat
from lightning_fsdp.checkpoint.local import LocalFormat
from lightning_fsdp.checkpoint.paths import checkpoint_kind
from lightning_fsdp.checkpoint.sharded import ShardedFormat
from lightning_fsdp.engine.config import parse_enum

__all__ = ["FORMATS", "FULL_FORMAT", "StateDictType", "format_for_saving", "format_on_disk", "parse_state_dict_type"]


class StateDictType(enum.Enum):
    """The checkpoint format written by the strategy."""

    FULL = "full"
    SHARDED = "sharded"
    LOCAL = "local"


def parse_state_dict_type(value: Any) -> StateDictType:
    return parse_enum(value, StateDictType, "state_dict_type")  # type: ignore[return-value]


FULL_FORMAT = FullFormat()
FORMATS: dict[str, CheckpointFormat] = {f.kind: f for f in (FULL_FORMAT, ShardedFormat(), LocalFormat())}


def format_for_saving(state_dict_type: StateDictType | str) -> CheckpointFormat:
    """The format a run with this ``state_dict_type`` writes (the value is parsed and checked by the strategy)."""
    return FORMATS[StateDictType(state_dict_type).value]


def format_on_disk(path: str) -> CheckpointFormat:
    """The format of the checkpoint at ``path``; raises ``paths.checkpoint_kind``'s error naming the path if it holds
    none (missing, an unrelated directory, a directory missing its shard files or ``meta.pt``)."""
    return FORMATS[checkpoint_kind(path)]
