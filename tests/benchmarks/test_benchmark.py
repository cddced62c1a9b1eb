"""The benchmark command on a tiny GPT: it runs every variant, writes its report, and its figures are consistent.

Timing is never asserted (the machines are shared); memory, communication and loss figures are.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import benchmarks as benchmark
from benchmarks import SCALING_BASELINE, BenchmarkConfig, run_benchmark
from benchmarks.__main__ import main, parse_args
from benchmarks.memory import LiveTensorBytes
from benchmarks.report import fmt_bytes, markdown, plot
from benchmarks.variants import REFERENCE, VARIANTS, parse_variants
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
    assert "python -m benchmarks" in table and "How each column is measured" in table


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
    # The comparison and the scaling run (at each world size) run warmup + timed steps (1 + 3); at 2 processes the
    # scaling rows are the comparison's.
    references = {world: single_process_losses(1 + 3, world) for world in (1, 2)}
    compared = 0
    for part in ("variants", "scaling"):
        for row in results[part]:
            world = row["world_size"]
            want = references[world]
            assert len(row["losses"]) == 4, (row["name"], row["losses"])
            for step, (got, expected) in enumerate(zip(row["losses"], want)):
                assert abs(got - expected) <= 1e-4 * abs(expected), (part, row["name"], step, got, expected)
                compared += 1
            assert row["final_loss"] == row["losses"][-1]
    # Every variant; FULL_SHARD and DDP at 1 and 2 processes.
    assert compared == 4 * len(VARIANTS) + 4 * 2 * 2
    # The benchmark's own agreement flag (final losses against its reference variant) says the same.
    assert all(r["loss_agrees"] for r in results["variants"] + results["scaling"])


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
    # The root unit (embeddings, final LayerNorm, tied head) stays gathered from forward into backward, and so does
    # the last Block from the second step on (its backward comes next): over the memory run's 2 steps, half a pass.
    root_share = 1 - sum(p.numel() for p in model.blocks.parameters()) / model.num_parameters()
    last_share = sum(p.numel() for p in model.blocks[-1].parameters()) / model.num_parameters() / 2
    by_key = {r["key"]: r for r in results["variants"]}
    full, grad_op, no_shard = (
        by_key[k]["comm_per_step"] for k in ("custom_full_shard", "custom_shard_grad_op", "custom_no_shard")
    )
    padding = 0.02  # a padding row per parameter at most, on a tiny model
    assert 2 - root_share - last_share - 0.01 <= full["all_gathered"] / P <= 2 - last_share + padding
    assert 1 <= full["reduce_scatter"] / P <= 1 + padding
    assert 1 <= grad_op["all_gathered"] / P <= 1 + padding
    # NO_SHARD all-reduces the gradients plus one used-flag (4 bytes) per trainable parameter.
    flags = 4 * sum(1 for p in model.parameters() if p.requires_grad)
    assert no_shard["all_reduce"] == P + flags and no_shard["all_gathered"] == 0


def test_scaling_run_times_full_shard_against_ddp_at_each_world_size(tiny_run):
    out, results = tiny_run
    scaling = {(r["world_size"], r["key"]): r for r in results["scaling"]}
    assert sorted(scaling) == [(w, k) for w in (1, 2) for k in (REFERENCE, SCALING_BASELINE)]
    for (world, key), row in scaling.items():
        assert row["status"] == "ok", (world, key, row.get("error"), row.get("traceback"))
        assert len(row["step_ms"]) == 3 and all(ms > 0 for ms in row["step_ms"]), row["step_ms"]
        assert row["median_step_ms"] > 0 and row["reference_key"] == SCALING_BASELINE
        assert row["ratio_to_reference"] > 0 and row["paired_ratio_to_reference"] > 0
        assert all(peak >= state["params"] for peak, state in zip(row["peak_live_bytes"], row["model_state"]))
        assert len(row["live_at_start_bytes"]) == world and all(b > 0 for b in row["live_at_start_bytes"])
        # At 2 processes the rows are the comparison's (all variants interleaved), elsewhere the two alone.
        assert row["interleaved_with"] == (list(VARIANTS) if world == 2 else [REFERENCE, SCALING_BASELINE])
    assert scaling[2, REFERENCE]["step_ms"] == next(r for r in results["variants"] if r["key"] == REFERENCE)["step_ms"]
    # Model state per rank: FULL_SHARD's falls as 1/N, DDP's (a replica on every rank) does not fall at all.
    one = scaling[1, REFERENCE]["model_state"][0]["total"]
    for per_rank in scaling[2, REFERENCE]["model_state"]:
        assert abs(per_rank["total"] - one / 2) <= 0.05 * one / 2
    ddp_one = scaling[1, SCALING_BASELINE]["model_state"][0]["total"]
    assert ddp_one == pytest.approx(one, rel=0.05)  # the same model state, unsharded
    assert all(m["total"] == ddp_one for m in scaling[2, SCALING_BASELINE]["model_state"])
    # The table: a row per (world size, variant) with the step time; the machine's cores stated next to it.
    table = (out / "results.md").read_text()
    for world, key in scaling:
        name, ms = VARIANTS[key].name, scaling[world, key]["median_step_ms"]
        assert any(line.startswith(f"| {world} | {name} | {ms:.1f} |") for line in table.splitlines()), (world, name)
    assert "CPU cores (`os.cpu_count()`)" in table


def test_scaling_table_flags_oversubscription_and_reads_old_results(tiny_run, tmp_path):
    _, results = tiny_run
    crowded = copy.deepcopy(results)
    crowded["environment"]["cpus"] = 1  # 2 processes x 1 thread on 1 core
    lines = markdown(crowded).splitlines()
    assert any(line.startswith("| 2 (oversubscribed) | ") for line in lines)
    assert any("At world size 2 there are more threads than cores" in line for line in lines)
    # Results written before the scaling run was timed: FULL_SHARD rows only, memory fields only.
    old = copy.deepcopy(results)
    timing_fields = ("step_ms", "median_step_ms", "min_step_ms", "interleaved_with", "reference_key")
    old["scaling"] = [
        {k: v for k, v in r.items() if k not in timing_fields and "ratio" not in k and "loss_" not in k}
        for r in old["scaling"]
        if r["key"] == REFERENCE
    ]
    del old["scaling_baseline"], old["config"]["scaling_variants"]
    table = markdown(old)
    assert f"| 1 | {VARIANTS[REFERENCE].name} | n/a | n/a (n/a) |" in table
    plot(old, tmp_path / "old.png")
    assert (tmp_path / "old.png").stat().st_size > 0


def test_scaling_run_reuses_the_comparison_only_when_it_holds_every_scaling_variant(monkeypatch):
    """Which process groups run_benchmark starts, with ``_run_group`` replaced by a stand-in (nothing spawned)."""
    calls = []

    def fake_run_group(world, keys, cfg, *, timing):
        calls.append((world, list(keys), timing))
        state = {"params": 4, "grads": 4, "optimizer": 8, "total": 16}
        timed = {"status": "ok", "step_s": [0.5] * cfg.steps, "warmup_s": [], "losses": [1.0], "model_state": state}
        memory = {"status": "ok", "model_state": state, "peak_live_bytes": 32, "live_at_start_bytes": 4}
        memory.update(losses=[1.0], comm_per_step={}, comm_calls_per_step={})
        return {k: {"timing": [timed] * world, "memory": [memory] * world} for k in keys}

    monkeypatch.setattr(benchmark, "_run_group", fake_run_group)
    tiny = {"layers": 1, "width": 8, "heads": 1, "seq": 4, "world_sizes": [1, 2, 4]}
    run_benchmark(BenchmarkConfig(**tiny), progress=lambda _: None)
    pair = [REFERENCE, SCALING_BASELINE]
    assert calls == [(2, list(VARIANTS), True), (1, pair, True), (4, pair, True)]
    calls.clear()
    results = run_benchmark(BenchmarkConfig(**tiny, variants=[REFERENCE, "fsdp1"]), progress=lambda _: None)
    assert calls == [(2, [REFERENCE, "fsdp1"], True), (1, pair, True), (2, pair, True), (4, pair, True)]
    assert [(r["world_size"], r["key"]) for r in results["scaling"]] == [(w, k) for w in (1, 2, 4) for k in pair]
    assert all(r["ratio_to_reference"] == 1.0 for r in results["scaling"])


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
    # The scaling run keeps its DDP baseline when --variants leaves DDP out, unless --scaling-variants says so.
    assert parse_args(["--variants", "fsdp1"]).scaling_variants == [REFERENCE, SCALING_BASELINE]
    assert parse_args(["--scaling-variants", "ddp,custom_full_shard"]).scaling_variants == [REFERENCE, "ddp"]
    with pytest.raises(SystemExit):
        parse_args(["--scaling-variants", "fsdp3"])
    assert fmt_bytes(3 * 2**20) == "3 MiB" and fmt_bytes(None) == "n/a"
