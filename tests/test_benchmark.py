"""The benchmark command on a tiny GPT: it runs every variant, writes its report, and its figures are consistent.

Timing is never asserted (the machines are shared); memory, communication and loss figures are.
"""

from __future__ import annotations

import json

import pytest
import torch

from lightning_fsdp.benchmark import VARIANTS
from lightning_fsdp.benchmark.__main__ import main, parse_args
from lightning_fsdp.benchmark.memory import LiveTensorBytes
from lightning_fsdp.benchmark.report import fmt_bytes
from lightning_fsdp.benchmark.variants import parse_variants
from lightning_fsdp.demo.data import default_text_path
from lightning_fsdp.demo.gpt import GPT, GPTConfig

TINY = [
    "--layers",
    "2",
    "--width",
    "32",
    "--heads",
    "2",
    "--seq",
    "16",
    "--batch",
    "2",
    "--steps",
    "3",
    "--warmup",
    "1",
    "--mem-steps",
    "2",
    "--world-sizes",
    "1,2",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    assert main([*TINY, "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_writes_table_plot_and_json_with_every_variant(tiny_run):
    out, results = tiny_run
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for variant in VARIANTS.values():
        assert any(line.startswith(f"| {variant.name} |") for line in rows), variant.name
    assert [r["key"] for r in results["variants"]] == list(VARIANTS)
    for row in results["variants"]:  # torch >= 2.6 (pyproject) has FSDP1 and FSDP2: every variant must run
        assert row["status"] == "ok", (row["name"], row.get("error"), row.get("traceback"))
        assert row["median_step_ms"] > 0
    assert "python -m lightning_fsdp.benchmark" in table and "How each column is measured" in table


def single_process_losses(steps: int, world: int) -> list[float]:
    """The benchmark's training, computed here without its code: one process, no sharding, the whole global batch.

    As documented for the benchmark: GPT built right after ``torch.manual_seed(seed)``, AdamW(lr), and at step ``s``
    the global batch of ``batch * world`` windows of ``seq + 1`` characters of the bundled text (ids in sorted
    character order), starting at ``torch.randint(0, len(text) - seq - 1)`` from a generator seeded with
    ``seed * 100_003 + s``; inputs are a window's first ``seq`` ids, targets its last ``seq``. Each rank's loss is
    the mean over its equal share, so the benchmark's mean over ranks is this mean over the global batch.
    """
    seed, lr, seq, batch = 0, 1e-3, 16, 2  # TINY's --seq and --batch; the defaults' seed and lr
    text = default_text_path().read_text(encoding="utf-8")
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    tokens = torch.tensor([index[c] for c in text])
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=65, block_size=seq, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(seed * 100_003 + step)
        starts = torch.randint(0, len(tokens) - seq - 1, (batch * world,), generator=generator)
        windows = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(windows[:, :-1], windows[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_losses_match_a_single_process_run(tiny_run):
    _, results = tiny_run
    # The comparison runs warmup + timed steps (1 + 3) at 2 processes; the scaling run reuses its reference row at
    # 2 processes and runs the profiled steps (2) at any other world size.
    references = {world: single_process_losses(1 + 3, world) for world in (1, 2)}
    compared = 0
    for part in ("variants", "scaling"):
        for row in results[part]:
            world = row["world_size"]
            steps = 2 if part == "scaling" and world != 2 else 4
            want = references[world][:steps]
            assert len(row["losses"]) == steps, (row["name"], row["losses"])
            for step, (got, expected) in enumerate(zip(row["losses"], want)):
                assert abs(got - expected) <= 1e-4 * abs(expected), (part, row["name"], step, got, expected)
                compared += 1
            assert row["final_loss"] == row["losses"][-1]
    assert compared == 4 * len(VARIANTS) + 2 + 4  # every variant; the scaling rows at 1 and 2 processes
    # The benchmark's own agreement flag (final losses against its reference variant) says the same.
    assert all(r["loss_agrees"] for r in results["variants"])


def test_sharded_model_state_is_half_of_ddps(tiny_run):
    _, results = tiny_run
    by_key = {r["key"]: r for r in results["variants"]}
    ddp = max(m["total"] for m in by_key["ddp"]["model_state"])
    for key in ("custom_full_shard", "custom_shard_grad_op"):
        for per_rank in by_key[key]["model_state"]:
            assert abs(per_rank["total"] - ddp / 2) <= 0.05 * ddp / 2, (key, per_rank, ddp)
    for per_rank in by_key["custom_no_shard"]["model_state"]:
        assert per_rank["total"] == ddp
    for row in results["variants"]:
        assert all(peak >= state["params"] for peak, state in zip(row["peak_live_bytes"], row["model_state"]))


def test_engine_traffic_matches_theory(tiny_run):
    _, results = tiny_run
    P = results["param_bytes"]
    config = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    # The root unit (embeddings, final LayerNorm, tied head) stays gathered from forward into backward.
    root_share = 1 - sum(p.numel() for p in model.blocks.parameters()) / model.num_parameters()
    by_key = {r["key"]: r for r in results["variants"]}
    full, grad_op, no_shard = (
        by_key[k]["comm_per_step"] for k in ("custom_full_shard", "custom_shard_grad_op", "custom_no_shard")
    )
    padding = 0.02  # a padding row per parameter at most, on a tiny model
    assert 2 - root_share - 0.01 <= full["all_gathered"] / P <= 2 + padding
    assert 1 <= full["reduce_scatter"] / P <= 1 + padding
    assert 1 <= grad_op["all_gathered"] / P <= 1 + padding
    # NO_SHARD all-reduces the gradients plus one used-flag (4 bytes) per trainable parameter.
    flags = 4 * sum(1 for p in model.parameters() if p.requires_grad)
    assert no_shard["all_reduce"] == P + flags and no_shard["all_gathered"] == 0


def test_per_rank_memory_scales_with_world_size(tiny_run):
    _, results = tiny_run
    scaling = {r["world_size"]: r for r in results["scaling"]}
    assert sorted(scaling) == [1, 2] and all(r["status"] == "ok" for r in scaling.values())
    one = scaling[1]["model_state"][0]["total"]
    for per_rank in scaling[2]["model_state"]:
        assert abs(per_rank["total"] - one / 2) <= 0.05 * one / 2


def test_live_tensor_bytes_sees_a_known_allocation():
    with LiveTensorBytes() as live:
        kept = torch.empty(1 << 18)  # 1 MiB, alive through the window
        with live.window():
            temporary = torch.empty(1 << 19)  # 2 MiB, freed inside the window
            del temporary
    assert live.at_window_start >= kept.numel() * 4
    assert live.peak - live.at_window_start >= (1 << 19) * 4


def test_cli_rejects_bad_input():
    assert parse_variants("all") == list(VARIANTS)
    assert parse_variants("fsdp2,ddp") == ["ddp", "fsdp2"]  # canonical order
    with pytest.raises(ValueError, match="custom_full_shard"):
        parse_variants("fsdp3")
    with pytest.raises(SystemExit):
        parse_args(["--width", "30", "--heads", "4"])
    with pytest.raises(SystemExit):
        parse_args(["--world-sizes", "0,2"])
    assert parse_args([]).world_sizes == [1, 2, 4]
    assert fmt_bytes(3 * 2**20) == "3 MiB" and fmt_bytes(None) == "n/a"
