"""ignored_modules / ignored_states, process_group, cpu_offload and device_id behave as torch FSDP users expect."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.engine import fully_shard
from lightning_fsdp.options import check_device_id_matches
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn
from tests.toolbox.one_device import toy_lm_on_step_batches
from tests.toolbox.training import sgd_with_momentum, train_on_shares

STEPS = 3


def train(model, rank, world_size, accumulate=2, engine=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, size=8)
        for micro in range(accumulate):
            mx, my = x[micro::accumulate], y[micro::accumulate]
            b = mx.shape[0] // world_size
            (loss_fn(model(mx[rank * b : (rank + 1) * b]), my[rank * b : (rank + 1) * b]) / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()


def one_device_in_two_microbatches():
    """One process, each step's global batch in the two accumulated microbatches train() cuts it into."""
    torch.manual_seed(0)
    model = ToyLM()
    train(model, 0, 1)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def ignored_case(rank, world_size, kind):
    torch.manual_seed(0)
    model = ToyLM()
    if kind == "modules":
        engine = fully_shard(model, auto_wrap_policy={Block}, ignored_modules=[model.block2])
        whole = {f"block2.{n}" for n, _ in model.block2.named_parameters()}
    else:
        engine = fully_shard(model, auto_wrap_policy={Block}, ignored_states=[model.tiny])
        whole = {"tiny"}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    train(model, rank, world_size, engine=engine)
    with engine.unsharded():
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ignored_now = {n: p.detach().clone() for n, p in model.named_parameters() if n in whole}
    return whole, shapes, params, ignored_now


@pytest.mark.parametrize("kind", ["modules", "states"])
def test_ignored_parameters_stay_whole_and_train_like_unsharded(kind):
    results = run_distributed(ignored_case, 2, kind)
    reference = one_device_in_two_microbatches()
    full_shapes = {n: tuple(p.shape) for n, p in ToyLM().named_parameters()}
    for whole, shapes, params, _ignored_now in results:
        for name, shape in shapes.items():
            if name in whole:
                assert shape == full_shapes[name]  # not sharded
        assert any(shapes[n] != full_shapes[n] for n in shapes if n not in whole)  # the rest is
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # Gradients of the whole copies are averaged across ranks, so the copies stay identical.
    for name in results[0][3]:
        assert torch.equal(results[0][3][name], results[1][3][name])


def own_group_case(rank, world_size):
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank must create every group
    torch.manual_seed(0)
    model = ToyLM()
    engine = fully_shard(model, auto_wrap_policy={Block}, process_group=groups[rank])
    train_on_shares(model, sgd_with_momentum(model.parameters()), STEPS, 8, rank, world_size)
    return {k: v.detach().clone() for k, v in model.named_parameters()}, engine.shard_comm.world_size


def test_process_group_restricts_sharding_and_reduction_to_that_group():
    results = run_distributed(own_group_case, 2)
    for rank, (params, group_size) in enumerate(results):
        assert group_size == 1
        # A rank alone in its group trains on its own data, exactly like one process would.
        model = toy_lm_on_step_batches(STEPS, 8, share=(rank, 2)).model
        for name, value in model.named_parameters():
            torch.testing.assert_close(params[name], value.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(results[0][0]["emb.weight"], results[1][0]["emb.weight"])


def offload_case(rank, world_size, offload):
    torch.manual_seed(0)
    model = ToyLM()
    engine = fully_shard(model, auto_wrap_policy={Block}, cpu_offload=offload)
    train(model, rank, world_size)
    with engine.unsharded():
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_cpu_offload_on_cpu_changes_nothing():
    with_offload = run_distributed(offload_case, 2, True)[0]
    without = run_distributed(offload_case, 2, False)[0]
    for name in without:
        assert torch.equal(with_offload[name], without[name])


def test_cpu_offload_accepts_torch_style_config():
    from torch.distributed.fsdp import CPUOffload

    assert FSDPStrategy(cpu_offload=CPUOffload(offload_params=True)).cpu_offload is True
    with pytest.raises(TypeError, match="cpu_offload='yes'"):
        FSDPStrategy(cpu_offload="yes")


def test_device_id_must_name_this_ranks_device():
    # What the strategy's setup checks: device_id against the device Lightning gave this rank.
    cpu = FSDPStrategy(parallel_devices=[torch.device("cpu")], device_id=0)
    check_device_id_matches(cpu.device_id, cpu.device)  # index 0 of the CPU is this rank's device
    hpu_object = FSDPStrategy(parallel_devices=[torch.device("hpu", 1)], device_id=torch.device("hpu", 1))
    check_device_id_matches(hpu_object.device_id, hpu_object.device)
    wrong = FSDPStrategy(parallel_devices=[torch.device("cpu")], device_id=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"device_id=device\(type='cuda', index=0\).*this rank's device cpu"):
        check_device_id_matches(wrong.device_id, wrong.device)
    with pytest.raises(TypeError, match="device_id='0'"):
        FSDPStrategy(device_id="0")


def test_ignored_and_group_options_are_validated():
    with pytest.raises(TypeError, match="ignored_modules contains 3"):
        FSDPStrategy(ignored_modules=[3])
    with pytest.raises(TypeError, match="process_group=5"):
        FSDPStrategy(process_group=5)
    assert FSDPStrategy(ignored_modules="model.block2").ignored_modules == ["model.block2"]


def test_names_resolve_to_submodules_and_parameters():
    from lightning_fsdp.options import resolve_names

    model = ToyLM()
    assert resolve_names(model, ["block2", "tiny"]) == [model.block2, model.tiny]
    with pytest.raises(ValueError, match="'nope' names no submodule or parameter of ToyLM"):
        resolve_names(model, ["nope"])


def test_wrap_policies_never_make_a_container_without_forward_a_unit():
    from torch import nn

    from lightning_fsdp.engine.options import parse_auto_wrap_policy
    from lightning_fsdp.engine.wrap import select_unit_modules

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(1, 1) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Holder()
    # A size rule passes over the ModuleList (its hooks would never run) and leaves its parameters to the parent.
    assert select_unit_modules(model, parse_auto_wrap_policy(4)) == [model]
    assert select_unit_modules(model, parse_auto_wrap_policy(2)) == [model, *model.layers]
    # Naming it explicitly is a mistake the user should hear about.
    with pytest.raises(ValueError, match="ModuleList, which has no forward"):
        select_unit_modules(model, parse_auto_wrap_policy({nn.ModuleList}))
