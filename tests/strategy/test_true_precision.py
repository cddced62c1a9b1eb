"""``precision="bf16-true"`` / ``"16-true"``: shards, gradients and optimizer state in the half dtype, as under
Lightning's own FSDP and single-device half precision; fp32 master shards only under the "-mixed" flags.

tests/scripts/true_precision_run.py trains ToyLM (built under ``trainer.init_module()``) with SGD + momentum on 2
CPU ranks, and once on one device with plain Lightning (``strategy="auto"``) on the same global batches.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_fsdp.precision import FSDPPrecision
from tests.toolbox.launch import rank_outputs, run_script

# bfloat16 keeps 8 significant bits: one unit in the last place is 2**-7 of a value in [1, 2). Sharded and
# single-device runs round differently (each rank's half-batch loss and gradient, the reduction), so they may
# differ by a few such units; 4 of them, relative to the largest magnitude compared, is the bound.
BF16_ULP = 2**-7
TOLERANCE_ULPS = 4


def run(tmp_path: Path, name: str, devices: int, strategy: str, precisions: str) -> list[dict]:
    """One launch of the script, every flag of ``precisions`` in it: [rank 0's {flag: result}, rank 1's, ...]."""
    out = tmp_path / name
    args = ["--out", out, "--devices", str(devices), "--strategy", strategy, "--precision", precisions]
    run_script("true_precision_run.py", *args, cwd=tmp_path, timeout=300)
    return rank_outputs(out, devices)


_launches: dict = {}


def sharded_runs(tmp_path_factory) -> list[dict]:
    """bf16-true, bf16-mixed and 16-true on 2 ranks, in one launch (once per pytest process)."""
    if "sharded" not in _launches:
        folder = tmp_path_factory.mktemp("true_precision")
        _launches["sharded"] = run(folder, "sharded", 2, "fsdp_custom_blocks", "bf16-true,bf16-mixed,16-true")
    return _launches["sharded"]


def test_true_flags_convert_init_and_inputs():
    plugin = FSDPPrecision("bf16-true")
    with plugin.tensor_init_context():
        assert torch.nn.Linear(2, 2).weight.dtype == torch.bfloat16
    with plugin.forward_context():
        assert torch.zeros(1).dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    assert plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.bfloat16
    assert plugin.convert_input((torch.ones(1), torch.ones(1, dtype=torch.long)))[0].dtype == torch.bfloat16
    assert plugin.convert_input(torch.ones(1, dtype=torch.long)).dtype == torch.long
    assert FSDPPrecision("16-true").convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.float16
    mixed = FSDPPrecision("bf16-mixed")  # fp32 master weights: nothing converted
    assert mixed.convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.float32
    with mixed.tensor_init_context():
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32
    assert mixed.convert_input(torch.ones(1)).dtype == torch.float32


def test_bf16_true_holds_bf16_and_matches_plain_lightning(tmp_path, tmp_path_factory):
    runs = sharded_runs(tmp_path_factory)
    sharded, mixed = [r["bf16-true"] for r in runs], [r["bf16-mixed"] for r in runs]
    single = run(tmp_path, "single", 1, "auto", "bf16-true")[0]["bf16-true"]
    for rank, result in enumerate(sharded):
        for key in ("built_dtypes", "param_dtypes", "grad_dtypes", "state_dtypes"):
            assert result[key] == ["torch.bfloat16"], (rank, key, result[key])
        assert result["counts"] == (12, 12, 12), rank  # every trainable parameter: a gradient and a momentum buffer
    assert single["param_dtypes"] == single["state_dtypes"] == ["torch.bfloat16"]

    # Memory per rank against bf16-mixed (fp32 shards, gradients and momentum): exactly half.
    for rank in range(2):
        for key in ("param_bytes", "grad_bytes", "state_bytes"):
            assert 2 * sharded[rank][key] == mixed[rank][key] > 0, (rank, key)
        assert mixed[rank]["state_dtypes"] == ["torch.float32"]
    assert sum(r["param_bytes"] for r in sharded) == single["param_bytes"]  # the shards add up to the model

    losses, reference = torch.tensor(sharded[0]["losses"]), torch.tensor(single["losses"])
    assert losses.numel() == reference.numel() == 6
    bound = TOLERANCE_ULPS * BF16_ULP * reference.abs()
    assert ((losses - reference).abs() <= bound).all(), (losses, reference)
    compared = 0
    for name, expected in single["state"].items():
        for rank in range(2):
            got = sharded[rank]["state"][name]  # the full trained weights on every rank after fit
            assert got.dtype == expected.dtype == torch.bfloat16, name
            bound = TOLERANCE_ULPS * BF16_ULP * expected.float().abs().max()
            assert (got.float() - expected.float()).abs().max() <= bound, (name, rank)
            compared += 1
    assert compared == 2 * 15  # 15 tensors in ToyLM's state dict (the tied head included)


def test_16_true_holds_float16(tmp_path_factory):
    for rank, result in enumerate(r["16-true"] for r in sharded_runs(tmp_path_factory)):
        for key in ("built_dtypes", "param_dtypes", "grad_dtypes", "state_dtypes"):
            assert result[key] == ["torch.float16"], (rank, key, result[key])
        assert all(torch.isfinite(torch.tensor(result["losses"])))
