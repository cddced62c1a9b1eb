"""The data-parallel variants the benchmark compares: one function each that takes the same freshly built model.

Every function receives a :class:`~lightning_fsdp.demo.gpt.GPT` built on CPU from the same seed and a gloo process
group of all ranks that is the variant's alone (several variants live side by side in one process while their
steps are interleaved; their own groups keep one variant's collectives from ever meeting another's), wraps the model
with the same unit choice (each :class:`~lightning_fsdp.demo.gpt.Block` is a unit, the root takes the rest: embeddings,
final LayerNorm and the tied head) and returns a :class:`Prepared` model. The training loop, the optimizer (AdamW over
``prepared.model.parameters()``) and the data are the benchmark's, identical for all.

The fsdp_custom variants drive this project's engine directly (``lightning_fsdp.engine.fully_shard``) in a plain
torch loop with no Lightning in the way, so the comparison with torch's DDP, FSDP1 and FSDP2 is engine against
engine.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_fsdp.demo.gpt import Block

__all__ = ["Prepared", "Variant", "VARIANTS", "REFERENCE", "engine_options", "parse_variants"]


@dataclass
class Prepared:
    """A wrapped model ready for ``model(x, y) -> (logits, loss)``, and the engine's byte counters if it has them."""

    model: nn.Module
    engine: Any = None  # lightning_fsdp's ShardingEngine for fsdp_custom variants, else None
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Variant:
    """One row of the comparison.

    ``theory`` is the communication a step needs, in multiples of the model's full parameter bytes ``P``,
    per collective kind: ``all_gather`` counts the gathered (full-size) output, ``reduce_scatter`` the full-size
    input, ``all_reduce`` the reduced tensor.
    """

    key: str
    name: str
    setup: Callable[[nn.Module, dist.ProcessGroup], Prepared]
    theory: dict[str, float]
    # "engine": lightning_fsdp's own counters; "counted": torch.distributed's Python collectives counted;
    # "theory": not observable from Python (DDP's reducer calls the process group from C++), theory only.
    comm_source: str


# ------------------------------------------------------------------------------------------- fsdp_custom
def engine_options() -> dict[str, Any]:
    """Prefetch-related options of ``lightning_fsdp.engine.fully_shard`` with their defaults, if it has any.

    The benchmark runs the engine with its defaults; this records which overlap features the measured build has.
    """
    from lightning_fsdp.engine import fully_shard

    names = ("backward_prefetch", "forward_prefetch", "limit_all_gathers")
    params = inspect.signature(fully_shard).parameters
    return {n: repr(params[n].default) for n in names if n in params}


def _custom(model: nn.Module, group: dist.ProcessGroup, strategy: str, **options: Any) -> Prepared:
    from lightning_fsdp.engine import fully_shard

    engine = fully_shard(model, process_group=group, sharding_strategy=strategy, auto_wrap_policy={Block}, **options)
    return Prepared(model=model, engine=engine, notes={"engine_options": engine_options()})


def setup_custom_full_shard(model: nn.Module, group: dist.ProcessGroup) -> Prepared:
    """fsdp_custom, FULL_SHARD: gather before each unit's forward, free, gather again for its backward."""
    return _custom(model, group, "FULL_SHARD")


def setup_custom_full_shard_post(model: nn.Module, group: dist.ProcessGroup) -> Prepared:
    """fsdp_custom, FULL_SHARD with ``backward_prefetch="BACKWARD_POST"``: the next unit's gather starts once a unit's
    backward is done rather than as it begins, so two units' parameters and one unit's gradients are not alive at
    once (less memory, less overlap)."""
    return _custom(model, group, "FULL_SHARD", backward_prefetch="BACKWARD_POST")


def setup_custom_shard_grad_op(model: nn.Module, group: dist.ProcessGroup) -> Prepared:
    """fsdp_custom, SHARD_GRAD_OP: a unit stays gathered from its forward until its backward is done."""
    return _custom(model, group, "SHARD_GRAD_OP")


def setup_custom_no_shard(model: nn.Module, group: dist.ProcessGroup) -> Prepared:
    """fsdp_custom, NO_SHARD: whole model on every rank, gradients all-reduced per unit."""
    return _custom(model, group, "NO_SHARD")


# -------------------------------------------------------------------------------------------------- torch
def setup_ddp(model: nn.Module, group: dist.ProcessGroup) -> Prepared:
    """torch DistributedDataParallel with its defaults (25 MiB gradient buckets, all-reduce overlapped)."""
    from torch.nn.parallel import DistributedDataParallel

    return Prepared(model=DistributedDataParallel(model, process_group=group))


def setup_fsdp1(model: nn.Module, group: dist.ProcessGroup) -> Prepared:
    """torch FSDP1 (``FullyShardedDataParallel``), FULL_SHARD, each Block a unit, original parameters kept."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    wrapped = FullyShardedDataParallel(
        model,
        process_group=group,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
        # device_id=None means "the current accelerator" and raises on a CPU-only build ("FSDP needs a non-CPU
        # accelerator device"); naming the CPU is how torch's own CPU tests run FSDP1.
        device_id=torch.device("cpu"),
    )
    return Prepared(model=wrapped)


def setup_fsdp2(model: nn.Module, group: dist.ProcessGroup) -> Prepared:
    """torch FSDP2 (``torch.distributed.fsdp.fully_shard``) on each Block, then on the root; torch's defaults."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Prepared(model=model)


_SHARDED = {"all_gather": 2.0, "reduce_scatter": 1.0, "all_reduce": 0.0}
_GATHER_ONCE = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 0.0}
_REPLICATED = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 1.0}

VARIANTS: dict[str, Variant] = {
    v.key: v
    for v in (
        Variant("custom_full_shard", "fsdp_custom FULL_SHARD", setup_custom_full_shard, _SHARDED, "engine"),
        Variant(
            "custom_full_shard_post",
            "fsdp_custom FULL_SHARD, BACKWARD_POST",
            setup_custom_full_shard_post,
            _SHARDED,
            "engine",
        ),
        Variant(
            "custom_shard_grad_op", "fsdp_custom SHARD_GRAD_OP", setup_custom_shard_grad_op, _GATHER_ONCE, "engine"
        ),
        Variant("custom_no_shard", "fsdp_custom NO_SHARD", setup_custom_no_shard, _REPLICATED, "engine"),
        Variant("ddp", "torch DDP", setup_ddp, _REPLICATED, "theory"),
        Variant("fsdp1", "torch FSDP1 FULL_SHARD", setup_fsdp1, _SHARDED, "counted"),
        Variant("fsdp2", "torch FSDP2 fully_shard", setup_fsdp2, _SHARDED, "counted"),
    )
}

# Ratios of step time are taken against this variant, and final losses compared with its.
REFERENCE = "custom_full_shard"


def parse_variants(text: str) -> list[str]:
    """``"all"`` or a comma-separated list of variant keys, in the canonical order; ValueError names the choices."""
    if text.strip() == "all":
        return list(VARIANTS)
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in VARIANTS]
    if unknown or not keys:
        raise ValueError(f"unknown variant(s) {unknown or text!r}; choose 'all' or from {', '.join(VARIANTS)}")
    return [k for k in VARIANTS if k in keys]
