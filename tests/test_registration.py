"""``import lightning_fsdp`` registers "fsdp_custom" and "hpu" with Lightning whichever module brings Lightning in, and
the engine imports without Lightning. Each case runs in a fresh interpreter, as the import order is the point."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.processes import ROOT, clean_env

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
}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_every_import_order_registers_the_strategies(order):
    result = _run(IMPORT_ORDERS[order] + REGISTERED)
    assert result.returncode == 0, result.stderr
    assert "registered 5" in result.stdout
    assert "could not register" not in result.stderr


def test_the_engine_imports_without_lightning_and_trains_a_step():
    code = """
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
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert "units" in result.stdout
