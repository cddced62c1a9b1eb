"""What the module holds when a Trainer stage ends normally: the ``weights_after_stage`` option (docs/options.md).
``"auto"`` gathers only if the model times the node's local ranks fits in free host memory: a model that only fits
sharded would otherwise end its training in an out-of-memory kill."""

from __future__ import annotations

import os
import weakref

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_fsdp.collective import Collective
from lightning_fsdp.engine import ShardingEngine, get_engine
from lightning_fsdp.engine.sharding import has_meta_tensors
from lightning_fsdp.monitor import proc_bytes
from lightning_fsdp.weight_averaging import restore_averaged_models

CHOICES = ("auto", "full", "rank0", "sharded")
# Test hook and escape hatch: the free host memory in bytes, instead of what the system reports.
FREE_MEMORY_VARIABLE = "LIGHTNING_FSDP_FREE_HOST_MEMORY"
# The rest is left to the page cache, the allocator's slack and other processes.
SAFETY_FACTOR = 0.75


# Modules a "rank0" stage end left meta on other ranks: sharding again would silently re-initialise them there.
_RANK0_ONLY: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def check_reusable(module: nn.Module) -> None:
    """Refuse, on every rank before any collective, a stage on a module whose weights only rank 0 kept."""
    if module in _RANK0_ONLY:
        raise ValueError(
            f"{type(module).__name__} ended its last stage with weights_after_stage='rank0': only rank 0 holds its "
            "weights, the other ranks' parameters are on the meta device. Run further stages on a new module (load "
            "the weights into it, e.g. from a checkpoint), or end the earlier stage with weights_after_stage="
            "'sharded' or 'full'."
        )


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def free_host_memory() -> int | None:
    """Bytes of host memory available to new allocations without swapping (``MemAvailable``), None if unknown."""
    override = os.environ.get(FREE_MEMORY_VARIABLE)
    if override is not None:
        return int(override)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return proc_bytes("/proc/meminfo", "MemAvailable:")


class StageEnd:
    """Carries out ``weights_after_stage`` in ``FSDPStrategy.teardown``; a failed stage always stays sharded."""

    def __init__(self, choice: str, pipeline_parallel_size: int = 1) -> None:
        if not isinstance(choice, str) or choice not in CHOICES:
            raise ValueError(
                f"weights_after_stage={choice!r} is not valid; expected one of {', '.join(map(repr, CHOICES))}."
            )
        self.choice = choice
        if choice == "rank0" and pipeline_parallel_size > 1:
            # Rank 0 holds only its own stages: the other stages' weights would be kept nowhere.
            raise ValueError(
                "weights_after_stage='rank0' is not valid with pipeline_parallel_size="
                f"{pipeline_parallel_size}: rank 0 holds only its own pipeline stages; use 'full' or 'sharded'."
            )
        self.failed = False  # on_exception ran: the ranks may not all reach teardown, so no collective

    def resolve(self, engine: ShardingEngine, local_ranks: int) -> str:
        """``"auto"`` as ``"full"`` or ``"sharded"``, agreed by every rank (each node reads its own free memory)."""
        if self.choice != "auto":
            return self.choice
        needed = engine.full_param_bytes() * local_ranks
        free = free_host_memory()
        verdicts = Collective().all_gather((free is not None and needed <= SAFETY_FACTOR * free, needed, free))
        if all(fits for fits, _, _ in verdicts):
            return "full"
        _, needed, free = next(v for v in verdicts if not v[0])
        free_text = "an unknown amount" if free is None else _size(free)
        rank_zero_warn(
            f"weights_after_stage='auto': the full model on every local rank ({_size(needed)}) does not fit "
            f"in {SAFETY_FACTOR:.0%} of the {free_text} of free host memory, so the module stays sharded with its "
            "engine after this stage (a later trainer.fit/validate/test/predict on it works). To get the weights: "
            "save a sharded checkpoint (state_dict_type='sharded', trainer.save_checkpoint) and convert it with "
            "`lightning-fsdp export`, or pass weights_after_stage='rank0' (rank 0 only) or 'full'."
        )
        return "sharded"

    def finish(self, module: nn.Module | None, local_ranks: int, rank: int) -> bool:
        """Leave ``module`` as the option says; True if it now holds ordinary host-movable tensors only."""
        engine = get_engine(module) if module is not None else None
        failed, self.failed = self.failed, False
        if module is not None and engine is not None and not failed:
            choice = self.resolve(engine, local_ranks)
            if choice != "sharded":
                restore_averaged_models(getattr(module, "_trainer", None), engine)  # SWA / EMA averages: whole too
                keep = choice == "full" or rank == 0
                # The other ranks take part in each unit's all-gather, then keep parameters without storage.
                engine.restore_unsharded(torch.device("cpu") if keep else torch.device("meta"))
                if not keep:
                    _buffers_to_host(module)
                if choice == "rank0":
                    _RANK0_ONLY.add(module)
                engine = None
        return engine is None and not (module is not None and has_meta_tensors(module))


def _buffers_to_host(module: nn.Module) -> None:
    # What Lightning's own move to the host would do, which meta parameters refuse.
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and not buffer.is_meta:
                sub._buffers[name] = buffer.cpu()
