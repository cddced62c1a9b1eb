"""Trainer(precision=...) flags map onto the engine's mixed precision; the 16-bit scaler agrees across ranks."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import lightning_fsdp  # noqa: F401
from lightning_fsdp import FSDPStrategy, MixedPrecision
from lightning_fsdp.engine import fully_shard
from lightning_fsdp.precision import FSDPPrecision
from tests.toolbox.distributed import run_distributed
from tests.toolbox.launch import in_background
from tests.toolbox.models import Block, ToyLM, batch, loss_fn
from tests.toolbox.one_device import lightning_parity_runs


@pytest.mark.parametrize(
    "flag,dtype,autocast",
    [
        ("32-true", None, False),
        ("bf16-mixed", torch.bfloat16, True),
        ("16-mixed", torch.float16, True),
        ("bf16-true", torch.bfloat16, False),
        ("16-true", torch.float16, False),
    ],
)
def test_flag_maps_to_mixed_precision(flag, dtype, autocast):
    plugin = FSDPPrecision(flag)
    config = plugin.mixed_precision_config
    assert (config.param_dtype if config else None) == dtype
    assert (config.reduce_dtype if config else None) == dtype
    assert isinstance(plugin.forward_context(), torch.autocast) == autocast
    assert (plugin.scaler is not None) == (flag == "16-mixed")


def test_flag_and_explicit_mixed_precision_contradict():
    strategy = FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.float16))
    with pytest.raises(ValueError, match=r"precision='bf16-mixed'.*mixed_precision"):
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed")


def test_explicit_mixed_precision_with_default_flag_is_used():
    strategy = FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    assert strategy.mixed_precision_config.param_dtype == torch.bfloat16


def test_unknown_flag_lists_choices():
    with pytest.raises(ValueError, match=r"'64-true'.*'32-true', 'bf16-mixed'"):
        L.Trainer(accelerator="cpu", devices=1, strategy="fsdp_custom", precision="64-true")


def test_bf16_mixed_trains_within_the_precision_error(tmp_path):
    # Two launches at once: the one-device references (fp32, bf16-mixed), and the two 2-rank runs.
    sgd, bf16 = ("--optimizer", "sgd"), ("--precision", "bf16-mixed")
    launches = {
        1: [("--strategy", "auto", *sgd), ("--strategy", "auto", *sgd, *bf16)],
        2: [("--strategy", "fsdp_custom_blocks", *sgd, *bf16), ("--strategy", "fsdp_custom_blocks", *sgd)],
    }
    running = in_background({n: partial(lightning_parity_runs, tmp_path, n, runs) for n, runs in launches.items()})
    (fp32, single_bf16), (got, full) = running[1].result(), running[2].result()
    # Tolerance measured from Lightning's own single-device bf16-mixed run against fp32.
    precision_error = (torch.tensor(single_bf16["losses"]) - torch.tensor(fp32["losses"])).abs().max().item()
    assert precision_error > 0
    deviation = (torch.tensor(got["losses"]) - torch.tensor(single_bf16["losses"])).abs().max().item()
    assert deviation <= 3 * precision_error, (deviation, precision_error)
    assert got["all_gather_bytes"] * 2 == full["all_gather_bytes"] > 0  # gathers move bfloat16
    assert all(v.dtype == torch.float32 for v in got["state"].values())  # master weights stay fp32


def scaler_agreement(rank, world_size):
    torch.manual_seed(0)
    model = ToyLM()
    fully_shard(model, auto_wrap_policy={Block}, mixed_precision=MixedPrecision(param_dtype=torch.float16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    x, y = batch(0, size=4)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(loss_fn(model(x[rank::2]), y[rank::2])).backward()
    if rank == 1:  # only rank 1's shard overflows
        next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad[0] = float("inf")
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return unchanged, scaler.get_scale()


def test_sharded_grad_scaler_skips_the_step_on_every_rank():
    results = run_distributed(scaler_agreement, 2)
    assert results == [(True, 128.0), (True, 128.0)]
