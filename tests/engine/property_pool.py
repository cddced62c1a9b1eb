"""A persistent pool of gloo worker processes for the property-based tests: one process group serves many cases.

Spawning 2 processes per hypothesis example would cost seconds each on two shared cores; instead the pool starts
its workers once (spawn, ``file://`` rendezvous, one thread each) and sends every case, plain data, to all of them
through multiprocessing queues. Each worker runs ``tests.engine.property_cases.run_case`` and answers with its result or
the traceback of the exception it raised.

A case that times out, a worker that dies or raises fails that case with a clear message, and the pool is restarted
(its process group may be out of step) before the next case: a broken case never hangs the suite.
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any

import torch.multiprocessing as mp

from lightning_fsdp.shutdown import destroy_process_group

CASE_TIMEOUT_S = float(os.environ.get("LIGHTNING_FSDP_PROPERTY_TIMEOUT", "60"))
START_TIMEOUT_S = 180.0  # importing torch in two fresh processes on busy shared cores can be slow
PEER_GRACE_S = 5.0  # once one rank reported an exception, how long the others get to report theirs


class PoolFailure(AssertionError):
    """A case could not complete: a worker timed out, died or raised (the message says which, with tracebacks)."""


def _worker(rank: int, world_size: int, folder: str, inbox: Any, outbox: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # A collective whose peer is gone fails after this long instead of blocking forever.
        dist.init_process_group(
            "gloo",
            init_method=f"file://{folder}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=CASE_TIMEOUT_S / 2),
        )
        from tests.engine.property_cases import run_case
    except BaseException:  # noqa: BLE001 - reported to the parent
        outbox.put(("start", rank, ("error", traceback.format_exc())))
        return
    outbox.put(("start", rank, ("ok", None)))
    while True:
        message = inbox.get()
        if message is None:
            break
        case_id, case, workdir = message
        try:
            result: Any = ("ok", run_case(case, rank, world_size, workdir))
        except BaseException:  # noqa: BLE001 - reported to the parent
            # Report, then exit at once: a peer blocked in a collective with this rank fails fast on the closed
            # connection instead of waiting for the timeout, and the parent restarts the pool anyway.
            outbox.put((case_id, rank, ("error", traceback.format_exc())))
            outbox.close()
            outbox.join_thread()
            os._exit(1)
        outbox.put((case_id, rank, result))
        # Free the case's engines now rather than whenever the collector runs, so a problem with freed engines
        # (hooks they leave behind) shows in the next case every time instead of at random.
        gc.collect()
    destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self.context = mp.get_context("spawn")
        self.processes: list[Any] = []
        self.restarts = 0
        self.cases = 0
        self._next_id = 0
        self._start()

    # ------------------------------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="lightning-fsdp-property-")
        self.inboxes = [self.context.Queue() for _ in range(self.world_size)]
        self.outbox = self.context.Queue()
        self.processes = [
            self.context.Process(
                target=_worker,
                args=(rank, self.world_size, self.folder, self.inboxes[rank], self.outbox),
                daemon=True,
                name=f"property-worker-{rank}",
            )
            for rank in range(self.world_size)
        ]
        for process in self.processes:
            process.start()
        answers = self._collect("start", START_TIMEOUT_S)
        problems = [f"rank {r}: {v[1]}" for r, v in sorted(answers.items()) if v[0] != "ok"]
        if problems or len(answers) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(answers))
            self._stop(force=True)
            raise PoolFailure(
                f"the worker pool did not start (no answer from ranks {missing}):\n" + "\n".join(problems)
            )

    def _stop(self, *, force: bool) -> None:
        if not force:
            for inbox in self.inboxes:
                inbox.put(None)
            deadline = time.monotonic() + 10
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()  # our own child, by its handle
            process.join(5)
        for q in self.inboxes + [self.outbox]:
            q.close()
            q.cancel_join_thread()
        self.processes = []
        shutil.rmtree(self.folder, ignore_errors=True)

    def restart(self) -> None:
        self._stop(force=True)
        self.restarts += 1
        self._start()

    def close(self) -> None:
        if self.processes:
            self._stop(force=False)

    # ------------------------------------------------------------------------------------------- running
    def _collect(self, case_id: Any, timeout: float) -> dict[int, tuple[str, Any]]:
        """Answers for ``case_id`` by rank, until all ranks answered, the time is up, or a worker died. After the first
        exception the other ranks get ``PEER_GRACE_S`` more (they may be blocked in a collective with it)."""
        answers: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                got_id, rank, answer = self.outbox.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                if any(not p.is_alive() for p in self.processes):
                    # Let the survivors report (they may fail fast on the broken connection), briefly.
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
                    if all(not p.is_alive() for p in self.processes):
                        break
                continue
            if got_id != case_id:
                continue  # a late answer to an earlier case (cannot happen after a restart, kept for safety)
            answers[rank] = answer
            if answer[0] != "ok":
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        return answers

    def run(self, case: dict[str, Any]) -> list[dict[str, Any]]:
        """Run ``case`` on every worker; returns each rank's result. Raises PoolFailure (after restarting the pool)
        if any worker raised, died or did not answer within the timeout."""
        if not self.processes:
            self._start()
        self._next_id += 1
        case_id = self._next_id
        self.cases += 1
        workdir = tempfile.mkdtemp(prefix="case-", dir=self.folder)
        try:
            for inbox in self.inboxes:
                inbox.put((case_id, case, workdir))
            answers = self._collect(case_id, CASE_TIMEOUT_S)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if len(answers) == self.world_size and all(a[0] == "ok" for a in answers.values()):
            return [answers[r][1] for r in range(self.world_size)]
        lines = []
        for rank, process in enumerate(self.processes):
            if rank in answers and answers[rank][0] != "ok":
                lines.append(f"rank {rank} raised:\n{answers[rank][1]}")
            elif rank in answers:
                lines.append(f"rank {rank} finished")
            elif not process.is_alive():
                lines.append(f"rank {rank} died (exit code {process.exitcode})")
            else:
                lines.append(f"rank {rank} gave no answer within {CASE_TIMEOUT_S:.0f} s (hung?)")
        try:
            self.restart()
        except PoolFailure as err:
            lines.append(f"(restarting the pool failed too: {err})")
        raise PoolFailure("the case did not complete on every rank; the pool was restarted.\n" + "\n".join(lines))
