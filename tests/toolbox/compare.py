"""Comparing what a run ended with against what it should have: named tensors within a tolerance or bit for bit,
and optimizer state dicts. The tolerant comparison returns how many tensors it compared, so that a test can assert
that the comparison covered what it should (a comparison of nothing passes silently otherwise)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

# Parity with one device in float32: the sharded run sums gradients in another order, so values agree to rounding.
RTOL, ATOL = 1e-5, 1e-6


def assert_all_close(
    got: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    what: str = "",
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
) -> int:
    """``got`` has exactly ``expected``'s names, each tensor of its shape and close to it; returns how many tensors
    were compared."""
    assert sorted(got) == sorted(expected), f"{what}: names differ: {sorted(got)} vs {sorted(expected)}"
    for name, want in expected.items():
        assert tuple(got[name].shape) == tuple(want.shape), f"{what} {name}: {tuple(got[name].shape)} vs {want.shape}"
        torch.testing.assert_close(got[name], want, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}")
    return len(expected)


def assert_tensors_equal(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str) -> None:
    """The same names in the same order, each tensor of the same shape and dtype and bit for bit equal."""
    assert list(actual) == list(expected), f"{what}: keys differ: {list(actual)} vs {list(expected)}"
    for key, e in expected.items():
        a = actual[key]
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}[{key}]: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
        assert torch.equal(a.cpu(), e), f"{what}[{key}]: max abs diff {(a.cpu() - e).abs().max().item()}"


def assert_optimizer_equal(actual: dict, expected: dict, what: str) -> None:
    """Two optimizer state dicts (``state`` by parameter index, ``param_groups``) equal, tensors bit for bit."""
    assert actual["param_groups"] == expected["param_groups"], f"{what}: param_groups differ"
    assert sorted(actual["state"]) == sorted(expected["state"]), f"{what}: state indices differ"
    for index, entry in expected["state"].items():
        got = actual["state"][index]
        assert sorted(got) == sorted(entry), f"{what}[{index}]: {sorted(got)} vs {sorted(entry)}"
        for name, value in entry.items():
            if torch.is_tensor(value):
                assert got[name].shape == value.shape, f"{what}[{index}][{name}]: {got[name].shape} vs {value.shape}"
                assert torch.equal(got[name].cpu(), value), f"{what}[{index}][{name}] differs"
            else:
                assert got[name] == value, f"{what}[{index}][{name}]: {got[name]} vs {value}"


def max_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute difference between same-named tensors (``b``'s names), in float64."""
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)
