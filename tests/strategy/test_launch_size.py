"""An external launcher that starts a different number of processes than the Trainer expects (``mpirun -np 4`` with
``devices=2``) is refused on every rank before any collective, naming both numbers (before: an IndexError in
``strategy.device`` on the extra ranks, or a quiet run on fewer processes)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.rendezvous import check_launch_size


@pytest.fixture
def torchrun_world(monkeypatch: pytest.MonkeyPatch):
    def launched(world_size: int) -> TorchElasticEnvironment:
        for name, value in {"WORLD_SIZE": world_size, "RANK": 0, "LOCAL_RANK": 0, "GROUP_RANK": 0}.items():
            monkeypatch.setenv(name, str(value))
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-size-test")
        return TorchElasticEnvironment()

    return launched


def test_more_processes_than_the_trainer_expects_are_refused_before_any_device_or_group(torchrun_world) -> None:
    strategy = FSDPStrategy(cluster_environment=torchrun_world(4), parallel_devices=[torch.device("cpu")] * 2)
    strategy.num_nodes = 1
    with pytest.raises(ValueError) as error:
        strategy.setup_environment()  # refused before the accelerator or the process group is touched
    message = str(error.value)
    assert "TorchElasticEnvironment reports 4 processes" in message
    assert "num_nodes=1 x devices=2 = 2" in message
    assert "mpirun -np 2" in message


def test_fewer_processes_than_the_trainer_expects_are_refused(torchrun_world) -> None:
    with pytest.raises(ValueError, match=r"reports 2 processes.*num_nodes=2 x devices=2 = 4"):
        check_launch_size(torchrun_world(2), num_nodes=2, devices=2)


def test_matching_and_self_started_launches_pass(torchrun_world) -> None:
    check_launch_size(torchrun_world(4), num_nodes=2, devices=2)
    # Lightning's launcher's ranks (LOCAL_RANK set, as the fixture left it): the world size comes from the strategy
    # later, so the environment's default of 1 is no disagreement.
    environment = LightningEnvironment()
    assert environment.creates_processes_externally and environment.world_size() == 1
    check_launch_size(environment, num_nodes=1, devices=2)
    check_launch_size(None, num_nodes=1, devices=2)
