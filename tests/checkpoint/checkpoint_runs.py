"""Lightning runs shared by the sharded/local/convert checkpoint tests (one pytest process runs each at most once).

Every run is a user-style launch of tests/scripts/checkpoint_run.py (training scenarios, rank 0's results) or
tests/scripts/checkpoint_cases.py (several load scenarios in one process group, every rank's outcome), in its own
session, killed as a group when it ends or outlives its timeout (tests/toolbox/launch.py). Runs write into one
temporary folder per pytest process, removed at exit. Every training run sees the same global batches (6 samples per
step, 3 steps per epoch), so a resumed run's steps 4-6 are comparable bit for bit with the uninterrupted run's. A test
module can ``prefetch`` the training runs it will ask for: they start in the background, a few at a time
(tests/toolbox/launch.py's ``in_background``), each after the run it needs; ``train`` then waits for them.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import threading
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from tests.toolbox.launch import SCRIPTS, in_background, rank_outputs, run_command

RUN = SCRIPTS / "checkpoint_run.py"
CASES = SCRIPTS / "checkpoint_cases.py"
LAUNCH_TIMEOUT_S = 240


TRAIN = {
    # --- sharded: 6 steps saving at step 3 (epoch end), a ModelCheckpoint(save_top_k=1, save_last) folder and a
    # weights-only directory after fit.
    "sh_6": [
        "--state-dict-type",
        "sharded",
        "--save-in-fit",
        "{dir}/sh_3.ckpt",
        "--model-checkpoint",
        "{dir}/sh_mc",
        "--save-weights-only",
        "{dir}/sh_wo.ckpt",
    ],
    # 3 steps saving at step 3, then a second save to the same directory during which rank 0 is SIGKILLed.
    "sh_kill": [
        "--state-dict-type",
        "sharded",
        "--epochs",
        "1",
        "--save-in-fit",
        "{dir}/sh_killed.ckpt",
        "--kill-in-second-save",
        "0",
        "--pg-timeout",
        "30",
    ],
    # Resume from the directory that survived the kill; after fit save to it again (replacing it).
    "sh_resumed": [
        "--state-dict-type",
        "sharded",
        "--resume",
        "{dir}/sh_killed.ckpt",
        "--save",
        "{dir}/sh_killed.ckpt",
    ],
    # 2 -> 1 and 2 -> 3 ranks, each re-saving what it restored (read back at 2 ranks by the cases run).
    "sh_2to1": [
        "--state-dict-type",
        "sharded",
        "--devices",
        "1",
        "--resume",
        "{dir}/sh_3.ckpt",
        "--save-at-start",
        "{dir}/sh_w1.ckpt",
    ],
    "sh_2to3": [
        "--state-dict-type",
        "sharded",
        "--devices",
        "3",
        "--resume",
        "{dir}/sh_3.ckpt",
        "--save-at-start",
        "{dir}/sh_w3.ckpt",
    ],
    # --- local
    "lo_6": [
        "--state-dict-type",
        "local",
        "--save-in-fit",
        "{dir}/lo_3.ckpt",
        "--save-weights-only",
        "{dir}/lo_wo.ckpt",
    ],
    "lo_kill": [
        "--state-dict-type",
        "local",
        "--epochs",
        "1",
        "--save-in-fit",
        "{dir}/lo_killed.ckpt",
        "--kill-in-second-save",
        "1",
        "--pg-timeout",
        "30",
    ],
    "lo_resumed": ["--state-dict-type", "local", "--resume", "{dir}/lo_killed.ckpt", "--save", "{dir}/lo_killed.ckpt"],
    # --- convert: plain Lightning on one device resumes the converted full file; fsdp_custom (full mode) resumes
    # the sharded directory converted back from it.
    "cv_single": ["--strategy", "single", "--devices", "1", "--resume", "{dir}/cv_full.ckpt"],
    "cv_sharded": ["--resume", "{dir}/cv_sharded.ckpt"],
}
NEEDS = {"sh_resumed": "sh_kill", "sh_2to1": "sh_6", "sh_2to3": "sh_6", "lo_resumed": "lo_kill"}
EXPECTED_TO_DIE = {"sh_kill", "lo_kill"}


class Runs:
    _shared: Runs | None = None

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="ckpt_runs_")
        atexit.register(shutil.rmtree, self.dir, True)
        self.results: dict[str, Any] = {}
        self._background: dict[str, Future] = {}
        self._lock = threading.Lock()

    @classmethod
    def shared(cls) -> Runs:
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def prefetch(self, names: list[str]) -> None:
        """Start these training runs, and the runs they need, in the background. Only for runs whose outputs no
        test inspects before a later run of the list could change them (a resume that saves over its source)."""
        order: list[str] = []
        for name in names:
            for needed in (NEEDS.get(name), name):
                if needed is not None and needed not in order:
                    order.append(needed)
        # Under the lock until every future is recorded: a run that waits for its need looks it up there.
        with self._lock:
            new = [name for name in order if name not in self.results and name not in self._background]
            self._background.update(in_background({name: partial(self._train, name) for name in new}))

    def train(self, name: str) -> Any:
        """Rank 0's results of a training run (for runs expected to die: the completed process)."""
        with self._lock:
            running = self._background.get(name)
        if running is not None:
            return running.result()
        return self._train(name)

    def _train(self, name: str) -> Any:
        if name not in self.results:
            if name in NEEDS:
                self.train(NEEDS[name])
            out = self.path(f"{name}.pt")
            args = [a.format(dir=self.dir) for a in TRAIN[name]]
            proc = run_command(
                [sys.executable, RUN, "--out", out, "--epochs", "2", *args], timeout=LAUNCH_TIMEOUT_S, check=False
            )
            if name in EXPECTED_TO_DIE:
                assert proc.returncode != 0, f"{name} was expected to die:\n{proc.stdout[-3000:]}"
                self.results[name] = proc
            else:
                assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
                self.results[name] = torch.load(out, weights_only=False)
        return self.results[name]

    def cases(self, name: str, cases: list[dict], devices: int = 2) -> list[dict]:
        """Every rank's outcome of each case (see tests/scripts/checkpoint_cases.py)."""
        if name not in self.results:
            out = self.path(name)
            proc = run_command(
                [sys.executable, CASES, "--out", out, "--devices", str(devices), "--cases", json.dumps(cases)],
                timeout=LAUNCH_TIMEOUT_S,
                check=False,
            )
            assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            self.results[name] = rank_outputs(out, devices)
        return self.results[name]
