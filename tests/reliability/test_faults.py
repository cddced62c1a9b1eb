"""A rank that raises, dies or hangs in the middle of a step ends the whole job, within the configured timeout.

tests/scripts/fault_run.py trains ToyLM on 2 ranks with ``FSDPStrategy(timeout=timedelta(seconds=TIMEOUT_S))``
and makes one rank fail at step 3: it raises, ``os._exit``s, SIGKILLs itself or sleeps forever, at the start of
``training_step`` (the other rank is then blocked in the forward's all-gather) or from a gradient hook in the
middle of backward (the other rank is in the backward's all-gathers / reduce-scatters).

Two ways of starting the ranks:

- the default launcher for scripts (Lightning's ``_SubprocessScriptLauncher``: rank 0 re-runs the script for
  rank 1 as its child). The job (rank 0's process) must exit non-zero, name the failure in its output, and leave no
  process behind.
- torchrun style: two independent processes with ``MASTER_ADDR``/``MASTER_PORT``/``NODE_RANK``/``LOCAL_RANK``/
  ``WORLD_SIZE`` set, nobody watching them. The surviving rank must fail by itself (closed connection, or the
  process group's timeout) and exit non-zero.

Every time is measured from the moment the faulty rank injected its fault (it prints ``time.time()``), so process
start-up on a loaded machine does not count: nothing is timed from launch. Start-up is only guarded against never
finishing (``STARTUP_S`` without any rank printing progress), and ``FSDPStrategy(timeout=...)`` does not bound it
(the strategy's ``startup_timeout`` does, 30 minutes by default). A hang can only be noticed through the timeout:
those cases must end after about ``TIMEOUT_S`` (the error names it: gloo's "Timed out waiting 10000ms", or, where
the engine's broadcast or all-to-all timed out, the engine's "process group's timeout (10000 ms)"), which shows the
configured value is the one in force, not torch's 30-minute default. Everything is started in sessions of its own
and killed by process group at the end of each test, whatever happened.

The jobs are independent (their own folders and ports; every time is measured from the job's own fault), so a module
fixture runs them ``PARALLEL_JOBS`` at a time (tests/toolbox/launch.py's ``in_background``) while each test waits for
its own job and checks what was seen; the longest jobs start first.

``test_late_rank_joins_then_a_hang_still_ends_in_the_timeout``: 4 independent ranks with a 5 s timeout, one started
20 s after the others reached the rendezvous, train like one process, then a rank hangs and every other rank ends
within the timeout.
"""

from __future__ import annotations

import functools
import re
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.ranks import clean_env, free_port, group_members
from tests.toolbox.fault_jobs import MARGIN_S, PEER_GONE, STARTUP_S, Job
from tests.toolbox.launch import in_background
from tests.toolbox.one_device import toy_lm_on_samples

TIMEOUT_S = 10  # FSDPStrategy(timeout=...) of every run
# Jobs running at once. Their waits (one rank importing after another, the timeouts of the hangs) leave the cores
# mostly idle. What each test times starts at its own fault, but the end of a job is CPU work that a neighbour's
# start-up competes with: two jobs (at most 8 processes) keep that within MARGIN_S on two shared cores.
PARALLEL_JOBS = 2


def _fault_args(fault: str, rank: int, where: str, sharding: str = "FULL_SHARD", timeout: int = TIMEOUT_S) -> list[str]:
    return [
        "--fault",
        fault,
        "--fault-rank",
        str(rank),
        "--where",
        where,
        "--timeout",
        str(timeout),
        "--sharding",
        sharding,
    ]


def _check_names_failure(output: str, fault: str, rank: int) -> None:
    if fault == "raise":
        assert f"injected fault on rank {rank} at step 3" in output
    elif fault == "hang":
        # The error on the rank that waited names the configured timeout, in milliseconds: gloo's own for its
        # all-gather and all-reduce, the engine's for gloo's broadcast and all-to-all (whose error does not).
        ms = TIMEOUT_S * 1000
        assert re.search(rf"Timed out waiting {ms}ms|process group's timeout \({ms} ms\)", output), output[-4000:]
    else:  # exit / kill: the survivor's collective saw the rank gone, or Lightning's observer saw it
        assert re.search(rf"{PEER_GONE}|terminated with code", output), output[-4000:]


def _check_elapsed(fault: str, elapsed: float) -> None:
    if fault == "hang":
        # Only the timeout can end a hang: not much before it (the waiting collective may have started a moment
        # before the fault was printed) and not much after it (torch's default would be 1800 s).
        assert TIMEOUT_S * 0.8 <= elapsed <= TIMEOUT_S + MARGIN_S, elapsed
    else:
        assert elapsed <= MARGIN_S, elapsed


POPEN_CASES = [
    # (fault, faulty rank, where, sharding)
    ("raise", 1, "step", "FULL_SHARD"),
    ("exit", 1, "backward", "FULL_SHARD"),
    ("kill", 1, "step", "FULL_SHARD"),
    ("hang", 1, "backward", "FULL_SHARD"),
    ("hang", 1, "step", "HYBRID_SHARD"),  # the default node groups get the configured timeout too
    ("raise", 0, "backward", "FULL_SHARD"),
    ("hang", 0, "step", "FULL_SHARD"),
]


def _left_behind(proc: subprocess.Popen) -> list[int]:
    """The job's process group once it ended: rank 1 (rank 0's child, same group) must be gone too."""
    deadline = time.monotonic() + 5
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return group_members(proc.pid)


def _launched_job(folder: Path, args: list[str]) -> dict:
    """One job started as a script (Lightning's launcher starts the other ranks from rank 0): what the tests check,
    recorded before every process group is killed."""
    job = Job(folder)
    try:
        proc = job.start(args, clean_env())
        ended = job.wait_for_exit(proc, TIMEOUT_S + MARGIN_S)
        seen = {"ended": ended, "fault_at": job.fault_time(), "rc": proc.returncode, "report": job.report()}
        seen["output"] = job.output()
        seen["left_behind"] = _left_behind(proc) if ended is not None else None
        return seen
    finally:
        job.close()


@pytest.mark.parametrize("fault,rank,where,sharding", POPEN_CASES, ids=lambda v: str(v))
def test_default_launcher_job_ends(jobs, fault, rank, where, sharding):
    """Started as a script: Lightning's launcher starts rank 1 from rank 0. The job must end, non-zero, in time."""
    seen = jobs["launcher", fault, rank, where, sharding].result()
    assert seen["ended"] is not None, f"the job did not end in time:\n{seen['report']}"
    assert seen["fault_at"] is not None, f"the fault was never injected:\n{seen['report']}"
    elapsed = seen["ended"] - seen["fault_at"]
    print(
        f"\n[faults] launcher {fault}@rank{rank}/{where}/{sharding}: job ended {elapsed:.1f}s after the fault, "
        f"rc={seen['rc']} (timeout {TIMEOUT_S}s)"
    )
    output = seen["output"]
    assert seen["rc"] != 0, seen["report"]
    assert "event=train-end" not in output, seen["report"]
    _check_names_failure(output, fault, rank)
    _check_elapsed(fault, elapsed)
    # Nothing left behind: rank 1 (rank 0's child, same process group) is gone too.
    assert seen["left_behind"] == [], f"processes left behind:\n{seen['report']}"


PIPELINE_CASES = [
    # (fault, faulty rank, where) on 4 ranks as 2 stages x 2 data-parallel ranks: rank 2 holds stage 1, the last.
    ("kill", 2, "backward"),  # mid-backward: its pipeline peer waits in P2P, its data peer in a reduce-scatter
    ("hang", 1, "step"),  # stage 0: nothing fails, only the timeout can end the others' waits
    ("exit", 3, "step"),
]


@pytest.mark.parametrize("fault,rank,where", PIPELINE_CASES, ids=lambda v: str(v))
def test_pipeline_stage_rank_fault_ends_every_rank(jobs, fault, rank, where):
    """pipeline_parallel_size=2 on 4 ranks: a stage rank that dies or hangs ends the whole job, in time."""
    seen = jobs["pipeline", fault, rank, where].result()
    assert seen["ended"] is not None, f"the job did not end in time:\n{seen['report']}"
    assert seen["fault_at"] is not None, f"the fault was never injected:\n{seen['report']}"
    elapsed = seen["ended"] - seen["fault_at"]
    print(f"\n[faults] pipeline {fault}@rank{rank}/{where}: job ended {elapsed:.1f}s after the fault")
    output = seen["output"]
    assert seen["rc"] != 0, seen["report"]
    assert output.count("event=train-start") == 4, seen["report"]  # all four ranks were training
    assert "event=train-end" not in output, seen["report"]
    _check_names_failure(output, fault, rank)
    _check_elapsed(fault, elapsed)
    assert seen["left_behind"] == [], f"processes left behind:\n{seen['report']}"


TORCHRUN_CASES = [
    # (fault, where); the faulty rank is 1, the survivor rank 0 must fail by itself.
    ("raise", "step"),
    ("kill", "backward"),
    ("hang", "step"),
]


def _independent_job(folder: Path, fault: str, where: str) -> dict:
    """Torchrun style: rank 0 (the survivor) and rank 1 (the faulty one), each its own process."""
    job = Job(folder)
    try:
        common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0", "WORLD_SIZE": "2"}
        survivor = job.start(_fault_args(fault, 1, where), clean_env(**common, LOCAL_RANK="0", RANK="0"))
        faulty = job.start(_fault_args(fault, 1, where), clean_env(**common, LOCAL_RANK="1", RANK="1"))
        ended = job.wait_for_exit(survivor, TIMEOUT_S + MARGIN_S)
        seen = {"ended": ended, "fault_at": job.fault_time(), "rc": survivor.returncode}
        seen["faulty_running"] = faulty.poll() is None  # right after rank 0 ended, as the test checked it
        if ended is not None and fault != "hang":
            try:
                seen["faulty_rc"] = faulty.wait(timeout=MARGIN_S)
            except subprocess.TimeoutExpired:
                seen["faulty_rc"] = None
        seen.update(report=job.report(), output=job.output(), survivor_output=job.output(0))
        return seen
    finally:
        job.close()


@pytest.mark.parametrize("fault,where", TORCHRUN_CASES, ids=lambda v: str(v))
def test_independent_processes_survivor_fails_by_itself(jobs, fault, where):
    """Torchrun style: each rank its own process, no launcher and no observer. Rank 0 must notice on its own."""
    seen = jobs["independent", fault, where].result()
    assert seen["ended"] is not None, f"rank 0 did not end in time:\n{seen['report']}"
    assert seen["fault_at"] is not None, f"the fault was never injected:\n{seen['report']}"
    elapsed = seen["ended"] - seen["fault_at"]
    print(
        f"\n[faults] independent {fault}@rank1/{where}: rank 0 ended {elapsed:.1f}s after the fault, "
        f"rc={seen['rc']} (timeout {TIMEOUT_S}s)"
    )
    assert seen["rc"] != 0, seen["report"]
    assert "event=train-end" not in seen["survivor_output"], seen["report"]
    _check_names_failure(seen["output"], fault, 1)
    _check_elapsed(fault, elapsed)
    if fault == "hang":
        assert seen["faulty_running"]  # still asleep: stopping it is the job scheduler's (torchrun's) part
    else:
        faulty_rc = seen["faulty_rc"]
        assert faulty_rc is not None and faulty_rc != 0, seen["report"]


def _nan_job(folder: Path) -> dict:
    job = Job(folder)
    try:
        proc = job.start(
            ["--fault", "nan", "--fault-rank", "1", "--timeout", str(TIMEOUT_S), "--detect-anomaly"], clean_env()
        )
        ended = job.wait_for_exit(proc, MARGIN_S)
        return {"ended": ended, "rc": proc.returncode, "output": job.output(), "report": job.report()}
    finally:
        job.close()


def test_nan_gradient_under_detect_anomaly_is_named(jobs):
    """Trainer(detect_anomaly=True): rank 1's NaN gradient stops the job on every rank with the parameter's name.

    Rank 0's own gradient is finite, so its message naming rank 1 shows the ranks shared their findings; torch's
    own NaN check (which FSDPStrategy turns off during backward) would have raised on rank 1 only."""
    seen = jobs["nan"].result()
    assert seen["ended"] is not None, f"the job did not end in time:\n{seen['report']}"
    output = seen["output"]
    assert seen["rc"] != 0, seen["report"]
    assert re.search(
        r"FloatingPointError: Non-finite gradient \(NaN or Inf\) in parameter\(s\) 'model.tiny' \(rank 1\)", output
    ), seen["report"]
    assert "returned nan values" not in output, seen["report"]  # not torch's one-rank check
    assert "Timed out" not in output, seen["report"]


# ------------------------------------------------------------------------------ a late rank, a short timeout
LATE_TIMEOUT_S = 5  # FSDPStrategy(timeout=...): far shorter than the late rank's delay
LATE_DELAY_S = 20  # the late rank's process starts this long after the others reached the rendezvous
LATE_RANK, HUNG_RANK, RECORD_STEP, LATE_BATCH, LATE_STEPS = 2, 1, 3, 8, 8


def _late_rank_job(folder: Path) -> dict:
    """The late-rank run of the test below; the asserts here guard the start-up only."""
    job = Job(folder)
    try:
        out = folder / "state.pt"
        args = [
            *_fault_args("hang", HUNG_RANK, "backward", timeout=LATE_TIMEOUT_S),
            "--devices",
            "4",
            "--global-batch",
            str(LATE_BATCH),
            "--steps",
            str(LATE_STEPS),
            "--fault-step",
            str(RECORD_STEP),
            "--record-step",
            str(RECORD_STEP),
            "--out",
            str(out),
        ]
        common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0", "WORLD_SIZE": "4"}
        procs: dict[int, subprocess.Popen] = {}
        for rank in (0, 1, 3):
            procs[rank] = job.start(args, clean_env(**common, LOCAL_RANK=str(rank), RANK=str(rank)))
        # The late rank starts once the others wait in the rendezvous, so however slowly they start, they wait there
        # at least LATE_DELAY_S (4 times the timeout) plus the late rank's own start-up.
        launched = time.time()
        while len(job.event_times("fit-start")) < 3:
            assert all(p.poll() is None for p in procs.values()), job.report()
            assert time.time() < (job.last_progress() or launched) + STARTUP_S, job.report()
            time.sleep(0.1)
        time.sleep(LATE_DELAY_S)
        procs[LATE_RANK] = job.start(args, clean_env(**common, LOCAL_RANK=str(LATE_RANK), RANK=str(LATE_RANK)))

        survivors = [rank for rank in procs if rank != HUNG_RANK]
        ended = dict(zip(survivors, job.wait_for_exits([procs[r] for r in survivors], LATE_TIMEOUT_S + MARGIN_S)))
        return {
            "ended": ended,
            "hung_running": procs[HUNG_RANK].poll() is None,  # right after the others ended
            "rc": {rank: procs[rank].returncode for rank in survivors},
            "fault_at": job.fault_time(),
            "events": {event: job.event_times(event) for event in ("fit-start", "train-start", "recorded")},
            "state": out,
            "output": job.output(),
            "report": job.report(),
        }
    finally:
        job.close()


def test_late_rank_joins_then_a_hang_still_ends_in_the_timeout(jobs):
    """4 torchrun-style ranks with timeout=5 s, rank 2 started 20 s after the others reached the rendezvous, which
    waits for it (startup_timeout, default 30 minutes); the 4 ranks train 3 steps to the one-device result, then
    rank 1 hangs in the middle of step 4's backward and every other rank ends by itself within the timeout plus
    ``MARGIN_S``."""
    import torch

    expected = toy_lm_on_samples(RECORD_STEP, LATE_BATCH, LATE_BATCH * LATE_STEPS).lightning_state()
    seen = jobs["late"].result()
    ended, report = seen["ended"], seen["report"]
    survivors = list(ended)
    assert all(t is not None for t in ended.values()), f"ranks did not end in time: {ended}\n{report}"
    fault_at = seen["fault_at"]
    assert fault_at is not None, f"the fault was never injected:\n{report}"

    # Start-up: the other ranks waited in the rendezvous for the late one far longer than the timeout.
    fit_start = seen["events"]["fit-start"]
    assert sorted(fit_start) == [0, 1, 2, 3], report
    waited = fit_start[LATE_RANK] - max(t for rank, t in fit_start.items() if rank != LATE_RANK)
    assert waited >= LATE_DELAY_S, (waited, report)
    assert sorted(seen["events"]["train-start"]) == [0, 1, 2, 3], report

    # Training: after RECORD_STEP steps the gathered model equals the one-device run's.
    assert sorted(seen["events"]["recorded"]) == [0, 1, 2, 3], report
    got = torch.load(seen["state"], weights_only=True)["state"]
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    compared = sum(v.numel() for v in expected.values())
    assert len(expected) >= 12 and compared >= 150, (len(expected), compared)
    initial = toy_lm_on_samples(0, LATE_BATCH, LATE_BATCH * LATE_STEPS).lightning_state()
    moved = sum(int(not torch.equal(value, initial[key])) for key, value in expected.items())
    assert moved >= 10, moved  # the comparison is of trained values, not of the initialisation

    # The hang: every other rank ended by itself, non-zero, within the 5 s timeout plus the margin.
    elapsed = {rank: ended[rank] - fault_at for rank in survivors}
    print(
        f"\n[faults] late rank {LATE_RANK} joined {waited:.1f}s after the others; hang@rank{HUNG_RANK}/backward: "
        + ", ".join(f"rank {r} ended {e:.1f}s after the fault (rc={seen['rc'][r]})" for r, e in elapsed.items())
        + f" (timeout {LATE_TIMEOUT_S}s)"
    )
    for rank in survivors:
        assert seen["rc"][rank] != 0, report
        assert LATE_TIMEOUT_S * 0.8 <= max(elapsed.values()) and elapsed[rank] <= LATE_TIMEOUT_S + MARGIN_S, elapsed
    assert "event=train-end" not in seen["output"], report
    ms = LATE_TIMEOUT_S * 1000
    assert re.search(rf"Timed out waiting {ms}ms|process group's timeout \({ms} ms\)", seen["output"]), report
    assert seen["hung_running"]  # still asleep: stopping it is the job scheduler's part


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """Every job of the module, ``PARALLEL_JOBS`` at a time, the longest (the late rank, the 4-rank pipelines, the
    hangs) first: ``{case: Future of what was seen}``."""
    cases: dict = {"late": functools.partial(_late_rank_job, tmp_path_factory.mktemp("late"))}
    for fault, rank, where in PIPELINE_CASES:
        args = [*_fault_args(fault, rank, where), "--pp", "2"]
        cases["pipeline", fault, rank, where] = functools.partial(_launched_job, tmp_path_factory.mktemp("pp"), args)
    for fault, rank, where, sharding in sorted(POPEN_CASES, key=lambda case: case[0] != "hang"):
        args = _fault_args(fault, rank, where, sharding)
        folder = tmp_path_factory.mktemp("launcher")
        cases["launcher", fault, rank, where, sharding] = functools.partial(_launched_job, folder, args)
    for fault, where in sorted(TORCHRUN_CASES, key=lambda case: case[0] != "hang"):
        folder = tmp_path_factory.mktemp("independent")
        cases["independent", fault, where] = functools.partial(_independent_job, folder, fault, where)
    cases["nan"] = functools.partial(_nan_job, tmp_path_factory.mktemp("nan"))
    return in_background(cases, workers=PARALLEL_JOBS)
