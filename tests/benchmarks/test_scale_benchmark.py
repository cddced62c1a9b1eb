"""The scale benchmark (benchmarks/scale.py) on a small size: one launch through Lightning (fsdp_custom FULL_SHARD on
2 ranks), its records complete, a variant the memory budget cannot hold skipped with the reason, and
``estimate_memory`` against what the run measured: exactly against the engine's own accounting (ShardingMonitor), and
within ``ESTIMATE_TOLERANCE`` (or ``ESTIMATE_SLACK_BYTES``) against the peak private memory over the process's base.

Timing is never asserted (the machines are shared)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.scale import (
    ESTIMATE_SLACK_BYTES,
    ESTIMATE_TOLERANCE,
    STATE_BYTES_PER_PARAM,
    ScaleConfig,
    _meta_gpt,
    gpt_shape,
    parse_params,
    run_scale,
)

# 63M parameters, most of them in the 32k-row embedding and head, so that model state (~480 MiB per rank) outweighs
# what a Lightning process allocates besides; 3 steps of 32 tokens.
SMALL = ScaleConfig(
    params={0: 60_000_000},
    world_sizes=[2],
    variants=["fsdp_full", "ddp"],
    width=768,
    heads=4,
    vocab=32000,
    seq=32,
    batch=1,
    steps=3,
    memory_gib=3.0,  # fsdp_full needs ~2.4 GiB over 2 ranks by the estimate, DDP ~3.3: DDP is skipped
    pretrained=True,  # load_pretrained of a 253 MB safetensors file of the model at on_fit_start
)
PHASES = ("init", "train", "save", "load", "teardown")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    report = run_scale(SMALL, out, say=lambda text: None)
    return out, {r["variant"]: r for r in report["records"]}


def test_records_are_complete(small_run):
    out, records = small_run
    assert list(records) == ["fsdp_full", "ddp"]
    record = records["fsdp_full"]
    assert record["status"] == "ok", record.get("log_tail")
    assert record["params"] == sum(p.numel() for p in _meta_gpt(record["model"]).parameters())
    assert record["theory_bytes"] == STATE_BYTES_PER_PARAM * record["params"] / 2
    assert len(record["steps_s"]) == SMALL.steps and all(s > 0 for s in record["steps_s"])
    assert len(record["losses"]) == SMALL.steps and all(math.isfinite(x) for x in record["losses"])
    for phase in PHASES:
        assert record[f"{phase}_s"] is not None and record[f"{phase}_s"] >= 0, phase
        assert record[f"{phase}_peak_bytes"] is not None, phase
    assert record["train_peak_bytes"] > record["theory_bytes"] / 2  # the model state is in the measured peak
    assert len(record["peak_bytes_per_rank"]) == 2 and max(record["peak_bytes_per_rank"]) == record["train_peak_bytes"]
    # Init from meta: the shards plus one unit at most (the largest unit here is the root: embedding and head).
    assert (
        0 < record["init_peak_bytes"] < record["estimate_model_state_bytes"] / 4 + 2 * record["estimate_gathered_bytes"]
    )
    skipped = records["ddp"]
    assert skipped["status"] == "skipped" and "GiB" in skipped["reason"] and skipped["need_gib"] > SMALL.memory_gib
    table = (out / "results.md").read_text()
    assert "| 2 | fsdp_custom FULL_SHARD |" in table and "| 2 | Lightning DDP | " in table and "skipped" in table
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_pretrained_reads_each_ranks_rows(small_run):
    _, records = small_run
    record = records["fsdp_full"]
    size = record["pretrained_file_bytes"]
    assert size > 4 * record["params"] and record["pretrained_not_loaded"] == 0
    # Half of every tensor's rows per rank: the file pages a rank maps stay well under the whole file, and its private
    # memory grows by less than half of it (copied into the shards in place, never a full model).
    assert 0 < record["pretrained_rss_bytes"] < 0.75 * size, (record["pretrained_rss_bytes"], size)
    assert record["pretrained_anon_bytes"] < 0.5 * size, (record["pretrained_anon_bytes"], size)


def test_estimate_memory_agrees_with_the_measurement(small_run):
    _, records = small_run
    record = records["fsdp_full"]
    # The engine's own accounting, per rank: exactly the estimate's model state and gathered peak.
    assert len(record["monitor"]) == 2
    for rank in record["monitor"]:
        assert rank["model_state_bytes"] == record["estimate_model_state_bytes"]
        assert rank["gathered_peak_bytes"] == record["estimate_gathered_bytes"]
    # The process's private peak over its base (the resident peak less the file pages first touched while training):
    # the step's peak with one activation set, within the stated tolerance.
    planned, private = record["estimate_step_peak_bytes"], record["train_private_peak_bytes"]
    assert 0 <= record["train_file_bytes"] and 0 < private <= record["train_peak_bytes"]
    allowed = max(ESTIMATE_TOLERANCE * planned, ESTIMATE_SLACK_BYTES)
    assert abs(private - planned) <= allowed, (private, record["train_peak_bytes"], planned)


def test_sizes_and_shapes():
    assert parse_params("0.85B") == 850_000_000
    assert parse_params("2:0.85B,4:300M") == {2: 850_000_000, 4: 300_000_000}
    cfg = ScaleConfig()
    shape = gpt_shape(cfg, 850_000_000)
    params = sum(p.numel() for p in _meta_gpt(shape).parameters())
    per_block = 12 * cfg.width**2 + 2 * cfg.width
    assert abs(params - 850_000_000) <= per_block / 2  # the nearest whole number of Blocks
    assert (shape["n_embd"], shape["vocab_size"], shape["tie_weights"]) == (2048, 32000, False)


def test_step_peak_takes_the_larger_of_the_forwards_end_and_the_backwards_end():
    from torch import nn

    from lightning_fsdp import estimate_memory

    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 8))  # units: the root (no parameters of its own), each Linear
    estimate = estimate_memory(model, 2, "FULL_SHARD", optimizer="adamw", auto_wrap_policy={nn.Linear})
    # fp32 full-size gradients: 6*4 + 6 = 30 and 8*6 + 8 = 56 elements; both Linears' at once while the second's
    # reduction is in flight during the first's.
    assert estimate.unsharded_grads == (30 + 56) * 4
    assert estimate.training_peak == estimate.peak + 344
    # Rank 0's gradient shards: weight rows 3 of 6 and 4 of 8, bias 3 and 4: 12 + 3 + 24 + 4 elements.
    assert estimate.grads == 43 * 4
    # The backward's end (model state, gathered units, full-size gradients) dominates small activations.
    assert estimate.step_peak(0) == estimate.step_peak(344) == estimate.training_peak
    # The forward's end: gradient shards zeroed before it (the strategy's order) or alive through it.
    assert estimate.step_peak(1000) == estimate.peak - 43 * 4 + 1000
    assert estimate.step_peak(1000, gradients_in_forward=True) == estimate.peak + 1000
    with pytest.raises(ValueError, match="activation_bytes=-1"):
        estimate.step_peak(-1)
    with pytest.raises(ValueError, match="gradients_in_forward='yes'"):
        estimate.step_peak(0, gradients_in_forward="yes")


def test_the_root_is_not_counted_gathered_in_backward_once_its_head_has_its_gradient():
    from torch import nn

    from lightning_fsdp import estimate_memory

    class Layer(nn.Linear):
        pass

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(10, 4)
            self.blocks = nn.Sequential(Layer(4, 4), Layer(4, 4))
            self.head = nn.Linear(4, 10, bias=False)

    model = Net()
    policy = {Layer}
    estimate = estimate_memory(model, 2, "FULL_SHARD", optimizer="adamw", auto_wrap_policy=policy)
    # Gathered in fp32 at 2 ranks: the root's embedding and head 2 x 40 elements, a Block Linear 16 + 4.
    assert estimate.gathered_params == (80 + 20) * 4
    assert estimate.gathered_in_backward == 20 * 4  # the root freed once the head's gradient is in
    model.head.weight.requires_grad_(False)  # read by its backward, with no gradient to say when: the root stays
    frozen = estimate_memory(model, 2, "FULL_SHARD", optimizer="adamw", auto_wrap_policy=policy)
    assert frozen.gathered_in_backward is None
    assert frozen.step_peak(0) == frozen.model_state + frozen.gathered_params + frozen.unsharded_grads


def test_alternated_step_pairs_and_their_merge(tmp_path):
    """benchmarks.lightning_steps' arithmetic, on launches written out by hand (no launch): one ratio per pair, their
    median, each variant's median step; a merge renumbers the second run's pairs after the first's."""
    from benchmarks.lightning_steps import merge_steps, steps_markdown

    def run(folder: str, steps: list[tuple[float, float]]) -> None:
        launches = [
            {"pair": p, "variant": v, "median_step_s": s}
            for p, pair in enumerate(steps)
            for v, s in zip(("fsdp_full", "ddp"), pair)
        ]
        report = {"config": {}, "machine": {}, "date": folder, "worlds": [{"world": 2, "launches": launches}]}
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "steps.json").write_text(json.dumps(report))

    run("a", [(1.1, 1.0), (2.0, 2.5)])
    run("b", [(3.0, 2.0)])
    merged = merge_steps([tmp_path / "a", tmp_path / "b"], tmp_path / "merged")
    (world,) = merged["worlds"]
    assert [r["pair"] for r in world["launches"]] == [0, 0, 1, 1, 2, 2]
    assert world["pair_ratios"] == pytest.approx([1.1, 0.8, 1.5])
    assert world["median_ratio"] == pytest.approx(1.1)
    assert world["median_step_s"] == pytest.approx({"fsdp_full": 2.0, "ddp": 2.0})
    assert "| 2 | 3 | 2.000 | 2.000 | 1.10, 0.80, 1.50 | 1.10x |" in steps_markdown(merged)
    assert (tmp_path / "merged" / "steps.md").read_text() == steps_markdown(merged)
