"""Asynchronous checkpoint saves (``FSDPStrategy(async_checkpoint=True)``, or Lightning's ``AsyncCheckpointIO``
plugin): a save returns once this rank's state is copied into host memory; the files are written by a background
thread while training goes on (docs/checkpoints.md, "Asynchronous saves").

[Note: asynchronous saves]
As DCP's ``async_save`` (``DefaultStager``) and torchtitan's checkpoint manager do it, a save has two parts:

- *staging*, on the training thread: every tensor of the checkpoint dict (this rank's shards, optimizer state, and
  in the full format rank 0's gathered copy) is copied into a host buffer (pinned where the device's runtime pins),
  and everything else of the format that reads the live run is done (``CheckpointFormat.prepare_save``). The buffers
  are kept, keyed by where each tensor sits in the checkpoint, and reused by the next save when shape and dtype
  match: staging memory is one host copy of what this rank writes, held from the first save until teardown.
- *writing*, on one background thread per strategy: the format's write, its collectives over a gloo group of every
  rank made for it at the first save (``collectives_over``), so that they never meet the training's collectives.

Only one save is in flight. The next save, a load, the end of ``fit`` and teardown wait for it; a failure of the
write is raised there (teardown, which runs after errors too, only warns). The write is atomic as every save is (a
temporary directory renamed into place, or a commit object), so a failed write leaves the previous checkpoint as it
was. A removal asked for while a save is in flight (``ModelCheckpoint``'s ``save_top_k`` removing the checkpoint
the new one replaces) runs after that save, and only if it succeeded.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_fsdp.checkpoint import Checkpoint
from lightning_fsdp.collective import Collective, collectives_over, raised_alike_on_every_rank

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "AsyncCheckpointer",
    "AsyncSaveError",
    "StagingBuffers",
    "after_saves",
    "background_writer",
    "fitting_now",
    "runs_async",
    "writing_io",
]

_Key = tuple[Any, ...]


def runs_async(async_checkpoint: bool, checkpoint_io: CheckpointIO) -> bool:
    """Whether saves are asynchronous: ``async_checkpoint=True``, or Lightning's ``AsyncCheckpointIO`` plugin (which
    means the same here: the strategy stages and writes in the background itself)."""
    return async_checkpoint or isinstance(checkpoint_io, AsyncCheckpointIO)


def fitting_now(trainer: Trainer | None) -> bool:
    """Whether ``trainer`` is inside ``fit`` (its validation included): saves are asynchronous only there, where
    the end of ``fit`` waits for them; elsewhere (a save after ``fit``) they are written at once."""
    return (
        trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
    )


def background_writer(
    writer: AsyncCheckpointer | None, wanted: bool, pin: Callable[[torch.device], bool]
) -> AsyncCheckpointer | None:
    """The writer for the next save: ``writer`` (made now if there is none) where an asynchronous save is
    ``wanted``; otherwise ``writer`` once what it has in flight is written (its failure raised), as the next save is
    written at once."""
    if wanted:
        return writer or AsyncCheckpointer(pin)
    if writer is not None:
        writer.wait()
    return writer


def after_saves(writer: AsyncCheckpointer | None, work: Callable[[], None]) -> None:
    """``work()`` now, or after the save ``writer`` has in flight (and only if that save succeeds)."""
    if writer is None:
        work()
    else:
        writer.after_save(work)


def writing_io(checkpoint_io: CheckpointIO) -> CheckpointIO:
    """The ``CheckpointIO`` a full checkpoint's file is written through: inside Lightning's ``AsyncCheckpointIO``, the
    one it wraps (the strategy's own background writer replaces the plugin's thread)."""
    if isinstance(checkpoint_io, AsyncCheckpointIO) and checkpoint_io.checkpoint_io is not None:
        return checkpoint_io.checkpoint_io
    return checkpoint_io


class StagingBuffers:
    """Host copies of a checkpoint's tensors, kept between saves: the copy of the tensor at a given place in the
    checkpoint reuses the previous save's buffer when shape and dtype match."""

    def __init__(self, pin: Callable[[torch.device], bool]) -> None:
        self._pin = pin  # whether host buffers for tensors of a device are pinned (the device runtime's answer)
        self._buffers: dict[_Key, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """The host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, checkpoint: Checkpoint) -> Checkpoint:
        """A copy of ``checkpoint`` that shares nothing mutable with the live run: tensors copied into the buffers
        (a DTensor: its local shard, re-wrapped alike), containers rebuilt, other values deep-copied where they can
        be (as they are otherwise)."""
        staged = self._copy(checkpoint, ())
        assert isinstance(staged, dict)
        return staged

    def _copy(self, value: object, key: _Key) -> object:
        if isinstance(value, DTensor):
            local = self._tensor(value.to_local(), key)
            return DTensor.from_local(
                local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
        if isinstance(value, torch.Tensor):
            return self._tensor(value, key)
        if isinstance(value, Mapping):
            # The same mapping class (ShardedStateDict and friends keep their attributes through copy.copy).
            out = copy.copy(value)
            for k, v in value.items():
                out[k] = self._copy(v, (*key, k))  # type: ignore[index]
            return out
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self._copy(v, (*key, i)) for i, v in enumerate(value))
        try:
            return copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - an object that cannot be copied is written as it is
            return value

    @torch.no_grad()
    def _tensor(self, tensor: torch.Tensor, key: _Key) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type != "cpu" and self._pin(tensor.device)
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=buffer.is_pinned())
        return buffer

    def synchronize(self, device: torch.device) -> None:
        """Wait for the non-blocking copies from ``device`` into pinned buffers."""
        if device.type != "cpu":
            module = getattr(torch, device.type, None)
            sync = getattr(module, "synchronize", None)
            if sync is not None:
                sync(device)


@raised_alike_on_every_rank
class AsyncSaveError(RuntimeError):
    """A checkpoint write running in the background failed; raised at the next save, load or the end of ``fit``."""


class AsyncCheckpointer:
    """The strategy's background writer: one save in flight, the removals waiting for it, the staging buffers and
    the process group of the writes ([Note: asynchronous saves])."""

    def __init__(self, pin: Callable[[torch.device], bool]) -> None:
        self.staging = StagingBuffers(pin)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._group: ProcessGroup | None = None

    def _writes_group(self) -> ProcessGroup | None:
        # Made at the first save, which every rank reaches together (a collective).
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def wait(self) -> None:
        """Wait for the save in flight and what waits for it; raise the first failure among them, on every rank
        (call on every rank): a full checkpoint is written by rank 0 alone, whose failure the others must share."""
        problem: BaseException | None = None
        try:
            self._wait_here()
        except BaseException as exc:  # noqa: BLE001 - shared with every rank by agree (DCP's CheckpointException)
            problem = exc
        Collective().agree(problem)

    def _wait_here(self) -> None:
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for future in pending:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - the first is raised after all have finished
                error = error or exc
        if error is not None:
            raise error

    def submit(
        self,
        checkpoint: Checkpoint,
        path: object,
        device: torch.device,
        prepare: Callable[[Checkpoint], Callable[[], None]],
    ) -> None:
        """Wait for the previous save (raising its failure), stage ``checkpoint`` and ``prepare(staged)`` on this
        thread, and start the write to ``path`` that ``prepare`` returned in the background."""
        self.wait()
        staged = self.staging.stage(checkpoint)
        self.staging.synchronize(device)
        write = prepare(staged)
        group = self._writes_group()

        def run() -> None:
            try:
                with collectives_over(group) if group is not None else contextlib.nullcontext():
                    write()
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                raise AsyncSaveError(
                    f"The asynchronous save of checkpoint {str(path)!r} failed in the background: "
                    f"{type(exc).__name__}: {exc}. Whatever was at that path before is unchanged."
                ) from exc

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-fsdp-checkpoint")
        self._pending.append(self._executor.submit(run))

    def after_save(self, work: Callable[[], None]) -> None:
        """``work()`` now if no save is in flight; else after it, on the writer thread, only if it succeeded."""
        if not self._pending or self._executor is None:
            work()
            return
        before = list(self._pending)

        def run() -> None:
            if all(f.exception() is None for f in before):
                work()

        self._pending.append(self._executor.submit(run))

    def close(self, *, raise_errors: bool) -> None:
        """Wait for what is in flight and stop the writer thread; a failure is raised, or only warned about."""
        try:
            self._wait_here()  # no collective: after an error the ranks may be apart
        except BaseException as exc:
            if raise_errors:
                raise
            warnings.warn(f"An asynchronous checkpoint save failed: {type(exc).__name__}: {exc}", stacklevel=2)
        finally:
            if self._executor is not None and not self._pending:
                self._executor.shutdown(wait=True)
                self._executor = None
