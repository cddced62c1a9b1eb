"""Test double of ``habana_frameworks.torch.hpu``: device count, availability, memory stats, current device.

``FAKE_HPU_DEVICES`` (default 2) sets how many HPUs the double reports; 0 makes ``is_available()`` False.
"""

import os

import torch

_DeviceLike = torch.device | str | int | None

_current_device = 0


def device_count() -> int:
    raw = os.environ.get("FAKE_HPU_DEVICES", "2")
    try:
        count = int(raw)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"FAKE_HPU_DEVICES must be a non-negative integer, got {raw!r}.")
    return count


def is_available() -> bool:
    return device_count() > 0


def _index(device: _DeviceLike) -> int:
    """The device index named by ``device`` (``None`` or an index-less ``"hpu"`` means the current device)."""
    if device is None:
        return _current_device
    if isinstance(device, int):
        index: int | None = device
    else:
        device = torch.device(device)
        if device.type != "hpu":
            raise ValueError(f"Expected an 'hpu' device, got {device}.")
        index = device.index
    if index is None:
        return _current_device
    if not 0 <= index < device_count():
        raise ValueError(f"Invalid HPU index {index}: valid indices are 0..{device_count() - 1}.")
    return index


def set_device(device: _DeviceLike) -> None:
    global _current_device
    _current_device = _index(device)


def current_device() -> int:
    return _current_device


def get_device_name(device: _DeviceLike = None) -> str:
    _index(device)
    return "GAUDI2 (test double)"


def memory_stats(device: _DeviceLike = None) -> dict[str, int]:
    """Plausible values with the real bridge's keys (bytes for sizes, counts otherwise)."""
    _index(device)
    return {
        "Limit": 96 * 2**30,
        "InUse": 0,
        "MaxInUse": 0,
        "NumAllocs": 0,
        "NumFrees": 0,
        "ActiveAllocs": 0,
        "MaxAllocSize": 0,
        "TotalSystemAllocs": 0,
        "TotalSystemFrees": 0,
        "TotalActiveAllocs": 0,
    }
