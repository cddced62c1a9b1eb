"""Helpers for tests that start their own processes: a clean environment, a free port, and process groups that can
be checked and killed as a whole (every job starts in a session of its own, so nothing is left behind).

They are the benchmarks' own (benchmarks/ranks.py): one harness starts and stops ranks for both."""

from __future__ import annotations

from benchmarks.ranks import LAUNCHER_VARIABLES as _LAUNCHER_VARIABLES
from benchmarks.ranks import ROOT, clean_env, free_port, group_members, kill_group

__all__ = ["ROOT", "_LAUNCHER_VARIABLES", "clean_env", "free_port", "group_members", "kill_group"]
