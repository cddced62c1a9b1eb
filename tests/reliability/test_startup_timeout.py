"""``FSDPStrategy(startup_timeout=...)``: the rendezvous has a bound of its own, independent of the collective
``timeout`` (lightning_fsdp/rendezvous.py, [Note: two timeouts]).

- the option is validated when the strategy is built, and set from Lightning CLI YAML like the others;
- ``init_default_group`` on torchrun-style ranks (tests/scripts/rendezvous_run.py), one of them reaching the
  rendezvous ``LATE_S`` after the others with a 2 s collective timeout (all processes start together and import;
  the late one is held until ``LATE_S`` after the others called ``init_default_group``;
  tests/reliability/test_faults.py starts
  its late process late instead), along both of its paths: gloo on 2 ranks (the group made with the start-up bound,
  then its timeout changed; rank 0 is late, so a client waits for the store's server to exist) and, on 3 ranks, a
  backend torch cannot change the timeout of (the Gaudi test double's "hccl", gloo underneath: the ranks meet in a
  store first, then the group is made with the timeout; rank 2 is late, so without the ranks counting themselves in,
  rank 1, already connected to the store, would go on to connect the group under the 2 s timeout). Every rank must
  join, then report the 2 s timeout on the group and its store, and rank 0's all-reduce that the others withhold
  must fail after 2 s. Both runs go at once.

tests/reliability/test_faults.py runs the whole strategy the same way: 4 ranks, a 5 s timeout, one rank 20 s late.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import timedelta

import pytest

import lightning_fsdp  # noqa: F401  (registers "fsdp_custom")
from benchmarks.ranks import ROOT, clean_env, free_port, kill_group
from lightning_fsdp import FSDPStrategy
from lightning_fsdp.rendezvous import backend_names, resolve_timeout
from tests.toolbox.launch import FAKES, SCRIPTS, start_logged

SCRIPT = SCRIPTS / "rendezvous_run.py"
EXAMPLES = ROOT / "examples" / "cli"
TIMEOUT_S = 2  # the collective timeout of the 2-rank runs
LATE_S = 8  # how long after the other rank's arrival the late rank is let go (4 times the timeout)
STARTUP_S = 120  # their startup_timeout
WAIT_S = 300  # a guard against runs that never end, not a measurement


# ------------------------------------------------------------------------------------------- the option
BAD_VALUES = [
    # (value, exception, fragments of the message)
    (5, TypeError, ["startup_timeout=5", "datetime.timedelta", "or None"]),
    ("30m", TypeError, ["startup_timeout='30m'", "datetime.timedelta", "'0:30:00' in YAML"]),
    (True, TypeError, ["startup_timeout=True", "datetime.timedelta"]),
    (timedelta(0), ValueError, ["startup_timeout=datetime.timedelta(0)", "must be positive"]),
    (timedelta(seconds=-5), ValueError, ["startup_timeout=datetime.timedelta(days=-1", "must be positive"]),
]


@pytest.mark.parametrize("value,error,fragments", BAD_VALUES, ids=lambda v: None)
def test_bad_startup_timeout_is_refused_when_the_strategy_is_built(value, error, fragments):
    with pytest.raises(error) as info:
        FSDPStrategy(startup_timeout=value)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_startup_timeout_defaults_to_lightnings_and_is_independent_of_timeout():
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

    assert FSDPStrategy(timeout=timedelta(seconds=5))._startup_timeout == default_pg_timeout == timedelta(minutes=30)
    strategy = FSDPStrategy(timeout=timedelta(seconds=5), startup_timeout=timedelta(minutes=2))
    assert (strategy._timeout, strategy._startup_timeout) == (timedelta(seconds=5), timedelta(minutes=2))
    assert FSDPStrategy(startup_timeout=None)._startup_timeout is None


def test_backend_names_and_torch_defaults():
    assert backend_names("gloo") == {"gloo"}
    assert backend_names("cpu:gloo,cuda:nccl") == {"gloo", "nccl"}
    assert backend_names("hccl") == {"hccl"}
    assert resolve_timeout(timedelta(seconds=3), "nccl") == timedelta(seconds=3)
    assert resolve_timeout(None, "gloo") == timedelta(minutes=30)
    assert resolve_timeout(None, "hccl") == timedelta(minutes=30)


class _Refuses:
    """A backend like ProcessGroupNCCL on torch 2.13: ``set_timeout`` raises (the base Backend's), the private
    setter exists; or (``private=False``) a backend with neither."""

    def __init__(self, private: bool) -> None:
        self.calls: list[timedelta] = []
        if private:
            self._set_default_timeout = self.calls.append

    def set_timeout(self, timeout: timedelta) -> None:
        raise RuntimeError("Backend X does not support setting timeout")


def test_backend_timeout_setter_falls_back_to_the_private_one_then_reports_failure():
    from lightning_fsdp.rendezvous import _set_backend_timeout

    nccl_like, other = _Refuses(private=True), _Refuses(private=False)
    assert _set_backend_timeout(nccl_like, timedelta(seconds=7)) and nccl_like.calls == [timedelta(seconds=7)]
    assert not _set_backend_timeout(other, timedelta(seconds=7)) and other.calls == []


def test_both_timeouts_from_lightning_cli_yaml(capsys, monkeypatch, tmp_path):
    """The example config sets both (quoted h:m:s strings); a value that is no timedelta is refused by name."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_fsdp.demo.data import CharDataModule
    from lightning_fsdp.demo.module import GPTLightningModule

    monkeypatch.setattr(sys, "argv", ["train.py"])  # the arguments come from args= alone
    base = ["--config", str(EXAMPLES / "trainer_cpu.yaml"), "--config", str(EXAMPLES / "gpt_tiny.yaml")]
    built = LightningCLI(
        GPTLightningModule,
        CharDataModule,
        run=False,
        args=[*base, "--config", str(EXAMPLES / "strategy_by_class.yaml"), "--trainer.logger", "false"],
    )
    strategy = built.trainer.strategy
    assert isinstance(strategy, FSDPStrategy)
    assert (strategy._timeout, strategy._startup_timeout) == (timedelta(minutes=5), timedelta(minutes=30))

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_fsdp.FSDPStrategy\n    init_args:\n"
        "      startup_timeout: 30 minutes\n"
    )
    capsys.readouterr()
    with pytest.raises(SystemExit):
        LightningCLI(GPTLightningModule, CharDataModule, run=False, args=[*base, "--config", str(bad)])
    error = capsys.readouterr().err
    assert 'Parser key "startup_timeout"' in error and "30 minutes" in error and "h:m:s" in error, error[-3000:]


# ------------------------------------------------------------------------------ two ranks, one late, both paths
def _values(output: str, rank: int) -> dict[str, str]:
    return dict(re.findall(rf"RENDEZVOUS rank={rank} ([\w-]+)=(.*)", output))


def test_a_late_rank_joins_and_the_short_timeout_then_holds(tmp_path):
    # backend -> (world size, the late rank)
    cases = {"gloo": (2, 0), "hccl": (3, 2)}
    procs: dict[tuple[str, int], subprocess.Popen] = {}
    logs: dict[tuple[str, int], object] = {}
    envs: dict[str, dict] = {}
    args = ["--timeout", str(TIMEOUT_S), "--startup-timeout", str(STARTUP_S)]

    def start(backend: str, rank: int, hold: list[str]) -> None:
        log = tmp_path / f"{backend}{rank}.log"
        logs[backend, rank] = log
        env = {**envs[backend], "RANK": str(rank), "LOCAL_RANK": str(rank)}
        cmd = [sys.executable, SCRIPT, "--backend", backend, *args, *hold]
        procs[backend, rank] = start_logged(cmd, log, env=env, cwd=tmp_path)

    def output(backend: str, rank: int) -> str:
        log = logs.get((backend, rank))
        return log.read_text(errors="replace") if log is not None and log.exists() else ""

    def report() -> str:
        return "\n".join(f"--- {key} (rc={p.poll()}):\n{output(*key)[-4000:]}" for key, p in procs.items())

    try:
        for backend, (world, late) in cases.items():
            path = [str(ROOT)] + ([str(FAKES)] if backend == "hccl" else [])
            envs[backend] = clean_env(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), PYTHONPATH=":".join(path)
            )
            for rank in range(world):
                start(backend, rank, ["--hold", str(tmp_path / f"{backend}.go")] if rank == late else [])
        # Each late rank is let go LATE_S after the others have called init_default_group.
        deadline = time.monotonic() + WAIT_S
        pending = dict(cases)
        arrived: dict[str, float] = {}
        while pending:
            for backend, (world, late) in list(pending.items()):
                early = [r for r in range(world) if r != late]
                if all("init-start" in _values(output(backend, r), r) for r in early):
                    arrived.setdefault(backend, time.monotonic())
                if backend in arrived and time.monotonic() >= arrived[backend] + LATE_S:
                    (tmp_path / f"{backend}.go").touch()
                    del pending[backend]
            assert all(p.poll() in (None, 0) for p in procs.values()), report()
            assert time.monotonic() < deadline, report()
            time.sleep(0.1)
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert all(p.returncode == 0 for p in procs.values()), report()

        compared = 0
        for backend, (world, late) in cases.items():
            values = {r: _values(output(backend, r), r) for r in range(world)}
            # The early ranks waited for the late one far longer than the collective timeout, and all joined.
            waited = min(float(values[r]["joined"]) - float(values[r]["init-start"]) for r in values if r != late)
            early_arrival = max(float(values[r]["init-start"]) for r in values if r != late)
            assert waited >= LATE_S and float(values[late]["init-start"]) - early_arrival >= LATE_S, report()
            for rank in range(world):
                got = values[rank]
                assert got["group-timeout-ms"] == got["store-timeout-ms"] == str(TIMEOUT_S * 1000), report()
                assert got["sum"] == str(world * (world + 1) // 2) and got["done"], report()
                compared += 1
            # The withheld all-reduce failed on the collective timeout, measured from the call.
            assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in values[0]["withheld-error"], report()
            assert 0.8 * TIMEOUT_S <= float(values[0]["withheld-elapsed"]) <= TIMEOUT_S + 10, report()
            withheld = values[0]["withheld-elapsed"]
            print(f"\n[startup] {backend}: waited {waited:.1f}s for rank {late}; withheld all-reduce: {withheld}s")
        assert compared == 5
    finally:
        for proc in procs.values():
            kill_group(proc.pid)
            proc.wait()
