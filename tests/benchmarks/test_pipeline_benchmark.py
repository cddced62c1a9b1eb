"""The pipeline benchmark command on a tiny GPT: its report's structure, its losses, and its bytes against theory.

Timing is never asserted (the machines are shared). The theory here is computed from the parameter shapes alone,
independently of benchmarks/pipeline.py's own: vocab 65 and seq 18 make ``wte`` and ``wpe`` split
unevenly over 2 and 4 ranks, so the padding rule is exercised too.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.pipeline import PipelineBenchmarkConfig, main
from lightning_fsdp.demo.gpt import Block, PipelineGPT

VOCAB, SEQ, WIDTH, LAYERS, BATCH, MICRO = 65, 18, 32, 2, 8, 2
TINY = [
    *("--layers", str(LAYERS), "--width", str(WIDTH), "--heads", "2", "--seq", str(SEQ), "--vocab", str(VOCAB)),
    *("--global-batch", str(BATCH), "--microbatches", str(MICRO)),
    *("--steps", "2", "--warmup", "1", "--mem-steps", "1"),
]
KEYS = ["pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_1f1b_kept", "fsdp_x4", "ddp_x4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline-benchmark")
    assert main([*TINY, "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def _model() -> PipelineGPT:
    cfg = PipelineBenchmarkConfig(layers=LAYERS, width=WIDTH, heads=2, seq=SEQ, vocab=VOCAB)
    with torch.device("meta"):
        return PipelineGPT(cfg.gpt_config())


def _theory(pieces: list[str], ranks: int, micro: int, kept: bool = False, pipelined: bool = True) -> tuple[int, int]:
    """(all-gather, reduce-scatter) bytes per step: every Block a unit, the rest of the held pieces the root unit;
    a parameter sends ceil(rows / ranks) rows; blocks gathered twice per microbatch, the root once per step, and
    without pipelining the last block once (its backward follows its forward); each unit reduce-scattered once per
    step, its full padded gradient plus one float flag per parameter per rank."""
    model = _model()
    root: list[torch.Size] = []
    units: list[list[torch.Size]] = []
    for name in pieces:
        module = model.get_submodule(name)
        shapes = [p.shape for p in module.parameters()]
        (units.append(shapes) if isinstance(module, Block) else root.extend(shapes))

    def elements(shapes):
        return sum(math.ceil(s[0] / ranks) * math.prod(s[1:]) for s in shapes)

    # Kept gathered (reshard_after_forward and reshard_after_backward off): each block gathered once per step.
    gather = 4 * (elements(root) + (1 if kept else 2 * micro) * sum(elements(u) for u in units))
    if not pipelined and not kept:
        gather -= 4 * elements(units[-1])
    reduce = 4 * ranks * sum(elements(u) + len(u) for u in ([root] if root else []) + units)
    return gather, reduce


def _p2p(local_stages: list[int], stages: int, data: int) -> tuple[int, int]:
    activation = 4 * (BATCH // data // MICRO) * SEQ * WIDTH  # one microbatch's hidden state
    forward = MICRO * activation * sum(1 for s in local_stages if s < stages - 1)
    backward = MICRO * activation * sum(1 for s in local_stages if s > 0)
    return forward, backward


def test_report_structure(run):
    out, results = run
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "results.md").read_text()
    assert "python -m benchmarks.pipeline" in table
    for heading in ("## Bytes per step, per rank", "## Theory", "## How each column is measured"):
        assert heading in table
    assert [r["key"] for r in results["variants"]] == KEYS
    for row in results["variants"]:
        assert any(line.startswith(f"| {row['name']} |") for line in table.splitlines()), row["name"]
        assert row["median_step_ms"] > 0 and len(row["step_ms"]) == 2
        assert len(row["ranks"]) == 4 and len(row["peak_live_bytes"]) == 4
        assert all(p > 0 for p in row["peak_live_bytes"])
        assert row["ratio_to_ddp"] > 0 and row["ratio_to_fsdp"] > 0
    by_key = {r["key"]: r for r in results["variants"]}
    assert by_key["ddp_x4"]["ratio_to_ddp"] == 1.0 and by_key["fsdp_x4"]["ratio_to_fsdp"] == 1.0
    pieces = ["embed", *(f"blocks.{i}" for i in range(LAYERS)), "ln_f", "lm_head"]
    for key, count in (("pp_gpipe", 2), ("pp_1f1b", 2), ("pp_interleaved", 4)):
        stages = by_key[key]["stages"]
        assert len(stages) == count and [p for s in stages for p in s] == pieces
        for rank in by_key[key]["ranks"]:  # global rank = pp_rank * D + dp_rank; stage s on pipeline rank s % P
            assert rank["pp_rank"] == rank["rank"] // 2
            assert rank["local_stages"] == [s for s in range(count) if s % 2 == rank["pp_rank"]]
            assert rank["pieces"] == [p for s in rank["local_stages"] for p in stages[s]]


def test_losses_of_every_variant_agree(run):
    _, results = run
    rows = results["variants"]
    reference = rows[-1]["losses"]
    assert len(reference) == 3
    for row in rows:
        assert row["loss_agrees"] is True
        for loss, ref in zip(row["losses"], reference, strict=True):
            assert abs(loss - ref) <= 1e-5 * abs(ref), row["name"]
        # The memory run rebuilds the variant from the same seed on the same first batch.
        assert row["memory_run_losses"][0] == pytest.approx(reference[0], rel=1e-5)


@pytest.mark.parametrize("key", ["pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_1f1b_kept", "fsdp_x4"])
def test_collective_bytes_equal_theory(run, key):
    _, results = run
    row = next(r for r in results["variants"] if r["key"] == key)
    for rank in row["ranks"]:
        gather, reduce = _theory(
            rank["pieces"], row["data_size"], row["microbatches"], kept=key.endswith("kept"), pipelined=key != "fsdp_x4"
        )
        measured = rank["measured_per_step"]
        assert measured["all_gather"] == gather, rank["rank"]
        assert measured["reduce_scatter"] == reduce, rank["rank"]
        assert measured.get("all_reduce", 0) == 0
        assert rank["matches_theory"]


@pytest.mark.parametrize("key", KEYS)
def test_p2p_bytes_equal_activation_formula(run, key):
    _, results = run
    row = next(r for r in results["variants"] if r["key"] == key)
    for rank in row["ranks"]:
        measured = rank["measured_per_step"]
        if row["pipeline_size"] == 1:
            assert measured.get("p2p_activations", 0) == measured.get("p2p_gradients", 0) == 0
            continue
        forward, backward = _p2p(rank["local_stages"], len(row["stages"]), row["data_size"])
        assert (measured["p2p_activations"], measured["p2p_gradients"]) == (forward, backward), rank["rank"]
        assert measured["p2p_other"] == 0  # torch's P2P handshake falls in the warmup step
        # Two ranks per pipeline, each sends as much as it receives from the other.
        assert rank["p2p_received_per_step"] == forward + backward
