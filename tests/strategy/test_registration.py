"""``import lightning_fsdp`` registers "fsdp_custom" and "hpu" with Lightning whichever module brings Lightning in, and
the engine imports without Lightning. Each case runs in a fresh interpreter, as the import order is the point; the
interpreters are independent, so all of them start at once (a module fixture) and each test checks its own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.ranks import ROOT, clean_env, kill_group

REGISTERED = """
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry
names = ["fsdp_custom", "fsdp_custom_spawn", "fsdp_custom_fork", "fsdp_custom_shard_grad_op", "fsdp_custom_no_shard"]
missing = [name for name in names if name not in StrategyRegistry]
assert not missing, missing
assert "hpu" in AcceleratorRegistry
from lightning_fsdp.strategy import FSDPStrategy
assert type(StrategyRegistry.get("fsdp_custom_no_shard")) is FSDPStrategy
assert StrategyRegistry.get("fsdp_custom_no_shard").sharding_strategy.name == "NO_SHARD"
print("registered", len(names))
"""

IMPORT_ORDERS = {
    "lightning first": "import lightning\nimport lightning_fsdp\n",
    "package, then a public name": "import lightning_fsdp\nfrom lightning_fsdp import FSDPStrategy\n",
    "package, then Lightning": "import lightning_fsdp\nimport lightning.pytorch\n",
    "the strategy module directly": "from lightning_fsdp.strategy import FSDPStrategy\n",
    "a checkpoint module first": "import lightning_fsdp.checkpoint.sharded\n",
    "the pipeline package first": "import lightning_fsdp.pipeline\n",
    # accelerators/hpu.py imports Lightning, so registration runs half-way through that file
    "package, then accelerators": "import lightning_fsdp\nimport accelerators\n",
    "accelerators, then package": "import accelerators\nimport lightning_fsdp\n",
}


ENGINE_ALONE = """
import sys
import torch
from torch import nn
import lightning_fsdp.engine as engine_pkg
assert not [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")], "Lightning was imported"
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
engine = engine_pkg.fully_shard(model)
model(torch.ones(2, 4)).sum().backward()
assert not [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")], "Lightning was imported"
print("units", len(engine.units))
"""
WAIT_S = 600  # a guard against an interpreter that never ends (they used to get 120 s each, one after another)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every case's interpreter, all started at once: {case: its completed process}. Output goes to files, so no
    process waits on a pipe while another one is read."""
    folder = tmp_path_factory.mktemp("registration")
    codes = {order: code + REGISTERED for order, code in IMPORT_ORDERS.items()}
    codes["engine alone"] = ENGINE_ALONE
    procs: dict[str, tuple[subprocess.Popen, Path, Path]] = {}
    try:
        for i, (name, code) in enumerate(codes.items()):
            out, err = folder / f"{i}.out", folder / f"{i}.err"
            with open(out, "wb") as stdout, open(err, "wb") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-c", code],
                    cwd=ROOT,
                    env=clean_env(),
                    stdout=stdout,
                    stderr=stderr,
                    start_new_session=True,
                )
            procs[name] = (proc, out, err)
        deadline = time.monotonic() + WAIT_S
        done: dict[str, subprocess.CompletedProcess] = {}
        for name, (proc, out, err) in procs.items():
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            done[name] = subprocess.CompletedProcess(proc.args, rc, out.read_text(), err.read_text())
    finally:
        for proc, _, _ in procs.values():
            kill_group(proc.pid)
            proc.wait()
    assert len(done) == len(IMPORT_ORDERS) + 1
    return done


@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_every_import_order_registers_the_strategies(results, order):
    result = results[order]
    assert result.returncode == 0, result.stderr
    assert "registered 5" in result.stdout
    assert "could not register" not in result.stderr


def test_the_engine_imports_without_lightning_and_trains_a_step(results):
    result = results["engine alone"]
    assert result.returncode == 0, result.stderr
    assert "units" in result.stdout
