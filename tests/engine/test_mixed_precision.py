"""Mixed precision: full-precision shards stay the master weights, gathers move param_dtype, reductions reduce_dtype.

Parity tolerances are measured, not guessed: an unsharded reference in the same precision is run twice on the same
global batches, once whole and once as the ranks see it (each rank's half, gradients averaged), and the sharded
run must stay within a small multiple of that measured difference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_fsdp import MixedPrecision
from lightning_fsdp.engine import fully_shard
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn

STEPS = 4


def one_device_in_precision(dtype, split: int):
    """Unsharded mixed precision: fp32 master weights, a ``dtype`` compute copy, gradients in ``dtype``.

    ``split`` > 1 computes each step's gradient as the mean over ``split`` equal parts of the batch, as ranks do.
    """
    torch.manual_seed(0)
    master = ToyLM()
    optimizer = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        compute = copy.deepcopy(master).to(dtype)
        x, y = batch(step, size=8)
        grads, step_loss = None, 0.0
        for part in range(split):
            loss = loss_fn(compute(x[part::split]), y[part::split])
            part_grads = torch.autograd.grad(loss, [p for p in compute.parameters() if p.requires_grad])
            grads = part_grads if grads is None else [a + b for a, b in zip(grads, part_grads)]
            step_loss += float(loss.detach()) / split
        trainable = [p for p in master.parameters() if p.requires_grad]
        for p, g in zip(trainable, grads):
            p.grad = (g / split).to(torch.float32)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return torch.tensor(losses), {k: v.detach().clone() for k, v in master.named_parameters()}


def sharded(rank, world_size, dtype, reduce_dtype):
    torch.manual_seed(0)
    model = ToyLM()
    engine = fully_shard(
        model, auto_wrap_policy={Block}, mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=reduce_dtype)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, size=8)
        engine.shard_comm.stats.reset()
        loss = loss_fn(model(x[rank::world_size]), y[rank::world_size])
        loss.backward()
        stats = engine.shard_comm.stats
        ag, rs = stats.all_gather_bytes, stats.reduce_scatter_bytes
        dtypes = {p.dtype for p in model.parameters()} | {
            p.grad.dtype for p in model.parameters() if p.grad is not None
        }
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / world_size)
    with engine.unsharded():
        params = {k: v.detach().float().clone() for k, v in model.named_parameters()}
    return torch.tensor(losses), params, ag, rs, dtypes


CONFIGS = [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32), (torch.float16, None)]


def all_configs(rank, world_size):
    return {cfg: sharded(rank, world_size, *cfg) for cfg in CONFIGS}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(all_configs, 2)


def test_all_gather_moves_half_the_bytes_in_bfloat16(runs):
    fp32 = runs[0][(torch.float32, None)]
    bf16 = runs[0][(torch.bfloat16, None)]
    assert bf16[2] * 2 == fp32[2] > 0
    assert bf16[3] * 2 == fp32[3] > 0  # reduce_dtype defaults to param_dtype
    bf16_fp32_reduce = runs[0][(torch.bfloat16, torch.float32)]
    assert bf16_fp32_reduce[2] == bf16[2] and bf16_fp32_reduce[3] == fp32[3]


def test_shards_and_their_gradients_stay_full_precision(runs):
    for result in runs[0].values():
        assert result[4] == {torch.float32}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_parity_within_measured_tolerance(runs, dtype):
    whole_losses, whole_params = one_device_in_precision(dtype, split=1)
    split_losses, split_params = one_device_in_precision(dtype, split=2)
    fp32_losses, _ = one_device_in_precision(torch.float32, split=1)
    # The measured noise of this precision: the same training computed whole vs. split as the ranks split it.
    loss_noise = (whole_losses - split_losses).abs().max().item()
    param_noise = max((whole_params[k] - split_params[k]).abs().max().item() for k in whole_params)
    assert (whole_losses - fp32_losses).abs().max() > 0  # the low precision really is in effect
    losses, params, *_ = runs[0][(dtype, None)]
    assert (losses - split_losses).abs().max().item() <= 4 * loss_noise + 1e-6
    for key, value in split_params.items():
        assert (params[key] - value).abs().max().item() <= 4 * param_noise + 1e-6, key


def test_full_precision_config_is_exact(runs):
    losses, params, *_ = runs[0][(torch.float32, None)]
    ref_losses, ref_params = one_device_in_precision(torch.float32, split=2)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for key, value in ref_params.items():
        torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6)


def test_keep_low_precision_grads_is_refused_with_reason():
    with pytest.raises(ValueError, match=r"keep_low_precision_grads=True\) is not supported"):
        MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)


def test_bad_dtype_is_refused():
    with pytest.raises(TypeError, match="param_dtype=torch.int8"):
        MixedPrecision(param_dtype=torch.int8)


def casting(rank, world_size):
    seen = {}

    class Probe(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            seen[self.name] = x.dtype
            return self.lin(x.to(self.lin.weight.dtype))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Probe("inner")
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            seen["root"] = x.dtype
            return self.a(x.float()) * self.scale.to(x.dtype)

    results = {}
    for cast_all in (False, True):
        seen.clear()
        net = Net()
        mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float64, cast_forward_inputs=cast_all)
        fully_shard(net, auto_wrap_policy={Probe}, mixed_precision=mp)
        net(torch.randn(3, 4)).sum()
        results[cast_all] = (dict(seen), net.scale.dtype)
    return results


def test_input_casting_and_buffer_dtype():
    results = run_distributed(casting, 2)[0]
    # The root casts its inputs by default; inner units only with cast_forward_inputs.
    assert results[False][0] == {"root": torch.bfloat16, "inner": torch.float32}
    assert results[True][0] == {"root": torch.bfloat16, "inner": torch.bfloat16}
    assert results[False][1] == torch.float64
