"""torch.compile under fsdp_custom: each way users compile, on 2 ranks, against one device in eager mode.

One launch of tests/scripts/compile_run.py runs every scenario (compiled runs start slowly), cached for the module;
each test checks one scenario: final weights (every entry, fp32, rtol 1e-5), per-step losses, and dynamo's own
counters: a Block compiled with ``fullgraph=True`` must compile with no graph break, and nothing may compile after
the first step (the engine's hooks stay out of dynamo; [Note: compiled modules] in
lightning_fsdp/engine/sharding_engine.py).
The reference trains the same model in eager mode in this process, on the same global batches.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.ranks import kill_group
from tests.scripts import compile_run
from tests.scripts.compile_run import GLOBAL_BATCH, LR, STEPS, dataset, initial_model, loss_of
from tests.toolbox.launch import SCRIPTS, start_logged, with_fakes_on_path

RTOL, ATOL = 1e-5, 1e-6
LAUNCH_TIMEOUT_S = 900
# What a unit boundary inside a compiled region costs: a graph break at each engine hook dynamo must not trace.
HOOK_BREAK = "Skip calling `torch.compiler.disable()`d function"


@pytest.fixture(scope="module")
def one_device_eager() -> dict:
    """One device, eager, fp32: the same model, batches and optimizer as every scenario."""
    model = initial_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ids, targets = dataset().tensors
    losses = []
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = loss_of(model(ids[rows]), targets[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{scenario: result}, the ranks' weights joined (a pipeline stage holds its own pieces only)."""
    folder = tmp_path_factory.mktemp("compile")
    out = folder / "result.pt"
    argv = [sys.executable, SCRIPTS / "compile_run.py", "--devices", "2", "--out", out]
    # The Gaudi test double on the path, for hpu_per_block; the CPU scenarios never import it.
    env = with_fakes_on_path(PT_HPU_LAZY_MODE="0", FAKE_HPU_DEVICES="2")
    proc = start_logged(argv, folder / "run.log", env=env, cwd=folder)
    try:
        proc.wait(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_group(proc.pid)
        proc.wait()
    text = (folder / "run.log").read_text(errors="replace")
    ranks = [Path(f"{out}.rank{rank}") for rank in range(2)]
    if not all(path.exists() for path in ranks):
        pytest.fail(f"the compile launch wrote no results (exit {proc.returncode}):\n{text[-6000:]}")
    per_rank = [torch.load(path, weights_only=False) for path in ranks]
    results = {}
    for name in compile_run.SCENARIOS:
        entries = [
            rank_results.get(name, {"error": "not run (the launch ended before it)"}) for rank_results in per_rank
        ]
        errors = [entry["error"] for entry in entries if "error" in entry]
        if errors:
            results[name] = {"error": errors[0]}
            continue
        joined = dict(entries[0])
        joined["state"] = {k: v for entry in entries for k, v in entry["state"].items()}
        results[name] = joined
    return results


def _scenario(runs: dict, name: str) -> dict:
    result = runs[name]
    assert "error" not in result, f"{name} failed:\n{result['error']}"
    return result


def _assert_matches(result: dict, reference: dict, rtol: float = RTOL, atol: float = ATOL) -> None:
    compared = 0
    for key, expected in reference["state"].items():
        assert key in result["state"], f"{key} missing from the trained model"
        torch.testing.assert_close(
            result["state"][key], expected, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}"
        )
        compared += 1
    # Every entry of both (emb 1, 3 Blocks x 6, norm 2, head 2): nothing extra, nothing skipped.
    assert compared == len(result["state"]) == 23
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=atol)


def _assert_one_graph_per_block(result: dict) -> None:
    assert result["graph_breaks"] == 0, result["graph_break_reasons"]
    assert result["graphs"] >= 1  # compiled, not run eagerly
    assert result["graphs"] == result["graphs_after_first_step"]  # no recompilation after the first step


def test_per_block_fullgraph(runs: dict, one_device_eager: dict) -> None:
    result = _scenario(runs, "per_block")
    _assert_matches(result, one_device_eager)
    _assert_one_graph_per_block(result)


def test_module_compile_with_checkpointing_and_no_reshard(runs: dict, one_device_eager: dict) -> None:
    result = _scenario(runs, "module_compile_ac")
    _assert_matches(result, one_device_eager)
    _assert_one_graph_per_block(result)
    assert result["checkpointed"] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]


def test_whole_model_breaks_only_at_unit_boundaries(runs: dict, one_device_eager: dict) -> None:
    result = _scenario(runs, "whole_model")
    _assert_matches(result, one_device_eager)
    assert result["graph_break_reasons"] == [HOOK_BREAK]
    assert result["graphs"] > 1 and result["graphs"] == result["graphs_after_first_step"]


def test_fit_of_a_compiled_lightning_module_runs_compiled(runs: dict, one_device_eager: dict) -> None:
    result = _scenario(runs, "fit_compiled")
    _assert_matches(result, one_device_eager)
    assert result["graphs"] > 0  # Lightning's compiled training_step ran compiled, not eagerly
    assert set(result["graph_break_reasons"]) <= {HOOK_BREAK}
    assert result["graphs"] == result["graphs_after_first_step"]


def test_bf16_mixed_compiled_equals_eager(runs: dict, one_device_eager: dict) -> None:
    compiled, eager = _scenario(runs, "per_block_bf16"), _scenario(runs, "eager_bf16")
    _assert_one_graph_per_block(compiled)
    assert eager["graphs"] == 0
    # Compiled and eager run the same bf16 computation: the same weights to fp32 rounding.
    _assert_matches(compiled, {"state": eager["state"], "losses": eager["losses"]})
    # And both train as fp32 one device does, to bf16's precision (8 bits of mantissa, 3 steps).
    _assert_matches(eager, one_device_eager, rtol=2e-2, atol=2e-2)


def test_pipeline_stages_with_compiled_blocks(runs: dict, one_device_eager: dict) -> None:
    result = _scenario(runs, "pipeline_per_block")
    _assert_matches(result, one_device_eager)
    _assert_one_graph_per_block(result)


def test_inductor_per_block(runs: dict, one_device_eager: dict) -> None:
    result = _scenario(runs, "per_block_inductor")
    _assert_matches(result, one_device_eager)
    _assert_one_graph_per_block(result)


def test_gaudi_eager_mode_with_hpu_backend(runs: dict, one_device_eager: dict) -> None:
    # Through the Gaudi test double: accelerator="hpu", the "hccl" backend, torch.compile(backend="hpu_backend").
    result = _scenario(runs, "hpu_per_block")
    _assert_matches(result, one_device_eager)
    _assert_one_graph_per_block(result)
