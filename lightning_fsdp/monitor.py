"""``ShardingMonitor`` (docs/monitoring.md). CPU has no allocator statistics in torch: there the model-state figures
are the engine's accounting and the process figure RSS."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_fsdp.engine import ShardingEngine, get_engine
from lightning_fsdp.engine.devices import device_runtime

if TYPE_CHECKING:
    from lightning_fsdp.engine.unit import FlatUnit

__all__ = ["ShardingMonitor"]

_COMM_FIELDS = ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes")
# The order of the per-rank vector that is all-gathered; -1 marks "not measured on this device".
QUANTITIES = (
    "param_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "model_state_bytes",
    "gathered_peak_bytes",
    "model_state_peak_bytes",
    "device_peak_bytes",
    "rss_peak_bytes",
    *_COMM_FIELDS,
)
_NOT_MEASURED = -1


class ShardingMonitor(pl.Callback):
    """Logs per-step, per-rank memory of the sharded model state and the bytes each collective moved.

    With another strategy than ``fsdp_custom`` it warns once and logs nothing. The quantities: docs/monitoring.md.

    Args:
        log_every_n_steps: log every this many training batches; ``None`` follows ``Trainer(log_every_n_steps=)``.
            Measuring is cheap; logging costs one small all-gather across ranks.
        prefix: the first part of every metric name.

    Attributes:
        last: the latest values logged, ``{metric name: int}``, on every rank (handy in notebooks and tests).
    """

    def __init__(self, *, log_every_n_steps: int | None = None, prefix: str = "fsdp") -> None:
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} is not valid; expected a positive int or None.")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix={prefix!r} is not valid; expected a non-empty string.")
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self.last: dict[str, int] = {}
        self._engine: ShardingEngine | None = None
        self._restore: list[Callable[[], None]] = []
        self._gathered_peak = 0
        self._comm_at_start: dict[str, int] = {}
        self._batches = 0
        self._rss_reset = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._engine = get_engine(pl_module)
        if self._engine is None:
            rank_zero_warn(
                f"ShardingMonitor needs the fsdp_custom strategy; the trainer uses {type(trainer.strategy).__name__}, "
                "so nothing will be logged."
            )
            return
        self._batches = 0
        self._instrument_gathers(self._engine)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_instrumentation()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Also on a crash mid-fit, so a later run on the same module starts uninstrumented.
        self._remove_instrumentation()

    def _instrument_gathers(self, engine: ShardingEngine) -> None:
        """Sample the full-parameter bytes after every unit gather, when they can peak: wrapping ``unshard`` also sees
        backward's gathers, which module hooks would miss."""
        self._remove_instrumentation()
        for unit in engine.units:
            self._restore.append(_after_each_unshard(unit, lambda: self._sample_gathered(engine)))

    def _sample_gathered(self, engine: ShardingEngine) -> None:
        self._gathered_peak = max(self._gathered_peak, _gathered_bytes(engine))

    def _remove_instrumentation(self) -> None:
        for undo in self._restore:
            undo()
        self._restore.clear()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        engine = self._engine
        if engine is None:
            return
        self._gathered_peak = _gathered_bytes(engine)
        self._comm_at_start = _comm_totals(engine)
        device = engine.root_unit.device
        runtime = device_runtime(device)
        if runtime.memory_is_host:
            self._rss_reset = _reset_rss_peak()
        else:
            runtime.reset_peak_memory_stats(device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if self._engine is None:
            return
        self._batches += 1
        # The same decision on every rank: logging all-gathers, and every rank must join the collective.
        if self.log_every_n_steps is None:
            # Lightning's own rule for when logged metrics reach the loggers (as DeviceStatsMonitor uses it).
            if not trainer._logger_connector.should_update_logs:
                return
        elif self._batches % self.log_every_n_steps != 0:
            return
        values = self._measure(trainer)
        local = torch.tensor([values[q] for q in QUANTITIES], dtype=torch.int64, device=trainer.strategy.root_device)
        per_rank = trainer.strategy.all_gather(local).reshape(trainer.world_size, len(QUANTITIES)).tolist()
        metrics = {
            f"{self.prefix}/rank{rank}/{name}": int(value)
            for rank, row in enumerate(per_rank)
            for name, value in zip(QUANTITIES, row)
            if value != _NOT_MEASURED
        }
        self.last = metrics
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                # The step Lightning logs this batch's own metrics under, so they share rows in a CSV file.
                logger.log_metrics(dict[str, float](metrics), step=trainer.fit_loop.epoch_loop._batches_that_stepped)

    def _measure(self, trainer: pl.Trainer) -> dict[str, int]:
        engine = self._engine
        assert engine is not None
        values = {
            "param_bytes": engine.local_param_bytes(),
            "grad_bytes": engine.local_grad_bytes(),
            "optimizer_state_bytes": _optimizer_state_bytes(trainer.optimizers),
            "gathered_peak_bytes": self._gathered_peak,
        }
        values["model_state_bytes"] = values["param_bytes"] + values["grad_bytes"] + values["optimizer_state_bytes"]
        values["model_state_peak_bytes"] = values["model_state_bytes"] + values["gathered_peak_bytes"]
        device = engine.root_unit.device
        runtime = device_runtime(device)
        values["device_peak_bytes"] = _NOT_MEASURED
        values["rss_peak_bytes"] = _NOT_MEASURED
        if runtime.memory_is_host and self._rss_reset:
            peak = proc_bytes("/proc/self/status", "VmHWM:")
            values["rss_peak_bytes"] = _NOT_MEASURED if peak is None else peak
        elif not runtime.memory_is_host:
            peak = runtime.max_memory_allocated(device)
            values["device_peak_bytes"] = _NOT_MEASURED if peak is None else peak
        now = _comm_totals(engine)
        for field in _COMM_FIELDS:
            values[field] = now[field] - self._comm_at_start.get(field, now[field])
        return values


def _after_each_unshard(unit: FlatUnit, sample: Callable[[], None]) -> Callable[[], None]:
    """Run ``sample`` after every ``unit.unshard()``; returns what undoes it. The engine calls ``unshard`` through the
    unit, and offers no hook after a gather (engine/unit.py), so the wrapper is an attribute of this unit that shadows
    the class's method. Undoing deletes it (``delattr``), so that the class's method is found again: setting the
    original bound method back would leave an attribute on the unit that refers to the unit itself."""
    original = unit.unshard

    def unshard() -> None:
        original()
        sample()

    # The instance attribute shadowing the method is the instrumentation itself (see above), not a mistake.
    unit.unshard = unshard  # type: ignore[method-assign]

    def undo() -> None:
        if "unshard" in vars(unit):  # already gone if another monitor's undo ran first
            delattr(unit, "unshard")

    return undo


def _gathered_bytes(engine: ShardingEngine) -> int:
    # A freed unit's full buffer has a zero-byte storage (and an unsharded fp32 unit's is empty).
    return sum(u.full_flat.untyped_storage().nbytes() for u in engine.units)


def _comm_totals(engine: ShardingEngine) -> dict[str, int]:
    # The secondary group's gathers (reshard_after_forward=N) are bytes this rank sent too.
    comms = [c for c in (engine.shard_comm, engine.replicate_comm, engine.secondary_comm) if c is not None]
    return {field: sum(getattr(c.stats, field) for c in comms) for field in _COMM_FIELDS}


def _optimizer_state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    seen: set[int] = set()
    total = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    total += value.numel() * value.element_size()
    return total


def _reset_rss_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0); False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_bytes(path: str, field: str) -> int | None:
    """A figure that a ``/proc`` file reports in kB (the line starting with ``field``), in bytes; None if unknown."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
