"""ShardingMonitor and estimate_memory: what the monitor logs per rank and step through a Lightning logger, and the
estimate made before training agrees with it.

The Lightning run (tests/scripts/monitor_run.py) trains lightning_fsdp.demo.gpt.GPT with every Block as a unit on 2
processes, under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, with a CSVLogger.
"""

from __future__ import annotations

import csv
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fsdp import MixedPrecision
from lightning_fsdp.demo.gpt import Block
from lightning_fsdp.demo.module import GPTLightningModule
from lightning_fsdp.estimate import MemoryEstimate, estimate_memory
from lightning_fsdp.monitor import QUANTITIES, ShardingMonitor
from tests.scripts.monitor_run import MODEL, STEPS
from tests.toolbox.launch import in_background, run_script
from tests.toolbox.lightning_scripts import quiet_trainer

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
# Estimate component -> the monitor's metric that measures it.
COMPONENTS = {
    "params": "param_bytes",
    "grads": "grad_bytes",
    "optimizer_state": "optimizer_state_bytes",
    "gathered_params": "gathered_peak_bytes",
    "peak": "model_state_peak_bytes",
    "all_gather_bytes": "all_gather_bytes",
    "reduce_scatter_bytes": "reduce_scatter_bytes",
    "all_reduce_bytes": "all_reduce_bytes",
}


def _gpt_on_meta() -> GPTLightningModule:
    with torch.device("meta"):  # the estimate reads shapes and dtypes only
        return GPTLightningModule(**MODEL)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict:
    """The module's two launches (the GPT's, the tiny model's), at once: each writes into a folder of its own."""
    gpt, tiny = tmp_path_factory.mktemp("monitor"), tmp_path_factory.mktemp("monitor_tiny")
    return in_background({"gpt": partial(_gpt_launch, gpt), "tiny": partial(_tiny_launch, tiny)})


@pytest.fixture(scope="module")
def logged(launches) -> dict[str, list[dict[str, str]]]:
    return launches["gpt"].result()


def _gpt_launch(out: Path) -> dict[str, list[dict[str, str]]]:
    """metrics.csv rows per strategy, from one 2-process launch."""
    return _logged_rows("monitor_run.py", out, STRATEGIES, "--devices", "2")


def _logged_rows(script: str, out: Path, strategies, *args: str) -> dict[str, list[dict[str, str]]]:
    """One launch of ``script`` logging each of ``strategies`` into ``out/<strategy>/metrics.csv``: the rows that
    carry the monitor's metrics, per strategy."""
    run_script(script, "--out", out, *args, "--strategies", *strategies, cwd=out, timeout=240)
    rows = {}
    for strategy in strategies:
        with open(out / strategy / "metrics.csv") as f:
            rows[strategy] = [row for row in csv.DictReader(f) if row.get("fsdp/rank0/param_bytes")]
    return rows


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_estimate_is_within_ten_percent_of_what_the_monitor_measures(logged, strategy):
    rows = logged[strategy]
    assert [int(r["step"]) for r in rows] == list(range(STEPS))  # every step, under Lightning's own step numbers
    for rank in (0, 1):
        estimate = estimate_memory(_gpt_on_meta(), 2, strategy, optimizer="adamw", auto_wrap_policy={Block}, rank=rank)
        for row in rows:
            for component, metric in COMPONENTS.items():
                measured = int(row[f"fsdp/rank{rank}/{metric}"])
                predicted = getattr(estimate, component)
                if component == "all_gather_bytes" and strategy == "FULL_SHARD" and int(row["step"]) == 0:
                    # The estimate is the steady state. The first step records the forward order, so it also
                    # gathers the last Block again for its backward: one more pass of a Block, which (the two Blocks
                    # being alike) is what FULL_SHARD gathers beyond SHARD_GRAD_OP's single pass.
                    once = estimate_memory(
                        _gpt_on_meta(), 2, "SHARD_GRAD_OP", optimizer="adamw", auto_wrap_policy={Block}, rank=rank
                    ).all_gather_bytes
                    predicted += predicted - once
                assert predicted == pytest.approx(measured, rel=0.10), (strategy, rank, component, measured)


def test_monitor_logs_each_rank_and_shows_what_sharding_saves(logged):
    full, grad_op, no_shard = (logged[s][-1] for s in STRATEGIES)
    # The whole model in float32, from its parameter shapes (named_parameters lists the tied head once).
    unsharded = sum(p.numel() * p.element_size() for p in _gpt_on_meta().parameters())

    def value(row, rank, name):
        return int(row[f"fsdp/rank{rank}/{name}"])

    for rank in (0, 1):
        # Every quantity is logged for every rank; on CPU the allocator peak is not, the process RSS peak is.
        logged_names = {k.split("/")[-1] for k in full if k.startswith(f"fsdp/rank{rank}/") and full[k]}
        assert logged_names == set(QUANTITIES) - {"device_peak_bytes"}
        assert value(full, rank, "rss_peak_bytes") > 50 * 2**20  # an interpreter with torch loaded
        # NO_SHARD keeps the whole model on each rank and computes on it directly.
        assert value(no_shard, rank, "param_bytes") == unsharded
        assert value(no_shard, rank, "gathered_peak_bytes") == 0
        # fp32 gradients all-reduced, with one used-flag per parameter.
        flags = 4 * sum(1 for p in _gpt_on_meta().parameters() if p.requires_grad)
        assert value(no_shard, rank, "all_reduce_bytes") == unsharded + flags
        # SHARD_GRAD_OP holds every unit at the end of forward; FULL_SHARD at most the root and one Block.
        assert value(full, rank, "gathered_peak_bytes") < value(grad_op, rank, "gathered_peak_bytes")
        # FULL_SHARD gathers the Blocks twice (forward, backward), SHARD_GRAD_OP once: same reduce-scatter.
        assert value(full, rank, "all_gather_bytes") > value(grad_op, rank, "all_gather_bytes")
        assert value(full, rank, "reduce_scatter_bytes") == value(grad_op, rank, "reduce_scatter_bytes")
    # The two ranks' shards tile the model exactly once; AdamW keeps two tensors per shard element plus a step.
    assert value(full, 0, "param_bytes") + value(full, 1, "param_bytes") == unsharded
    assert value(full, 0, "optimizer_state_bytes") > 2 * value(full, 0, "param_bytes")


# ------------------------------------------------------------------------------------------ estimate, no processes
def test_estimate_components_for_a_simple_model():
    model = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 3))  # weights 7x10, 3x7; biases 7, 3: 101 floats
    estimate = estimate_memory(model, 2, "SHARD_GRAD_OP", optimizer="sgd_momentum", auto_wrap_policy={nn.Linear})
    # Rank 0 holds ceil(rows / 2) rows of each parameter: 4x10 + 4 + 2x7 + 2 = 60 floats.
    assert estimate.params == estimate.grads == estimate.optimizer_state == 60 * 4
    # Each Linear is gathered in full, padded to 2 x ceil(rows / 2) rows: (8x10 + 8) + (4x7 + 4) = 120 floats.
    assert estimate.gathered_params == 120 * 4
    assert estimate.unsharded_params == 101 * 4
    assert estimate.num_units == 3  # the root (owning nothing) and two Linears
    rank1 = estimate_memory(model, 2, "SHARD_GRAD_OP", optimizer="sgd_momentum", auto_wrap_policy={nn.Linear}, rank=1)
    assert estimate.params + rank1.params == estimate.unsharded_params
    assert estimate.peak == estimate.model_state + estimate.gathered_params
    assert "SHARD_GRAD_OP, rank 0 of 2, 3 units" in str(estimate)
    # HYBRID_SHARD_ZERO2 holds what SHARD_GRAD_OP holds in its shard group, and all-reduces each reduced gradient
    # shard (padded: ceil(rows / 2) rows, 60 floats) across replicas.
    hybrid = estimate_memory(model, 2, "HYBRID_SHARD_ZERO2", optimizer="sgd_momentum", auto_wrap_policy={nn.Linear})
    assert (hybrid.model_state, hybrid.gathered_params) == (estimate.model_state, estimate.gathered_params)
    # Plus the reduction's used-flags: one per parameter, 4 parameters.
    assert (estimate.all_reduce_bytes, hybrid.all_reduce_bytes) == (0, 60 * 4 + 4 * 4)


def test_full_shard_peak_is_the_root_and_the_largest_unit():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 4)), nn.Linear(4, 4))
    blocks = estimate_memory(model, 2, "FULL_SHARD", optimizer=None, auto_wrap_policy={nn.Sequential})
    # Units: the root (two small Linears, 2 x 20 floats) and the inner Sequential (4x64+64 + 64x4+4 = 580 floats).
    assert blocks.gathered_params == (40 + 580) * 4
    assert blocks.optimizer_state == 0
    everything = estimate_memory(model, 2, "SHARD_GRAD_OP", optimizer=None, auto_wrap_policy={nn.Sequential})
    assert everything.gathered_params == blocks.gathered_params  # only two units: both alive either way


def test_mixed_precision_halves_what_is_gathered_but_not_the_master_weights():
    model = _gpt_on_meta()
    fp32 = estimate_memory(model, 2, "FULL_SHARD", auto_wrap_policy={Block})
    for mixed in (
        "bf16-mixed",
        MixedPrecision(param_dtype=torch.bfloat16),
        {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"},
    ):
        low = estimate_memory(model, 2, "FULL_SHARD", mixed_precision=mixed, auto_wrap_policy={Block})
        assert (low.params, low.grads, low.optimizer_state) == (fp32.params, fp32.grads, fp32.optimizer_state)
        assert low.gathered_params * 2 == fp32.gathered_params, mixed
        assert low.all_gather_bytes * 2 == fp32.all_gather_bytes, mixed
        assert low.reduce_scatter_bytes * 2 == fp32.reduce_scatter_bytes, mixed
    reduce_fp32 = estimate_memory(
        model,
        2,
        "FULL_SHARD",
        auto_wrap_policy={Block},
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    assert reduce_fp32.reduce_scatter_bytes == fp32.reduce_scatter_bytes
    # "-true" flags convert the model before sharding: shards, gradients and optimizer state are halved too.
    # (SGD with momentum: one buffer per parameter in its dtype; AdamW's float32 step scalar would not halve.)
    fp32_momentum = estimate_memory(model, 2, "FULL_SHARD", optimizer="sgd_momentum", auto_wrap_policy={Block})
    assert fp32_momentum.optimizer_state == fp32_momentum.params
    for flag in ("16-true", "bf16-true"):
        true = estimate_memory(
            model, 2, "FULL_SHARD", mixed_precision=flag, optimizer="sgd_momentum", auto_wrap_policy={Block}
        )
        assert true.params * 2 == fp32.params and true.grads * 2 == fp32.grads, flag
        assert true.optimizer_state * 2 == fp32_momentum.optimizer_state, flag
        assert true.gathered_params * 2 == fp32.gathered_params, flag
        assert true.all_gather_bytes * 2 == fp32.all_gather_bytes, flag
        assert true.reduce_scatter_bytes * 2 == fp32.reduce_scatter_bytes, flag
    # NO_SHARD computing in bf16 keeps a bf16 copy of each unit while it runs.
    no_shard = estimate_memory(model, 2, "NO_SHARD", mixed_precision="bf16-mixed", auto_wrap_policy={Block})
    assert no_shard.gathered_params * 2 == no_shard.unsharded_params


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"world_size": 0}, ValueError, ["world_size=0", "positive int"]),
        ({"rank": 2}, ValueError, ["rank=2", "[0, 1]"]),
        ({"sharding_strategy": "ZERO3"}, ValueError, ["'ZERO3'", "'FULL_SHARD'"]),
        ({"optimizer": "lion"}, ValueError, ["'lion'", "adamw", "sgd_momentum"]),
        ({"mixed_precision": "8-true"}, ValueError, ["'8-true'", "'bf16-mixed'"]),
        ({"mixed_precision": 3.5}, ValueError, ["3.5", "MixedPrecision"]),
    ],
)
def test_estimate_rejects_bad_input_naming_value_and_choices(kwargs, error, words):
    args = {"model": nn.Linear(2, 2), "world_size": 2, **kwargs}
    with pytest.raises(error) as info:
        estimate_memory(**args)
    for word in words:
        assert word in str(info.value)


def test_estimate_result_is_a_frozen_dataclass():
    estimate = estimate_memory(nn.Linear(4, 4), 1)
    assert isinstance(estimate, MemoryEstimate)
    with pytest.raises(AttributeError):
        estimate.params = 0  # type: ignore[misc]


# ------------------------------------------------------------------------------------------- monitor, in-process
@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"log_every_n_steps": 0}, ["log_every_n_steps=0", "positive int"]),
        ({"log_every_n_steps": True}, ["log_every_n_steps=True"]),
        ({"prefix": ""}, ["prefix=''"]),
    ],
)
def test_monitor_rejects_bad_options(kwargs, words):
    with pytest.raises(ValueError) as info:
        ShardingMonitor(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_monitor_warns_and_logs_nothing_without_the_fsdp_strategy(tmp_path):
    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
    monitor = ShardingMonitor(log_every_n_steps=1)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[monitor],
        default_root_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match="ShardingMonitor needs the fsdp_custom strategy"):
        trainer.fit(Tiny(), data)
    assert monitor.last == {}


# ------------------------------------------------------------------------- monitor against hand-computed bytes
# From the second step on, FULL_SHARD does not gather b (4 floats per rank) again for its backward (see below).
LATER_STEPS_LESS = {"FULL_SHARD": {"all_gather_bytes": 16}}

# tests/scripts/monitor_tiny_run.py: a = Linear(4, 3), b = Linear(3, 2), each its own unit (the root owns nothing),
# 2 ranks, float32 (4 bytes), SGD with momentum (one buffer per parameter, the shard's size). Chunking rule: a
# parameter of d0 rows gives each rank c = ceil(d0 / 2) rows, rank 1 the rest; collectives carry c rows per rank.
#
#   parameter   shape  c  rank 0 rows (floats)  rank 1 rows (floats)  padded floats per rank
#   a.weight    3x4    2  2 (8)                 1 (4)                 8
#   a.bias      3      2  2 (2)                 1 (1)                 2
#   b.weight    2x3    1  1 (3)                 1 (3)                 3
#   b.bias      2      1  1 (1)                 1 (1)                 1
#   total (23)            14 floats = 56 B      9 floats = 36 B       unit a 10, unit b 4
#
# - param, grad and optimizer-state bytes: the rank's own rows, 56 B / 36 B (NO_SHARD: all 23 floats, 92 B);
# - a gathered unit holds both ranks' padded rows: a 2 x 10 floats = 80 B, b 2 x 4 = 32 B. FULL_SHARD frees each
#   unit before the next is gathered, so the peak is a alone (80 B); SHARD_GRAD_OP keeps both from forward to
#   backward (112 B); NO_SHARD computes on the parameters themselves (0 B);
# - all-gather input is the rank's padded shard: 10 + 4 floats = 56 B per pass; FULL_SHARD gathers in forward and
#   again in backward (112 B), except b from the second step on: the last unit of the forward (recorded in the first
#   step) stays gathered into its backward, which comes next (112 - 4 floats = 96 B); SHARD_GRAD_OP once (56 B);
# - reduce-scatter input: 2 ranks x (padded floats + one used-flag per parameter): a 2 x (10 + 2), b 2 x (4 + 2)
#   = 36 floats = 144 B; NO_SHARD all-reduces the gradients plus the flags: 23 + 4 floats = 108 B.
TINY_OWN_ROWS = {"param_bytes": (56, 36), "grad_bytes": (56, 36), "optimizer_state_bytes": (56, 36)}
TINY_EXPECTED = {
    "FULL_SHARD": {
        **TINY_OWN_ROWS,
        "gathered_peak_bytes": (80, 80),
        "all_gather_bytes": (112, 112),
        "reduce_scatter_bytes": (144, 144),
        "all_reduce_bytes": (0, 0),
    },
    "SHARD_GRAD_OP": {
        **TINY_OWN_ROWS,
        "gathered_peak_bytes": (112, 112),
        "all_gather_bytes": (56, 56),
        "reduce_scatter_bytes": (144, 144),
        "all_reduce_bytes": (0, 0),
    },
    "NO_SHARD": {
        "param_bytes": (92, 92),
        "grad_bytes": (92, 92),
        "optimizer_state_bytes": (92, 92),
        "gathered_peak_bytes": (0, 0),
        "all_gather_bytes": (0, 0),
        "reduce_scatter_bytes": (0, 0),
        "all_reduce_bytes": (108, 108),
    },
}


@pytest.fixture(scope="module")
def tiny_logged(launches) -> dict[str, list[dict[str, str]]]:
    return launches["tiny"].result()


def _tiny_launch(out: Path) -> dict[str, list[dict[str, str]]]:
    return _logged_rows("monitor_tiny_run.py", out, TINY_EXPECTED)


def test_monitor_logs_the_hand_computed_bytes_of_a_tiny_model(tiny_logged):
    compared = 0
    for strategy, expected in TINY_EXPECTED.items():
        rows = tiny_logged[strategy]
        assert [int(r["step"]) for r in rows] == [0, 1]  # both steps of the run, under Lightning's step numbers
        for row in rows:
            for rank in (0, 1):
                got = {name: int(row[f"fsdp/rank{rank}/{name}"]) for name in expected}
                want = {name: values[rank] for name, values in expected.items()}
                for name, less in LATER_STEPS_LESS.get(strategy, {}).items() if int(row["step"]) > 0 else ():
                    want[name] -= less
                assert got == want, (strategy, rank, row["step"])
                # The two sums the monitor derives from its own measurements.
                state = sum(got[n] for n in ("param_bytes", "grad_bytes", "optimizer_state_bytes"))
                assert int(row[f"fsdp/rank{rank}/model_state_bytes"]) == state
                assert int(row[f"fsdp/rank{rank}/model_state_peak_bytes"]) == state + got["gathered_peak_bytes"]
                compared += len(expected) + 2
    assert compared == 3 * 2 * 2 * 9
    # The table's totals: the shards tile the 23 floats exactly once.
    assert 56 + 36 == 92 == 4 * (3 * 4 + 3 + 2 * 3 + 2)
