"""fsdp_custom launched by ``mpirun`` (OpenMPI), against one device, and a failing rank ending the whole job.

tests/scripts/mpi_run.py is an ordinary training script: Lightning finds the ranks through ``MPIEnvironment``
(mpi4py), nothing in it starts processes. Two launches, each checked for what it shows:

- ``mpirun -np 2 python mpi_run.py``, as a user types it: FULL_SHARD over 2 ranks; after 3 optimizer steps (SGD with
  momentum) the full parameters equal one device's on the same global batches; then rank 1 is SIGKILLed at the
  start of step 4, and every rank is gone within the strategy's timeout of the kill.
- ``mpirun -np 4 python -m mpi4py mpi_run.py --nodes 2 --devices 2 --simulate-nodes``: the ranks report two host
  names (see the script), so Lightning places them on 2 nodes x 2 and HYBRID_SHARD shards within each; after 3 steps
  the parameters equal one device's and each node holds one copy of the model; then rank 3 hangs, the others fail
  after the 10 s timeout, and ``-m mpi4py`` turns their exceptions into ``MPI_Abort``, which ends the hung rank too
  (without it, the failed ranks would wait in ``MPI_Finalize`` for the hung one forever; docs/multi-node.md).

Skipped, with the reason, where ``mpirun`` or mpi4py is missing (``make setup`` installs both where it can: OpenMPI
through apt-get as root, mpi4py into .venv/mpi-site, which only these launches put on their path).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.ranks import ROOT, clean_env
from tests.scripts.mpi_run import GLOBAL_BATCH
from tests.toolbox.fault_jobs import MARGIN_S, Job
from tests.toolbox.launch import SCRIPTS
from tests.toolbox.one_device import toy_lm_on_samples

MPI_SITE = ROOT / ".venv" / "mpi-site"  # where `make setup` installs mpi4py
TIMEOUT_S = 10  # FSDPStrategy(timeout=...) of both runs
STEPS, RECORD_STEP, FAULT_STEP = 6, 3, 4


def _mpi4py_path() -> str | None:
    """What the ranks need on PYTHONPATH to import mpi4py ("" if this interpreter has it), None if nowhere."""
    if (MPI_SITE / "mpi4py").is_dir():
        return str(MPI_SITE)
    return "" if importlib.util.find_spec("mpi4py") is not None else None


MPIRUN = shutil.which("mpirun")
pytestmark = [
    pytest.mark.skipif(
        MPIRUN is None,
        reason="mpirun not found: `make setup` installs OpenMPI where it runs as root with apt-get "
        "(apt-get install openmpi-bin libopenmpi-dev); the MPI launch tests need it",
    ),
    pytest.mark.skipif(
        _mpi4py_path() is None,
        reason="mpi4py not found (neither in .venv/mpi-site, where `make setup` installs it when mpirun exists, nor "
        "importable here): Lightning detects an mpirun launch through it",
    ),
]


class MpiJob(Job):
    """A fault job (tests/toolbox/fault_jobs.py) started through mpirun; closing kills every process of mpirun's
    session."""

    def start_mpi(self, ranks: int, args: list[str], module_runner: bool) -> subprocess.Popen:
        site = _mpi4py_path()
        env = {
            k: v
            for k, v in clean_env(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), site) if p)).items()
            if not k.startswith(("OMPI_", "PMIX_"))  # pytest itself may run under mpirun
        }
        runner = ["-m", "mpi4py"] if module_runner else []
        command = [
            MPIRUN,
            "--allow-run-as-root",  # root in containers and CI
            "--oversubscribe",  # more ranks than cores
            "--bind-to",
            "none",
            "--mca",
            "btl",
            "self,tcp",
            "-np",
            str(ranks),
            sys.executable,
            *runner,
            SCRIPTS / "mpi_run.py",
            *args,
        ]
        return self.start_command(command, env)

    def rank_pids(self) -> dict[int, int]:
        found = re.findall(r"FAULT-RUN rank=(\d+) event=fit-start pid=(\d+)", self.output())
        return {int(rank): int(pid) for rank, pid in found}

    def close(self) -> None:
        for proc in self.procs:
            for pid in session_members(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid`` (Linux /proc): mpirun and every rank it started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, _pgrp, session = stat[stat.rindex(")") + 2 :].split()[:4]
        if int(session) == sid and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture
def job(tmp_path):
    j = MpiJob(tmp_path)
    yield j
    j.close()


def check_parity(record: dict) -> None:
    expected = toy_lm_on_samples(RECORD_STEP, GLOBAL_BATCH, GLOBAL_BATCH * STEPS).lightning_state()
    assert sorted(record["state"]) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(record["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    compared = sum(v.numel() for v in expected.values())
    assert len(expected) >= 14 and compared >= 150, (len(expected), compared)
    initial = toy_lm_on_samples(0, GLOBAL_BATCH, GLOBAL_BATCH * STEPS).lightning_state()
    moved = sum(int(not torch.equal(value, initial[key])) for key, value in expected.items())
    assert moved >= 12, moved  # trained values, not the initialisation (the frozen layer's 2 stay)


def run(job: MpiJob, ranks: int, args: list[str], module_runner: bool) -> tuple[subprocess.Popen, float, dict]:
    """Start the job and wait until mpirun and every rank it started have ended (at most the timeout plus the margin
    after the fault); returns mpirun, how long after the fault the last process ended, and rank 0's record."""
    out = job.folder / "record.pt"
    common = ["--out", str(out), "--steps", str(STEPS), "--record-step", str(RECORD_STEP)]
    common += ["--fault-step", str(FAULT_STEP), "--timeout", str(TIMEOUT_S)]
    proc = job.start_mpi(ranks, [*common, *args], module_runner)
    ended = job.wait_for_exit(proc, TIMEOUT_S + MARGIN_S)
    assert ended is not None, f"mpirun did not end in time:\n{job.report()}"
    fault_at = job.fault_time()
    assert fault_at is not None, f"the fault was never injected:\n{job.report()}"
    # Ranks stay in mpirun's session: one still running after mpirun ended would have been left behind.
    while session_members(proc.pid) and time.time() < fault_at + TIMEOUT_S + MARGIN_S:
        time.sleep(0.1)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:300] for pid in session_members(proc.pid)}
    assert not left, f"processes left behind: {left}\n{job.report()}"
    assert out.exists(), job.report()
    return proc, time.time() - fault_at, torch.load(out, weights_only=False)


def check_all_ended(job: MpiJob, proc: subprocess.Popen, ranks: int) -> None:
    assert sorted(job.rank_pids()) == list(range(ranks)), job.report()
    assert proc.returncode != 0, job.report()
    assert "event=train-end" not in job.output(), job.report()


def test_two_ranks_equal_one_device_and_a_killed_rank_ends_the_job(job):
    proc, elapsed, record = run(job, 2, ["--sharding", "FULL_SHARD", "--fault", "kill", "--fault-rank", "1"], False)
    print(f"\n[mpi] 2 ranks: every process ended {elapsed:.1f}s after rank 1 was killed (rc={proc.returncode})")
    check_parity(record)
    assert record["cluster_environment"] == "MPIEnvironment"
    assert record["world_size"] == record["process_group_size"] == 2 and record["num_nodes"] == 1
    assert record["placements"] == [[0, 0, 0], [1, 0, 1]]
    check_all_ended(job, proc, 2)
    assert elapsed <= TIMEOUT_S, elapsed  # mpirun ends the job when a rank dies, before any timeout


def test_hybrid_shard_on_two_nodes_and_a_hung_rank_ends_the_job(job):
    args = ["--sharding", "HYBRID_SHARD", "--nodes", "2", "--devices", "2", "--simulate-nodes"]
    proc, elapsed, record = run(job, 4, [*args, "--fault", "hang", "--fault-rank", "3"], True)
    print(f"\n[mpi] 2 nodes x 2: every process ended {elapsed:.1f}s after rank 3 hung (timeout {TIMEOUT_S}s)")
    check_parity(record)
    assert record["cluster_environment"] == "MPIEnvironment"
    assert record["world_size"] == record["process_group_size"] == 4 and record["num_nodes"] == 2
    assert record["placements"] == [[g, g // 2, g % 2] for g in range(4)]
    # HYBRID_SHARD: each node's 2 ranks split one copy of the model, and the nodes hold the same rows.
    per_rank, full = record["param_bytes"], record["full_param_bytes"]
    assert sum(per_rank[:2]) == sum(per_rank[2:]) == full and per_rank[:2] == per_rank[2:], (per_rank, full)
    assert max(per_rank) < full, per_rank
    check_all_ended(job, proc, 4)
    # Only the timeout can end a hang: the survivors' collectives failed after it (the error names it), and the
    # whole job ended soon after.
    assert TIMEOUT_S * 0.8 <= elapsed <= TIMEOUT_S + MARGIN_S, elapsed
    ms = TIMEOUT_S * 1000
    assert re.search(rf"Timed out waiting {ms}ms|process group's timeout \({ms} ms\)", job.output()), job.report()
