"""Launching the test scripts (tests/scripts/) and other commands as users start theirs, so that nothing is left
behind: each runs in a session of its own, and its whole process group is killed when it ends, fails or outlives its
timeout (Lightning's launcher starts the other ranks as children of rank 0, which a timeout of rank 0 alone would
leave blocked in a collective). The environment, the free port and the process-group calls are the benchmarks' own
harness (benchmarks/ranks.py): one harness starts and stops ranks for both.

``in_background``: independent launches of a module (each its own processes, files and port) started together by
a module fixture, a few at a time, so that one launch's start-up (a rank importing Lightning while the others wait)
overlaps another's work on the second core; each test then takes its launch's result, or its error.

``run_together``: several configurations of one script in one launch, one after another in the same processes
(``--and`` between their arguments; the script loops over :func:`argument_groups`). Each process imports torch and
Lightning once (about 4.5 s of CPU per process here) instead of once per configuration; Lightning's launcher starts
the other ranks at the first ``fit`` only (rank 0 then has ``LOCAL_RANK`` set), and the default group is reused.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from benchmarks.ranks import ROOT, clean_env, free_port, kill_group

K = TypeVar("K")
T = TypeVar("T")

SCRIPTS = ROOT / "tests" / "scripts"
FAKES = ROOT / "tests" / "fakes"  # the Gaudi test double (habana_frameworks on CPU)

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


AND = "--and"  # between two configurations' arguments in one launch (run_together)


def argument_groups(argv: Sequence[str]) -> list[list[str]]:
    """A script's command line split into its configurations' arguments at each ``--and``."""
    groups: list[list[str]] = [[]]
    for arg in argv:
        if arg == AND:
            groups.append([])
        else:
            groups[-1].append(arg)
    return groups


def join_configurations(configs: Sequence[Sequence[str]]) -> list[str]:
    """The command line of one launch running ``configs`` (each a script's arguments) one after another."""
    joined: list[str] = []
    for config in configs:
        joined += [*([AND] if joined else []), *config]
    return joined


class Part(Generic[K, T]):
    """One configuration's result inside a launch that ran several: ``result()`` waits for the launch."""

    def __init__(self, launch: Future[dict[K, T]], key: K) -> None:
        self._launch, self._key = launch, key

    def result(self) -> T:
        return self._launch.result()[self._key]


def run_together(
    launch: Callable[[list[str]], list[T]], configs: dict[K, Sequence[str]], launches: int = 1
) -> dict[K, Part[K, T]]:
    """Run ``configs`` (key -> the script's arguments for that configuration) in ``launches`` launches started
    together (``in_background``). ``launch(arguments)`` runs one share, its configurations joined by ``--and``, and
    returns their results in order. Returns ``{key: Part}``."""
    keys = list(configs)
    shares = [keys[i::launches] for i in range(launches) if keys[i::launches]]

    def run_share(share: list[K]) -> dict[K, T]:
        results = launch(join_configurations([configs[key] for key in share]))
        assert len(results) == len(share), f"{len(share)} configurations, {len(results)} results"
        return dict(zip(share, results, strict=True))

    futures = in_background({i: partial(run_share, share) for i, share in enumerate(shares)})
    return {key: Part(futures[i], key) for i, share in enumerate(shares) for key in share}


def run_configurations(script: str, folder: Path, args: list[str], timeout_per_run: float) -> list[Path]:
    """One launch of ``script`` running the configurations in ``args`` (``--and`` between them), each given
    ``--out`` of its own under ``folder``: those paths, in order."""
    groups = argument_groups(args)
    outs = [Path(tempfile.mkdtemp(dir=folder)) / "out" for _ in groups]
    joined = join_configurations([["--out", str(out), *group] for out, group in zip(outs, groups, strict=True)])
    run_script(script, *joined, cwd=folder, timeout=timeout_per_run * len(groups))
    return outs


def with_fakes_on_path(**extra: str) -> dict[str, str]:
    """``clean_env`` with the Gaudi test double importable as ``habana_frameworks``, plus ``extra``."""
    return clean_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(FAKES)]), **extra)


def output_tails(stdout: str, stderr: str) -> str:
    """The end of a launch's output, for an assertion message: what a failed rank printed last."""
    return f"{stdout[-3000:]}\n{stderr[-6000:]}"


def start_logged(
    cmd: Sequence[str | Path], log: Path, *, env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a session of its own (default environment: ``clean_env()``), its stdout and stderr into the
    file ``log``: a file, not a pipe, which a process left behind would keep open, and which nothing has to read
    while other processes run. The caller ends the session's group (``kill_group(proc.pid)``) when done."""
    with open(log, "wb") as output:
        return subprocess.Popen(
            [str(part) for part in cmd],
            env=clean_env() if env is None else env,
            cwd=cwd,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextlib.contextmanager
def ranks_like_torchrun(script: str, *args: str | Path, world: int, work: Path, timeout: float) -> Iterator[None]:
    """Each of ``world`` ranks of ``python tests/scripts/<script> *args`` started as torchrun starts them (one
    process per rank, ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``LOCAL_RANK`` in its environment, rank r's
    output in ``work/log.rank<r>``, working directory ``work``). The ``with`` body runs while they do; then every
    rank must exit 0 within ``timeout`` seconds, and whatever is left is killed."""
    port = str(free_port())
    procs = []
    codes: list[int] = []
    try:
        for rank in range(world):
            env = clean_env(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world), NODE_RANK="0", LOCAL_RANK=str(rank)
            )
            procs.append(
                start_logged([sys.executable, SCRIPTS / script, *args], work / f"log.rank{rank}", env=env, cwd=work)
            )
        yield
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            kill_group(p.pid)
            p.wait()
    logs = "\n".join((work / f"log.rank{r}").read_text()[-3000:] for r in range(world))
    assert codes == [0] * world, logs


def run_command(
    cmd: Sequence[str | Path],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a session of its own with its output captured, in ``env`` (default: ``clean_env()``).

    On timeout the whole group is killed and an AssertionError carries the output's end; when the command ends, what
    is left of its group is killed too. ``check``: a non-zero exit status fails with the output's end; without it
    the caller judges the completed process (a launch expected to die)."""
    argv = [str(part) for part in cmd]
    proc = subprocess.Popen(
        argv,
        env=clean_env() if env is None else env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{argv} timed out after {timeout}s:\n{output_tails(stdout, stderr)}") from None
    finally:
        kill_group(proc.pid)  # nothing of the launch outlives it
    if check:
        assert proc.returncode == 0, f"{argv} exited with {proc.returncode}:\n{output_tails(stdout, stderr)}"
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def run_script(
    script: str | Path,
    *args: str | Path,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``python tests/scripts/<script> *args`` (or ``script`` itself when it is a path) through :func:`run_command`."""
    path = script if isinstance(script, Path) else SCRIPTS / script
    return run_command([sys.executable, path, *args], timeout=timeout, env=env, cwd=cwd, check=check)


def script_output(
    script: str | Path, out: Path, *args: str | Path, timeout: float, env: dict[str, str] | None = None
) -> Any:
    """Run ``script --out out *args`` in ``out``'s folder (:func:`run_script`) and return what it saved in ``out``."""
    run_script(script, "--out", out, *args, timeout=timeout, env=env, cwd=out.parent)
    return torch.load(out, weights_only=False)


def rank_outputs(out: str | Path, ranks: int) -> list[Any]:
    """What each of ``ranks`` ranks of a script saved in ``{out}.rank{r}``, in rank order."""
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(ranks)]
