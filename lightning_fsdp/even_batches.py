"""Every rank must run the same batches: uneven inputs end with the same :class:`UnevenBatchesError` on every rank, not
a hang. The two checks (batch counts when a loop starts, then per batch where counts cannot settle it):
docs/patterns.md ("Uneven inputs"); what is not covered: docs/reliability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loops import _EvaluationLoop, _PredictionLoop
from lightning.pytorch.loops.fetchers import _DataFetcher, _DataLoaderIterDataFetcher, _PrefetchDataFetcher
from lightning.pytorch.trainer.states import RunningStage

from lightning_fsdp.engine.comm import all_gather_flat

# The loops checked: each one's name in the messages and the Trainer argument that caps it.
_LOOPS = {
    RunningStage.TRAINING: ("training", "limit_train_batches"),
    RunningStage.SANITY_CHECKING: ("sanity-check validation", "num_sanity_val_steps"),
    RunningStage.VALIDATING: ("validation", "limit_val_batches"),
    RunningStage.TESTING: ("test", "limit_test_batches"),
    RunningStage.PREDICTING: ("predict", "limit_predict_batches"),
}
_STAGES = tuple(_LOOPS)
_CODES = {stage: code for code, stage in enumerate(_STAGES, start=1)}
_WORDS = {stage: words for stage, (words, _limit) in _LOOPS.items()}
_UNKNOWN = -1  # a count or an index that this rank does not know


class UnevenBatchesError(RuntimeError):
    """The ranks do not have the same batches. Raised on every rank, with the same message, before any rank waits
    in a collective that the others would not join."""


def _advice(stage: RunningStage) -> str:
    text = (
        "Every rank must run the same number of batches. Let Lightning shard map-style data with a "
        "DistributedSampler (Trainer(use_distributed_sampler=True), the default) or use one yourself; with per-rank "
        "datasets of different lengths, cut them to a common length (DistributedSampler(drop_last=True), or "
        "DataLoader(drop_last=True) where they differ by less than a batch); make an IterableDataset yield the same "
        "number of batches on every rank (split the stream per rank and stop every rank at the shortest share); "
        f"or cap the loop with Trainer({_LOOPS[stage][1]}=N), N at most the smallest count."
    )
    if stage is RunningStage.PREDICTING:
        text += (
            " Trainer.predict's own sampler does not repeat samples: with it, a dataset whose length is a "
            "multiple of the world size splits evenly."
        )
    return text


def _per_rank(values: Iterable[object]) -> str:
    return ", ".join(f"rank {r}: {value}" for r, value in enumerate(values))


def _ranks(ranks: Sequence[int]) -> str:
    names = [f"rank {r}" for r in ranks]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _count(value: int) -> str:
    return "no length" if value == _UNKNOWN else str(value)


def _next_batch_identity(fetcher: _PrefetchDataFetcher) -> tuple[int, int, int]:
    """(more batches follow, next batch's dataloader index, next batch's index) from a prefetching fetcher."""
    if fetcher.done or not fetcher.batches:
        return 0, _UNKNOWN, _UNKNOWN
    item = fetcher.batches[0]  # what the CombinedLoader yielded: (batch, batch_idx, dataloader_idx)
    if isinstance(item, tuple) and len(item) == 3 and isinstance(item[1], int) and isinstance(item[2], int):
        return 1, item[2], item[1]
    return 1, _UNKNOWN, _UNKNOWN


class EvenBatches:
    """The checks of one strategy. ``device`` returns where the world group's collectives take tensors. Each hook
    takes the LightningModule's trainer, and does nothing without one."""

    def __init__(self, device: Callable[[], torch.device]) -> None:
        self._device = device
        self._per_batch: dict[RunningStage, bool] = {}  # loops that are checked batch by batch
        self._notes: dict[RunningStage, str] = {}  # what the messages say about each rank's counts
        self._train_epoch: int | None = None  # the training epoch whose counts were compared last

    def loop_started(self, trainer: pl.Trainer | None) -> None:
        """Compare the ranks' batch counts for the loop that is starting; decide whether to check per batch."""
        stage = self._checked_stage(trainer)
        if trainer is None or stage is None:
            return
        if stage is RunningStage.TRAINING:
            self._train_epoch = trainer.current_epoch
        self._compare_counts(trainer, stage, first_batch=True)

    def before_step(self, trainer: pl.Trainer | None) -> None:
        """Called by the strategy's ``*_step`` before the model's step on every rank."""
        stage = self._checked_stage(trainer)
        if trainer is None or stage is None:
            return
        if stage is RunningStage.TRAINING:
            epoch_loop = trainer.fit_loop.epoch_loop
            if epoch_loop.batch_idx == 0 and trainer.current_epoch != self._train_epoch:
                # A later epoch: the loaders may have been reloaded (reload_dataloaders_every_n_epochs).
                self._train_epoch = trainer.current_epoch
                self._compare_counts(trainer, stage, first_batch=False)
            if not trainer.lightning_module.automatic_optimization:
                return  # after_step: the user's step decides how many optimizer steps this batch makes
        self._check_batch(trainer, stage)

    def after_step(self, trainer: pl.Trainer | None) -> None:
        """Called by the strategy's ``training_step`` after the user's step; only manual optimization checks here."""
        stage = self._checked_stage(trainer)
        if trainer is None or stage is not RunningStage.TRAINING:
            return
        if not trainer.lightning_module.automatic_optimization:
            self._check_batch(trainer, stage)

    @staticmethod
    def _checked_stage(trainer: pl.Trainer | None) -> RunningStage | None:
        """The loop running now, if it is one these checks cover in a distributed run."""
        if trainer is None or not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
            return None
        return trainer.state.stage if trainer.state.stage in _CODES else None

    def _gather(self, values: list[int]) -> list[list[int]]:
        world = dist.get_world_size()
        mine = torch.tensor(values, dtype=torch.int64, device=self._device())
        every = torch.empty(world * len(values), dtype=torch.int64, device=mine.device)
        all_gather_flat(every, mine)
        return every.view(world, len(values)).tolist()

    @staticmethod
    def _loop_state(trainer: pl.Trainer, stage: RunningStage) -> tuple[list[int | float], _DataFetcher | None, int]:
        """(batch counts per dataloader, the loop's data fetcher, position of the current batch in the loop)."""
        if stage is RunningStage.TRAINING:
            fit = trainer.fit_loop
            return [fit.max_batches], fit._data_fetcher, fit.epoch_loop.batch_idx
        loop: _EvaluationLoop | _PredictionLoop
        if stage is RunningStage.TESTING:
            loop = trainer.test_loop
        elif stage is RunningStage.PREDICTING:
            loop = trainer.predict_loop
        else:
            loop = trainer._evaluation_loop  # fit's validation loop (sanity check too) or trainer.validate's
        return list(loop.max_batches), loop._data_fetcher, loop.batch_progress.current.ready - 1

    def _compare_counts(self, trainer: pl.Trainer, stage: RunningStage, first_batch: bool) -> None:
        counts, fetcher, _ = self._loop_state(trainer, stage)
        known = [_UNKNOWN if c == float("inf") else int(c) for c in counts]
        # A fetcher that fetches ahead of a loader without a length: the next batch is known before the step.
        ahead = fetcher if isinstance(fetcher, _PrefetchDataFetcher) and fetcher.length is None else None
        lookahead = ahead is not None and bool(ahead.prefetch_batches)
        iter_steps = isinstance(fetcher, _DataLoaderIterDataFetcher)
        has_first, first_dl, first_idx = (
            _next_batch_identity(ahead) if ahead is not None and lookahead and first_batch else (1, -1, -1)
        )
        header = [_CODES[stage], len(known), int(lookahead), int(iter_steps), has_first, first_dl, first_idx]
        headers = self._gather(header)
        width = max(row[1] for row in headers)
        rows = self._gather(known + [_UNKNOWN] * (width - len(known))) if width else [[] for _ in headers]
        words = _WORDS[stage]

        if len({row[0] for row in headers}) > 1:
            listing = _per_rank(_WORDS[_STAGES[row[0] - 1]] for row in headers)
            raise UnevenBatchesError(
                f"Uneven inputs: the ranks are starting different loops ({listing}); an earlier loop ended on some "
                f"ranks before others. {_advice(stage)}"
            )
        if len({row[1] for row in headers}) > 1:
            listing = _per_rank(row[1] for row in headers)
            raise UnevenBatchesError(
                f"Uneven inputs: the ranks have different numbers of {words} dataloaders ({listing}). {_advice(stage)}"
            )
        every_count = "; ".join(
            (f"dataloader {j}: " if width > 1 else "") + _per_rank(_count(row[j]) for row in rows) for j in range(width)
        )
        uneven_but_may_stop = False
        for j in range(width):
            column = [row[j] for row in rows]
            if len(set(column)) == 1:
                continue
            where = f" in {words} dataloader {j}" if width > 1 else ""
            listing = _per_rank(_count(c) for c in column)
            if _UNKNOWN in column:
                what = f"{words} dataloader {j}" if width > 1 else f"{words} loader"
                raise UnevenBatchesError(
                    f"Uneven inputs: the {what} has a length on some ranks and none on others (batches per rank: "
                    f"{listing}). Give every rank the same kind of loader. {_advice(stage)}"
                )
            fewest = min(column)
            if stage is RunningStage.TRAINING and _max_steps_may_end_first(trainer, fewest):
                uneven_but_may_stop = True  # decided batch by batch: max_steps may end the run in time
                continue
            short = [r for r, c in enumerate(column) if c == fewest]
            if stage is RunningStage.TRAINING and trainer.current_epoch > 0:
                where += f" in epoch {trainer.current_epoch}"  # the loaders were reloaded
            raise UnevenBatchesError(
                f"Uneven inputs: the ranks have different numbers of {words} batches{where} ({listing}). "
                f"{_ranks(short).capitalize()} would run out of batches after {fewest}, and the other ranks would "
                f"then wait for {'it' if len(short) == 1 else 'them'} in the next collective until the "
                f"process-group timeout. {_advice(stage)}"
            )
        if any(row[3] for row in headers):
            self._per_batch[stage] = False  # dataloader_iter steps: nothing is known ahead of the step
            return
        lookahead_any = any(row[2] for row in headers)
        self._per_batch[stage] = lookahead_any or uneven_but_may_stop
        if uneven_but_may_stop:
            self._notes[stage] = (
                f" Batches per rank: {every_count}; checked batch by batch, as max_steps might "
                "have ended training first, which it did not."
            )
        elif any(c != _UNKNOWN for row in rows for c in row):
            self._notes[stage] = (
                f" Batches per rank: {every_count}. A loader without a length (an "
                "IterableDataset) shows its count only as its batches are fetched, one batch ahead."
            )
        else:
            self._notes[stage] = (
                " The loader has no length (an IterableDataset), so its count shows only as its "
                "batches are fetched, one batch ahead."
            )
        if lookahead_any and first_batch:
            epoch = f" in epoch {trainer.current_epoch}" if stage is RunningStage.TRAINING else ""
            self._check_rows([[_CODES[stage], -1, *row[4:7]] for row in headers], stage, epoch)

    def _check_batch(self, trainer: pl.Trainer, stage: RunningStage) -> None:
        if not self._per_batch.get(stage):
            return
        _, fetcher, position = self._loop_state(trainer, stage)
        assert fetcher is not None  # the loop is running
        if isinstance(fetcher, _PrefetchDataFetcher) and fetcher.length is None:
            more, next_dl, next_idx = _next_batch_identity(fetcher)
        else:  # a length is known (uneven counts under max_steps): the fetcher counts
            more, next_dl, next_idx = int(not fetcher.done), _UNKNOWN, _UNKNOWN
        if more and stage is RunningStage.TRAINING and _training_ends_after_this_batch(trainer):
            more, next_dl, next_idx = 0, _UNKNOWN, _UNKNOWN  # every rank stops here anyway
        epoch = f" in epoch {trainer.current_epoch}" if stage is RunningStage.TRAINING else ""
        self._check_rows(self._gather([_CODES[stage], position, more, next_dl, next_idx]), stage, epoch)

    def _check_rows(self, rows: list[list[int]], stage: RunningStage, epoch: str = "") -> None:
        """rows: per rank [loop, position (-1: before the first batch), more follow, next dataloader, next index]."""
        if all(row == rows[0] for row in rows):
            return
        words = _WORDS[stage]
        note = self._notes.get(stage, "")
        if any(row[:2] != rows[0][:2] for row in rows):
            listing = _per_rank(f"{_WORDS[_STAGES[row[0] - 1]]} batch {row[1] + 1}" for row in rows)
            raise UnevenBatchesError(
                f"Uneven inputs: the ranks are at different batches ({listing}); the loaders yielded different "
                f"numbers of batches earlier on.{note} {_advice(stage)}"
            )
        position = rows[0][1]
        done = [r for r, row in enumerate(rows) if not row[2]]
        going = [r for r, row in enumerate(rows) if row[2]]
        if done and going:
            after = "before its first batch" if position < 0 else f"after {position + 1} batches"
            if len(done) > 1:
                after = after.replace("its", "their")
            raise UnevenBatchesError(
                f"Uneven inputs: {_ranks(done)} ran out of {words} batches {after}{epoch}, while {_ranks(going)} "
                f"still {'has' if len(going) == 1 else 'have'} more (at least {position + 2}), and would wait for "
                f"{'it' if len(done) == 1 else 'them'} in the next collective until the process-group timeout."
                f"{note} {_advice(stage)}"
            )
        listing = _per_rank(f"batch {row[4]} of dataloader {row[3]}" for row in rows)
        first = min(row[3] for row in rows)
        moved = [r for r, row in enumerate(rows) if row[3] != first]
        raise UnevenBatchesError(
            f"Uneven inputs: the ranks' next {words} batches differ ({listing}): {_ranks(moved)} ran out of "
            f"batches of dataloader {first} first.{note} {_advice(stage)}"
        )


def _max_steps_may_end_first(trainer: pl.Trainer, fewest: int) -> bool:
    """Whether ``max_steps`` may end training before the rank with ``fewest`` batches runs out. Automatic
    optimization makes at most one optimizer step per batch, so it cannot when more steps remain than that rank has
    batches; under manual optimization the user's step decides, so it may."""
    max_steps = trainer.fit_loop.max_steps
    if max_steps is None or max_steps < 0:
        return False
    if not trainer.lightning_module.automatic_optimization:
        return True
    return max_steps - trainer.fit_loop.epoch_loop.global_step <= fewest


def _training_ends_after_this_batch(trainer: pl.Trainer) -> bool:
    """Whether ``max_steps`` is reached with this batch. Ranks that agree on it stop together; a rank at its last
    batch also steps where the others would accumulate, and so may stop alone, which is then reported."""
    epoch_loop = trainer.fit_loop.epoch_loop
    max_steps = epoch_loop.max_steps
    if max_steps is None or max_steps < 0:
        return False
    steps = epoch_loop.global_step  # before this batch's step under automatic optimization, after it under manual
    if trainer.lightning_module.automatic_optimization and not epoch_loop._should_accumulate():
        steps += 1
    return steps >= max_steps
