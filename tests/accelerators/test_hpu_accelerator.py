"""Tests of the HPU accelerator, with no Gaudi software and with the CPU test double in ``tests/fakes``."""

import importlib
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from accelerators import HPUAccelerator, check_eager_mode, register_hpu_accelerator
from accelerators.hpu_runtime import is_test_double
from lightning_fsdp.shutdown import destroy_process_group
from tests.toolbox.launch import FAKES


def _forget_habana_modules() -> dict:
    """Drop ``habana_frameworks`` and its submodules from ``sys.modules`` and return what was dropped."""
    names = [name for name in sys.modules if name == "habana_frameworks" or name.startswith("habana_frameworks.")]
    return {name: sys.modules.pop(name) for name in names}


@pytest.fixture
def no_gaudi(monkeypatch):
    """Make ``habana_frameworks`` unimportable, even on a machine where it is installed."""
    saved = _forget_habana_modules()
    # A None entry in sys.modules makes `import habana_frameworks[.anything]` raise ModuleNotFoundError.
    monkeypatch.setitem(sys.modules, "habana_frameworks", None)
    yield
    monkeypatch.undo()
    _forget_habana_modules()
    sys.modules.update(saved)


@pytest.fixture
def gaudi_double(monkeypatch):
    """Put the test double first on ``sys.path`` with 2 fake HPUs; restore the import state afterwards."""
    saved = _forget_habana_modules()
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.setenv("FAKE_HPU_DEVICES", "2")
    yield
    monkeypatch.undo()
    _forget_habana_modules()
    sys.modules.update(saved)


# --- without Gaudi software ---------------------------------------------------------------------------------------


def test_accelerator_is_a_complete_lightning_accelerator():
    # Instantiation fails if any abstract method of Lightning's Accelerator is left unimplemented.
    accelerator = HPUAccelerator()
    assert isinstance(accelerator, Accelerator)
    assert not HPUAccelerator.__abstractmethods__
    assert HPUAccelerator.name() == accelerator.name() == "hpu"


def test_package_never_imports_gaudi_software_at_import_time(gaudi_double):
    # Import a fresh copy of the package while the double is importable: the import must not load it, a probe must.
    # The original modules go back afterwards so the classes used by the other tests stay the same objects.
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "accelerators"}
    try:
        fresh = importlib.import_module("accelerators")
        assert fresh.HPUAccelerator is not HPUAccelerator  # really a fresh import
        assert "habana_frameworks" not in sys.modules
        assert fresh.HPUAccelerator.is_available() is True
        assert "habana_frameworks.torch.hpu" in sys.modules
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == "accelerators"]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_unavailable_without_gaudi_software(no_gaudi):
    assert HPUAccelerator.is_available() is False
    assert HPUAccelerator.auto_device_count() == 0
    assert HPUAccelerator().get_device_stats(torch.device("hpu", 0)) == {}
    assert is_test_double() is False


@pytest.mark.parametrize("devices", [1, 2, -1, "auto", "0,1", "1", [0]])
def test_asking_for_devices_without_gaudi_software_says_how_to_fix_it(no_gaudi, devices):
    for method in (HPUAccelerator.parse_devices, HPUAccelerator.get_parallel_devices):
        with pytest.raises(MisconfigurationException) as error:
            method(devices)
        message = str(error.value)
        assert "Intel Gaudi software was not found" in message
        assert repr(devices) in message
        assert "Install" in message and "accelerator='cpu'" in message


def test_setup_device_without_gaudi_software_raises(no_gaudi, monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    with pytest.raises(MisconfigurationException, match="Intel Gaudi software was not found"):
        HPUAccelerator().setup_device(torch.device("hpu", 0))


def test_lightning_trainer_rejects_hpu_without_gaudi_software(no_gaudi):
    from lightning.pytorch import Trainer

    # Lightning asks our is_available() and refuses before touching any device.
    with pytest.raises(MisconfigurationException, match="HPUAccelerator` can not run on your system"):
        Trainer(accelerator=HPUAccelerator(), devices=1, logger=False, enable_checkpointing=False)


# --- registration ---------------------------------------------------------------------------------------------


def test_registers_as_hpu_in_an_empty_registry_and_is_idempotent():
    registry = _AcceleratorRegistry()
    assert register_hpu_accelerator(registry) is True
    assert registry["hpu"]["accelerator"] is HPUAccelerator
    assert isinstance(registry.get("hpu"), HPUAccelerator)
    assert register_hpu_accelerator(registry) is True  # a second call neither raises nor changes the entry
    assert registry["hpu"]["accelerator"] is HPUAccelerator
    assert registry.available_accelerators() == {"hpu"}


def test_leaves_a_foreign_hpu_entry_alone():
    class ForeignHPUAccelerator(HPUAccelerator):
        pass

    registry = _AcceleratorRegistry()
    registry.register("hpu", ForeignHPUAccelerator, description="another package", answer=42)
    before = dict(registry["hpu"])
    assert register_hpu_accelerator(registry) is False
    assert registry["hpu"] == before
    assert registry["hpu"]["accelerator"] is ForeignHPUAccelerator


def test_registers_in_lightnings_global_registry_by_default():
    saved = AcceleratorRegistry.pop("hpu", None)
    try:
        assert register_hpu_accelerator() is True
        assert AcceleratorRegistry["hpu"]["accelerator"] is HPUAccelerator
        assert "cpu" in AcceleratorRegistry  # Lightning's own entries are untouched
    finally:
        AcceleratorRegistry.pop("hpu", None)
        if saved is not None:
            AcceleratorRegistry["hpu"] = saved


# --- with the CPU test double ---------------------------------------------------------------------------------


def test_double_makes_hpus_available(gaudi_double, monkeypatch):
    assert is_test_double() is True
    assert HPUAccelerator.is_available() is True
    assert HPUAccelerator.auto_device_count() == 2
    monkeypatch.setenv("FAKE_HPU_DEVICES", "4")
    assert HPUAccelerator.auto_device_count() == 4
    monkeypatch.setenv("FAKE_HPU_DEVICES", "0")
    assert HPUAccelerator.is_available() is False
    assert HPUAccelerator.auto_device_count() == 0
    with pytest.raises(MisconfigurationException, match="sees no HPU"):
        HPUAccelerator.parse_devices(1)


@pytest.mark.parametrize(
    ("devices", "indices"),
    [
        (1, [0]),
        (2, [0, 1]),
        ("auto", [0, 1]),
        (-1, [0, 1]),
        ("-1", [0, 1]),
        ("1", [0]),
        ("0,1", [0, 1]),
        ("1,", [1]),  # Lightning's convention: a comma means indices
        ([1], [1]),
        ((1, 0), [1, 0]),
    ],
)
def test_device_parsing(gaudi_double, devices, indices):
    expected = [torch.device("hpu", index) for index in indices]
    assert HPUAccelerator.parse_devices(devices) == indices
    assert HPUAccelerator.get_parallel_devices(devices) == expected
    # Lightning's own order of calls: parse first, then map the parsed value to devices.
    assert HPUAccelerator.get_parallel_devices(HPUAccelerator.parse_devices(devices)) == expected


@pytest.mark.parametrize("devices", [0, -2, True, 1.5, None, "", "0", "x", "0,x", [], [0, 0], [-1], ["0"]])
def test_invalid_devices_name_the_value_and_the_valid_forms(gaudi_double, devices):
    with pytest.raises(ValueError, match=re.escape(f"devices={devices!r}")) as error:
        HPUAccelerator.parse_devices(devices)
    assert "-1 or 'auto'" in str(error.value)


@pytest.mark.parametrize(
    ("devices", "hint"),
    [(3, "Valid counts are 1..2"), ([2], "Valid indices are 0..1"), ("0,5", "Valid indices are 0..1")],
)
def test_devices_beyond_the_visible_hpus_are_rejected(gaudi_double, devices, hint):
    with pytest.raises(ValueError, match=re.escape(hint)):
        HPUAccelerator.get_parallel_devices(devices)


def test_device_stats_come_from_the_bridge(gaudi_double):
    import habana_frameworks.torch.hpu as hpu

    stats = HPUAccelerator().get_device_stats(torch.device("hpu", 1))
    assert stats == hpu.memory_stats(1)
    assert stats["Limit"] == 96 * 2**30 and "InUse" in stats


def test_eager_mode_check(gaudi_double, monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    with pytest.raises(MisconfigurationException, match="PT_HPU_LAZY_MODE=0") as error:
        check_eager_mode()
    assert "'1'" in str(error.value) and "PT_HPU_EAGER_PIPELINE_ENABLE=0" in str(error.value)
    monkeypatch.delenv("PT_HPU_LAZY_MODE")
    with pytest.raises(MisconfigurationException, match="unset"):
        check_eager_mode()
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    assert check_eager_mode() is None


def test_setup_device_checks_device_and_eager_mode(gaudi_double, monkeypatch):
    accelerator = HPUAccelerator()
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    with pytest.raises(MisconfigurationException, match="lazy mode"):
        accelerator.setup_device(torch.device("hpu", 1))
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    assert accelerator.setup_device(torch.device("hpu", 1)) is None
    with pytest.raises(ValueError, match=re.escape("HPU index 2 is not visible")):
        accelerator.setup_device(torch.device("hpu", 2))
    with pytest.raises(MisconfigurationException, match="needs an 'hpu' device"):
        accelerator.setup_device(torch.device("cpu"))


def test_lightning_trainer_gets_hpu_parallel_devices(gaudi_double):
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy

    # Only the connector's device handling is exercised: nothing is launched or moved to a device.
    trainer = Trainer(
        accelerator=HPUAccelerator(),
        devices="0,1",
        strategy=DDPStrategy(process_group_backend="hccl"),
        logger=False,
        enable_checkpointing=False,
    )
    assert isinstance(trainer.accelerator, HPUAccelerator)
    assert trainer.strategy.parallel_devices == [torch.device("hpu", 0), torch.device("hpu", 1)]
    assert trainer.num_devices == 2


def _all_reduce_over_fake_hccl(rank: int, fakes: str, init_file: str, results: str) -> None:
    # Runs in a spawned process: make the double importable there, then import the hccl module for its side effect.
    sys.path.insert(0, fakes)
    import habana_frameworks.torch.distributed.hccl  # noqa: F401

    dist.init_process_group("hccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tensor = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        dist.all_reduce(tensor)
        torch.save({"backend": dist.get_backend(), "sum": tensor}, os.path.join(results, f"rank{rank}.pt"))
    finally:
        destroy_process_group()


def test_double_registers_an_hccl_backend_that_all_reduces(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Fork where the platform has it: spawned children re-import this module and with it Lightning, which costs
    # several seconds per process on a loaded machine. The parent never initializes torch.distributed, so forking
    # is safe; the backend is registered only inside the children.
    start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _all_reduce_over_fake_hccl,
        args=(str(FAKES), str(tmp_path / "rendezvous"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method=start_method,
    )
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["backend"] == "hccl"
        assert torch.equal(result["sum"], torch.tensor([3.0, 30.0]))
