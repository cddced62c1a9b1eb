"""Uneven inputs (ranks with different numbers of batches) end with the same error on every rank, within seconds,
instead of a hang until the process-group timeout (lightning_fsdp/even_batches.py).

tests/scripts/uneven_run.py is a user's script: ``Trainer(strategy=FSDPStrategy(...), devices=2, accelerator="cpu",
use_distributed_sampler=False)``, started as a script (Lightning's launcher re-runs it for rank 1), each rank with its
own DataLoaders. Three uneven cases run on their own and must end the job: non-zero exit soon after the loop
started, the error printed by both ranks, naming the rank that runs out, and no process left behind. One more launch
runs the cases that must not raise (even counts, map-style and IterableDataset; uneven counts that max_steps cuts
short in time) and uneven cases whose error each rank catches and carries on after: both ranks must have caught the
same message, and a last even run after them must still train.

The four launches start together (they are mostly imports, which overlap well on the 2 test cores) and every
process group is killed at the end, whatever happened. The script's process-group timeout is 120 s, so a check that
misses shows up as this file's time limit, not as gloo's error.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from lightning.pytorch.trainer.states import RunningStage

from benchmarks.ranks import group_members, kill_group
from lightning_fsdp.even_batches import EvenBatches, UnevenBatchesError
from tests.toolbox.launch import SCRIPTS, start_logged

SCRIPT = SCRIPTS / "uneven_run.py"
STARTUP_S = 240  # imports and process-group set-up of 4 jobs at once on 2 loaded cores, before the first loop
END_S = 30  # from the first loop's start to the job's exit: the check, teardown, interpreter exit (not 30 minutes)
FAILING = ["train-map", "train-iterable", "val-map"]
ADVICE = ["use_distributed_sampler=True", "drop_last=True", "IterableDataset"]


class Job:
    """One launch of the script in a session of its own, its output in a file (not a pipe a leftover could hold)."""

    def __init__(self, folder: Path, case: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.case, self.out, self.log = case, folder / "result", folder / "output.log"
        self.proc = start_logged([sys.executable, SCRIPT, "--case", case, "--out", self.out], self.log, cwd=folder)
        self.started = time.time()
        self.ended: float | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self, event: str) -> list[dict]:
        found = []
        for line in self.output().splitlines():
            m = re.match(rf"UNEVEN-RUN rank=(\d) event={event} pid=\d+ t=([\d.]+)(.*)", line)
            if m:
                fields = dict(re.findall(r' (\w+)=("(?:[^"\\]|\\.)*"|\S+)', m.group(3)))
                found.append(
                    {"rank": int(m.group(1)), "t": float(m.group(2)), **{k: json.loads(v) for k, v in fields.items()}}
                )
        return found

    def wait(self) -> None:
        """Until the job ends, or STARTUP_S passed without a loop start, or END_S after the first loop start."""
        while self.proc.poll() is None:
            starts = self.events("start")
            limit = min(s["t"] for s in starts) + END_S if starts else self.started + STARTUP_S
            if time.time() > limit:
                return
            time.sleep(0.1)
        if self.ended is None:
            self.ended = time.time()

    def results(self, rank: int) -> dict:
        return json.loads(Path(f"{self.out}.rank{rank}").read_text())

    def report(self) -> str:
        return f"--- {self.case} (rc={self.proc.poll()}):\n{self.output()[-6000:]}"

    def close(self) -> None:
        kill_group(self.proc.pid)
        self.proc.wait()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uneven")
    started = {case: Job(folder / case, case) for case in [*FAILING, "ok"]}
    yield started
    for job in started.values():
        job.close()


def _check_job_ended_on_both_ranks(job: Job) -> str:
    job.wait()
    assert job.ended is not None, f"the job did not end in time:\n{job.report()}"
    starts = job.events("start")
    assert starts, job.report()
    elapsed = job.ended - min(s["t"] for s in starts)
    print(
        f"\n[uneven] {job.case}: the job ended {elapsed:.1f} s after its first loop started, rc={job.proc.returncode}"
    )
    assert job.proc.returncode != 0, job.report()
    errors = job.events("error")
    assert sorted(e["rank"] for e in errors) == [0, 1], job.report()  # both ranks raised it
    assert errors[0]["message"] == errors[1]["message"], job.report()  # the same message
    assert elapsed <= END_S
    assert "Timed out" not in job.output(), job.report()
    # Nothing left behind: rank 1 is rank 0's child, in the same process group.
    deadline = time.monotonic() + 5
    while group_members(job.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(job.proc.pid) == [], f"processes left behind:\n{job.report()}"
    message = errors[0]["message"]
    for fragment in ADVICE:
        assert fragment in message, message
    return message


def test_map_style_training_loaders_of_3_and_2_batches(jobs):
    message = _check_job_ended_on_both_ranks(jobs["train-map"])
    # Raised when training starts, from the counts, before any step.
    assert message.startswith(
        "Uneven inputs: the ranks have different numbers of training batches "
        "(rank 0: 3, rank 1: 2). Rank 1 would run out of batches after 2"
    ), message
    assert "limit_train_batches=N" in message


def test_iterable_training_data_of_3_and_2_batches(jobs):
    message = _check_job_ended_on_both_ranks(jobs["train-iterable"])
    # No length: found one batch ahead, at the last batch both ranks have.
    assert message.startswith(
        "Uneven inputs: rank 1 ran out of training batches after 2 batches in epoch 0, while "
        "rank 0 still has more (at least 3)"
    ), message
    assert (
        "The loader has no length (an IterableDataset), so its count shows only as its batches are fetched" in message
    )


def test_uneven_validation_batches(jobs):
    message = _check_job_ended_on_both_ranks(jobs["val-map"])
    assert message.startswith(
        "Uneven inputs: the ranks have different numbers of validation batches "
        "(rank 0: 3, rank 1: 2). Rank 1 would run out"
    ), message
    assert "limit_val_batches=N" in message


# (case, expected training steps) that must run without an error
OK = [
    ("0:even-map", 6),
    ("1:even-iterable", 6),
    ("2:even-validate-test-predict", None),
    ("3:even-manual-iterable", 6),
    ("4:even-dataloader-iter", 3),
    ("5:even-reloaded", 5),
    ("6:max-steps-map", 2),
    ("7:max-steps-iterable", 2),
    ("8:max-steps-manual-map", 4),
    ("9:predict-map-no-shard", None),
    ("18:even-map", 6),
]
# (case, start of the message) for the uneven cases each rank caught
CAUGHT = [
    (
        "10:max-steps-late-map",
        "Uneven inputs: rank 1 ran out of training batches after 2 batches in epoch 0, while "
        "rank 0 still has more (at least 3), and would wait for it in the next collective until "
        "the process-group timeout. Batches per rank: rank 0: 3, rank 1: 2; checked batch by "
        "batch, as max_steps might have ended training first, which it did not.",
    ),
    ("11:max-steps-late-iterable", "Uneven inputs: rank 1 ran out of training batches after 2 batches in epoch 0"),
    ("12:manual-iterable", "Uneven inputs: rank 1 ran out of training batches after 2 batches in epoch 0"),
    (
        "13:reloaded-uneven",
        "Uneven inputs: the ranks have different numbers of training batches in epoch 1 "
        "(rank 0: 3, rank 1: 2). Rank 1 would run out",
    ),
    ("14:val-iterable", "Uneven inputs: rank 1 ran out of validation batches after 2 batches, while rank 0 still"),
    ("15:test-iterable", "Uneven inputs: rank 0 ran out of test batches after 2 batches, while rank 1 still has more"),
    ("16:predict-map", "Uneven inputs: the ranks have different numbers of predict batches (rank 0: 3, rank 1: 2)."),
    (
        "17:predict-iterable-empty",
        "Uneven inputs: rank 1 ran out of predict batches before its first batch, while "
        "rank 0 still has more (at least 1)",
    ),
]


def test_even_inputs_train_and_caught_errors_keep_the_ranks_in_step(jobs):
    job = jobs["ok"]
    job.wait()
    assert job.ended is not None, f"the job did not end in time:\n{job.report()}"
    assert job.proc.returncode == 0, job.report()
    per_rank = [job.results(0), job.results(1)]
    assert sorted(per_rank[0], key=lambda c: int(c.split(":")[0])) == sorted(
        [c for c, _ in OK + CAUGHT], key=lambda c: int(c.split(":")[0])
    ), per_rank[0]
    for results in per_rank:
        for case, steps in OK:
            assert results[case].get("ok"), (case, results[case])
            if steps is not None:
                assert results[case]["steps"] == steps, (case, results[case])
        evaluated = results["2:even-validate-test-predict"]
        assert [
            evaluated[w]["batches"][k] for w, k in (("validate", "val"), ("test", "test"), ("predict", "predict"))
        ] == [2, 2, 2]
        assert results["7:max-steps-iterable"]["batches"]["train"] == 2
        assert results["8:max-steps-manual-map"]["batches"]["train"] == 2  # two optimizer steps per batch
    # NO_SHARD predict is not checked: each rank predicted its own number of batches.
    assert [r["9:predict-map-no-shard"]["batches"]["predict"] for r in per_rank] == [3, 2]
    for case, start in CAUGHT:
        messages = [results[case].get("error") for results in per_rank]
        assert messages[0] is not None and messages[0] == messages[1], (case, messages)
        assert messages[0].startswith(start), (case, messages[0])
    assert "Trainer.predict's own sampler does not repeat samples" in per_rank[0]["16:predict-map"]["error"]


# --------------------------------------------------------------------------- the verdicts, without processes
def _verdict(rows: list[list[int]], stage=RunningStage.VALIDATING, epoch: str = "") -> str:
    with pytest.raises(UnevenBatchesError) as info:
        EvenBatches(lambda: None)._check_rows(rows, stage, epoch)
    return str(info.value)


def test_verdicts_name_every_rank_that_ran_out():
    # rows: [loop, position, more follow, next dataloader, next index] per rank; 3 ranks, two of them done.
    message = _verdict([[3, 4, 0, -1, -1], [3, 4, 1, 0, 5], [3, 4, 0, -1, -1]])
    assert message.startswith(
        "Uneven inputs: rank 0 and rank 2 ran out of validation batches after 5 batches, "
        "while rank 1 still has more (at least 6), and would wait for them"
    ), message
    # All ranks have a next batch, but one has moved on to the next dataloader.
    message = _verdict([[3, 1, 1, 0, 2], [3, 1, 1, 1, 0]])
    assert message.startswith(
        "Uneven inputs: the ranks' next validation batches differ (rank 0: batch 2 of "
        "dataloader 0, rank 1: batch 0 of dataloader 1): rank 1 ran out of batches of "
        "dataloader 0 first."
    ), message
    # Ranks at different positions (an earlier loop diverged).
    message = _verdict([[1, 3, 1, 0, 4], [3, 0, 1, 0, 1]], RunningStage.TRAINING)
    assert message.startswith(
        "Uneven inputs: the ranks are at different batches (rank 0: training batch 4, rank 1: validation batch 1)"
    ), message
    EvenBatches(lambda: None)._check_rows([[1, 2, 1, 0, 3]] * 2, RunningStage.TRAINING)  # agreement: no error
