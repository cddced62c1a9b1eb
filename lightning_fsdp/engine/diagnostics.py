"""What the engine says when something goes wrong: the collective a rank was in, and non-finite gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_fsdp.engine.records import CollectiveKind

if TYPE_CHECKING:
    from lightning_fsdp.engine.comm import Communicator
    from lightning_fsdp.engine.unit import FlatUnit

# ``Communicator.check_same_collective`` tags of collectives that belong to no unit (a unit's tags, ``FlatUnit.tag``,
# are >= 0).
TAG_IGNORED_GRAD, TAG_CLIP, TAG_ANOMALY = -1, -2, -3


def describe_collective(units: list[FlatUnit], tag: int) -> str:
    """What the collective ``tag`` names is, in words: "all-gather of unit 'blocks.0'"."""
    fixed = {
        TAG_IGNORED_GRAD: "all-reduce of an ignored parameter's gradient",
        TAG_CLIP: "all-reduce of the gradient norm",
        TAG_ANOMALY: "the end-of-backward anomaly report",
    }
    if tag in fixed:
        return fixed[tag]
    index, kind = divmod(tag, len(CollectiveKind))
    what = {
        CollectiveKind.ALL_GATHER: "all-gather of",
        CollectiveKind.REDUCE: "gradient reduction of",
        CollectiveKind.REPLICATE: "replica all-reduce of",
    }[CollectiveKind(kind)]
    name = units[index].name if 0 <= index < len(units) else f"#{index}"
    return f"{what} unit {name or '<root>'!r}"


def report_nonfinite(local: list[str], comms: list[Communicator]) -> None:
    """Anomaly checking: raise on every rank of ``comms`` naming each parameter whose gradient was not finite."""
    found: dict[str, set[str]] = {}
    for name in local:
        found.setdefault(name, set()).add(f"rank {dist.get_rank() if dist.is_initialized() else 0}")
    for comm in comms:
        comm.check_same_collective(TAG_ANOMALY)
        merged: dict[str, set[str]] = {}
        for other in comm.all_gather_object(found):
            for name, where in other.items():
                merged.setdefault(name, set()).update(where)
        found = merged
    if found:
        listing = ", ".join(f"{name!r} ({', '.join(sorted(where))})" for name, where in sorted(found.items()))
        raise FloatingPointError(
            f"Non-finite gradient (NaN or Inf) in parameter(s) {listing}, found by anomaly checking before "
            "the gradients were reduced; the ranks named are those whose own gradient was not finite."
        )
