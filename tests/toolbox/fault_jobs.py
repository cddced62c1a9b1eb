"""Jobs whose processes report ``FAULT-RUN rank=R event=E pid=P t=T`` lines (tests/scripts/fault_run.py and the
scripts that reuse its faults): starting them in sessions of their own, reading their events, waiting for their ends
with a budget counted from the fault, and killing every group at the end. Used by the fault tests
(tests/reliability/test_faults.py) and the mpirun launch (tests/strategy/test_mpi.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.ranks import kill_group
from tests.toolbox.launch import SCRIPTS, start_logged

FAULT_RUN = SCRIPTS / "fault_run.py"
# What may come on top of the fault (or of the timeout, for hangs): Lightning's child-process observer polls every
# 5 s, the strategy gives rank 1 2 s to end by itself before killing it, then teardown and interpreter exit, on 2
# shared cores.
MARGIN_S = 20
# Before the fault, a guard against a start-up that never finishes, not a measurement: the job fails only if no rank
# printed progress (a FAULT-RUN line) for this long. Imports alone take a minute on 2 shared cores under load.
STARTUP_S = 300
# How a survivor names a rank that exited or was killed under it: gloo's closed connection, or the shared-memory
# exchange that same-host ranks of a sharded group use (lightning_fsdp/engine/shared_memory.py).
PEER_GONE = r"Connection closed by peer|Connection reset by peer|exited while this rank waited"


class Job:
    """Processes started in sessions of their own, their output in files; every group killed on ``close``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        """tests/scripts/fault_run.py with ``args``, as one more process of the job."""
        return self.start_command([sys.executable, FAULT_RUN, *args], env)

    def start_command(self, command: list[str | Path], env: dict[str, str]) -> subprocess.Popen:
        """``command`` in a session of its own, its output in the job's next log file."""
        log = self.folder / f"proc{len(self.procs)}.log"
        proc = start_logged(command, log, env=env, cwd=self.folder)
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def output(self, i: int | None = None) -> str:
        logs = self.logs if i is None else [self.logs[i]]
        return "\n".join(log.read_text(errors="replace") for log in logs if log.exists())

    def fault_time(self) -> float | None:
        found = re.search(r"FAULT-RUN rank=\d event=fault-\w+ pid=\d+ t=([\d.]+)", self.output())
        return float(found.group(1)) if found else None

    def event_times(self, event: str) -> dict[int, float]:
        """``{rank: time.time()}`` of each rank's first ``event`` line."""
        times: dict[int, float] = {}
        for rank, t in re.findall(rf"FAULT-RUN rank=(\d+) event={event} pid=\d+ t=([\d.]+)", self.output()):
            times.setdefault(int(rank), float(t))
        return times

    def last_progress(self) -> float | None:
        stamps = [float(t) for t in re.findall(r"FAULT-RUN rank=\d+ event=\S+ pid=\d+ t=([\d.]+)", self.output())]
        return max(stamps, default=None)

    def wait_for_exit(self, proc: subprocess.Popen, budget_s: float) -> float | None:
        """Wait until ``proc`` ends (returns the time.time() it was seen ended) or the fault + ``budget_s`` passed
        (None). Before the fault only a start-up that stopped making progress fails (``STARTUP_S``)."""
        return self.wait_for_exits([proc], budget_s)[0]

    def wait_for_exits(self, procs: list[subprocess.Popen], budget_s: float) -> list[float | None]:
        """``wait_for_exit`` for several processes at once: when each was seen ended, None for those still running
        at the fault + ``budget_s``."""
        started = time.time()
        ended: list[float | None] = [None] * len(procs)
        while True:
            now = time.time()
            for i, proc in enumerate(procs):
                if ended[i] is None and proc.poll() is not None:
                    ended[i] = now
            if all(t is not None for t in ended):
                return ended
            fault = self.fault_time()
            limit = (fault + budget_s) if fault is not None else (self.last_progress() or started) + STARTUP_S
            if now > limit:
                return ended
            time.sleep(0.1)

    def report(self) -> str:
        return "\n".join(
            f"--- process {i} (rc={p.poll()}):\n{self.output(i)[-5000:]}" for i, p in enumerate(self.procs)
        )

    def close(self) -> None:
        for proc in self.procs:
            kill_group(proc.pid)
        for proc in self.procs:
            proc.wait()
