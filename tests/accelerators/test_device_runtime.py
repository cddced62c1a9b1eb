"""The device runtimes (lightning_fsdp/engine/devices.py): the registry keyed by device type, and the strategy, the
engine's streams and the monitor asking it instead of branching on device names. A made-up runtime is registered
for a device type torch knows but this project registers nothing for ("xpu"), and everything asks it."""

from __future__ import annotations

import types

import pytest
import torch

import accelerators  # noqa: F401  (registers the hpu runtime, as importing lightning_fsdp with Lightning does)
from accelerators.hpu_runtime import HPURuntime
from lightning_fsdp.engine import devices
from lightning_fsdp.engine.devices import (
    CPURuntime,
    CUDARuntime,
    DeviceRuntime,
    device_runtime,
    register_device_runtime,
)
from lightning_fsdp.engine.streams import CollectiveStreams, pins_host_memory, stream_module
from lightning_fsdp.strategy import FSDPStrategy


class StubRuntime(DeviceRuntime):
    """A made-up accelerator: its own backend name, compute on CPU, a recorded start-up, a stream module."""

    device_type = "xpu"
    process_group_backend = "stub-backend"
    binds_device_id = True

    def __init__(self) -> None:
        self.started = 0
        self.module = types.SimpleNamespace(name="stub streams")

    def compute_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu")

    def before_process_group(self) -> None:
        self.started += 1

    def stream_module(self, device: torch.device) -> types.ModuleType | None:
        return self.module  # type: ignore[return-value]  # a stand-in: nothing calls it here

    def pins_host_memory(self, device: torch.device) -> bool:
        return True


@pytest.fixture
def stub(monkeypatch):
    # Registered into a copy of the registry, which the monkeypatch puts back afterwards.
    monkeypatch.setattr(devices, "_RUNTIMES", dict(devices._RUNTIMES))
    runtime = StubRuntime()
    register_device_runtime(runtime)
    return runtime


def test_the_registry_answers_by_device_type():
    assert isinstance(device_runtime(torch.device("cpu")), CPURuntime)
    assert isinstance(device_runtime("cuda"), CUDARuntime)
    assert isinstance(device_runtime(torch.device("cuda", 1)), CUDARuntime)
    # By name: tests/test_hpu_accelerator.py imports accelerators afresh, whose HPURuntime class is then registered.
    assert type(device_runtime(torch.device("hpu", 0))).__name__ == HPURuntime.__name__
    assert [device_runtime(t).process_group_backend for t in ("cpu", "cuda", "hpu")] == ["gloo", "nccl", "hccl"]
    assert [device_runtime(t).binds_device_id for t in ("cpu", "cuda", "hpu")] == [False, True, False]
    # A type nobody registered: the default runtime (torch's device module, gloo).
    default = device_runtime("mtia")
    assert type(default) is DeviceRuntime and default.process_group_backend == "gloo"
    assert default.stream_module(torch.device("meta")) is None and not default.pins_host_memory(torch.device("meta"))


def test_a_runtime_must_name_its_device_type():
    with pytest.raises(ValueError, match="names no device_type"):
        register_device_runtime(DeviceRuntime())


def test_registering_replaces_the_answer_for_that_type_only(stub):
    assert device_runtime(torch.device("xpu", 3)) is stub and device_runtime("xpu") is stub
    assert isinstance(device_runtime("cpu"), CPURuntime)
    # The engine's streams ask it.
    assert stream_module(torch.device("xpu", 0)) is stub.module
    assert pins_host_memory(torch.device("xpu", 0))
    assert not pins_host_memory(torch.device("cpu"))
    assert not CollectiveStreams("cpu").active


def test_the_strategy_asks_the_runtime_of_its_device(stub):
    strategy = FSDPStrategy(parallel_devices=[torch.device("xpu", 0)])
    assert strategy.device_runtime is stub
    assert strategy._get_process_group_backend() == "stub-backend"
    assert strategy.root_device == torch.device("cpu")  # the stub's compute device
    # The user's backend wins over the runtime's.
    assert (
        FSDPStrategy(
            parallel_devices=[torch.device("xpu", 0)], process_group_backend="gloo"
        )._get_process_group_backend()
        == "gloo"
    )
    # On CPU, the CPU runtime's.
    cpu = FSDPStrategy(parallel_devices=[torch.device("cpu")])
    assert cpu._get_process_group_backend() == "gloo" and cpu.root_device == torch.device("cpu")


def test_setup_environment_runs_the_runtime_start_up_before_the_process_group(stub, monkeypatch):
    order = []
    strategy = FSDPStrategy(parallel_devices=[torch.device("xpu", 0)])

    class Accelerator:
        def setup_device(self, device):
            order.append(("setup_device", device))

    monkeypatch.setattr(strategy, "_accelerator", Accelerator())
    monkeypatch.setattr(strategy, "setup_distributed", lambda: order.append(("process group", stub.started)))
    monkeypatch.setattr("lightning_fsdp.strategy.check_launch_size", lambda *args: None)
    strategy.setup_environment()
    assert order == [("setup_device", torch.device("xpu", 0)), ("process group", 1)]
