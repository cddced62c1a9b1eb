"""The reduce-precision benchmark command on a tiny GPT, 2 processes: its report's structure and the facts that hold
whatever the machine (bytes, errors that must be zero or not, finite losses). Timing is never asserted (the
machines are shared). vocab 65 splits ``wte`` unevenly over 2 ranks, so the padded reductions are exercised too.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.reduce_precision import REFERENCES, VARIANTS, main

STEPS, WARMUP, EVERY = 4, 1, 2
TINY = [
    *("--world-size", "2", "--layers", "2", "--width", "32", "--heads", "2", "--seq", "16", "--vocab", "65"),
    *("--batch", "2", "--steps", str(STEPS), "--warmup", str(WARMUP), "--distance-every", str(EVERY)),
]
KEYS = ["bf16c_fp32", "bf16c_bf16", "bf16c_wire", "fp32c_fp32", "fp32c_bf16", "fp32c_wire"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reduce-precision-benchmark")
    assert main([*TINY, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    return out, results, {r["key"]: r for r in results["variants"]}


def test_report_structure(run):
    out, results, rows = run
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "results.md").read_text()
    assert "python -m benchmarks.reduce_precision" in table
    assert results["environment"]["torch"] in table and results["date"] in table
    for heading in ("## Parameter distance to the group's fp32 reduction", "## How each figure is measured"):
        assert heading in table
    assert list(rows) == KEYS == list(VARIANTS)
    assert results["world_size"] == 2 and results["config"]["steps"] == STEPS
    assert results["distance_steps"] == [2, 4]
    for key, row in rows.items():
        assert row["status"] == "ok", (key, row.get("error"))
        assert any(line.startswith(f"| {row['name']} |") for line in table.splitlines()), row["name"]
        assert row["reference_key"] == REFERENCES[VARIANTS[key].compute]
        assert len(row["step_ms"]) == STEPS - WARMUP and len(row["warmup_step_ms"]) == WARMUP
        assert row["median_step_ms"] > 0 and row["step_ratio"] > 0
        assert len(row["param_distance"]) == len(results["distance_steps"])
    assert "reduce_wire_dtype=torch.bfloat16" in rows["fp32c_wire"]["mixed_precision"]
    assert "param_dtype=torch.bfloat16" in rows["bf16c_wire"]["mixed_precision"]
    assert "param_dtype" not in rows["fp32c_wire"]["mixed_precision"]


@pytest.mark.parametrize("compute", ["bf16", "fp32"])
def test_bf16_on_the_wire_and_bf16_reductions_move_half_the_bytes(run, compute):
    _, _, rows = run
    ref, bf16, wire = rows[f"{compute}c_fp32"], rows[f"{compute}c_bf16"], rows[f"{compute}c_wire"]
    for row in (ref, bf16, wire):
        assert row["reduction_bytes_constant"], row["key"]  # every step reduces every unit once
    assert ref["reduction_bytes_per_step"] > 0
    # Exactly half: gradients, padding and used-flags all travel in 2 bytes instead of 4.
    assert 2 * wire["reduction_bytes_per_step"] == ref["reduction_bytes_per_step"]
    assert 2 * bf16["reduction_bytes_per_step"] == ref["reduction_bytes_per_step"]
    assert wire["reduction_bytes_ratio"] == bf16["reduction_bytes_ratio"] == 0.5 and ref["reduction_bytes_ratio"] == 1


def test_step0_gradient_errors(run):
    _, results, rows = run
    for key, row in rows.items():
        error = row["grad_error_step0"]
        assert math.isfinite(error), key
        if key == row["reference_key"]:
            assert error == 0.0 and all(d == 0.0 for d in row["param_distance"]), key
    # Where what is summed differs from the reference's, the reduced gradient does.
    for key in ("bf16c_bf16", "fp32c_bf16", "fp32c_wire"):
        assert rows[key]["grad_error_step0"] > 0, key
    # bf16 gradients cast to bf16 are unchanged, and a sum of 2 float32 terms is the same in either order: with
    # bf16 compute on 2 ranks the wire variant's fp32 sum is the fp32 reduce-scatter's, bit for bit (a bf16 sum
    # would not be).
    assert rows["bf16c_wire"]["grad_error_step0"] == 0.0
    assert results["scale"]["grad_error_step0"] > 0  # bf16 against fp32 compute


def test_losses_and_distances_finite(run):
    _, results, rows = run
    for key, row in rows.items():
        assert len(row["losses"]) == STEPS, key
        assert all(math.isfinite(loss) for loss in row["losses"]), key
        assert math.isfinite(row["final_loss"]) and math.isfinite(row["final_loss_diff"]), key
        assert all(math.isfinite(d) and d >= 0 for d in row["param_distance"]), key
    for key in ("bf16c_fp32", "bf16c_bf16", "bf16c_wire"):  # identical weights and batch at step 0
        assert rows[key]["losses"][0] == rows["bf16c_fp32"]["losses"][0]
    for key in ("fp32c_bf16", "fp32c_wire"):  # the reductions differ, so the weights after them do
        assert rows[key]["param_distance"][-1] > 0, key
    assert len(results["scale"]["param_distance"]) == len(results["distance_steps"])


def test_bad_arguments_exit_before_any_process(capsys):
    assert main(["--world-size", "1"]) == 2
    assert "world_size must be >= 2" in capsys.readouterr().err
