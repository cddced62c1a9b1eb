"""Helpers for tests that start their own processes: a clean environment, a free port, and process groups that can
be checked and killed as a whole (every job starts in a session of its own, so nothing is left behind).

They are the benchmarks' own (benchmarks/ranks.py): one harness starts and stops ranks for both.

``in_background``: independent launches of a module (each its own processes, files and port) started together by
a module fixture, a few at a time, so that one launch's start-up (a rank importing Lightning while the others wait)
overlaps another's work on the second core; each test then takes its launch's result, or its error.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from benchmarks.ranks import LAUNCHER_VARIABLES as _LAUNCHER_VARIABLES
from benchmarks.ranks import ROOT, clean_env, free_port, group_members, kill_group

__all__ = ["ROOT", "_LAUNCHER_VARIABLES", "clean_env", "free_port", "group_members", "in_background", "kill_group"]

K = TypeVar("K")
T = TypeVar("T")

# Launches running at once: two cores, and a 2-rank Lightning launch mostly keeps one of them busy (rank 0 waits
# while rank 1 imports, the ranks wait on each other in collectives).
PARALLEL_LAUNCHES = 3


def in_background(jobs: dict[K, Callable[[], T]], workers: int = PARALLEL_LAUNCHES) -> dict[K, Future[T]]:
    """Start ``jobs`` (each a function that launches and waits for its own processes) in threads, ``workers`` at
    a time, in the given order: ``{key: future}``; ``future.result()`` waits for that job and raises its error.
    The executor is shut down without waiting: the futures keep their jobs' results."""
    executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="launch")
    try:
        return {key: executor.submit(job) for key, job in jobs.items()}
    finally:
        executor.shutdown(wait=False)
