"""The engine after things go wrong or end: a backward that raised on every rank, sync_module_states inside a
subgroup, and the module handed back by ``restore_unsharded``. Each is checked against an independent reference
(a single-process run, or the values each group's first rank started with)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from lightning_fsdp.checkpoint.full import full_model_state_dict
from lightning_fsdp.engine import fully_shard
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn

STEPS = 4
FAIL_AT = 1  # the step whose first backward raises


class _Boom(Exception):
    pass


def _train(model: torch.nn.Module, rank: int, world: int) -> list[float]:
    """SGD with momentum; at FAIL_AT the first backward raises part-way (a hook between the two blocks), the loop
    catches it, zeroes the gradients and runs the step again."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank::world], y[rank::world]
        if step == FAIL_AT:

            def raise_in_backward(_grad):
                raise _Boom("raised inside backward")

            def arm(_module, _args, out):
                out.register_hook(raise_in_backward)  # returns None: the output stays as it is

            handle = model.block1.register_forward_hook(arm)
            try:
                loss_fn(model(x), y).backward()
            except _Boom:
                pass
            handle.remove()
            optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _backward_raises(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    reference = ToyLM()
    model = copy.deepcopy(reference)
    ref_losses = _train(reference, 0, 1)  # one process on the whole batch
    engine = fully_shard(model, auto_wrap_policy={Block})
    losses = _train(model, rank, world)
    mean_losses = []
    for value in losses:
        t = torch.tensor([value])
        dist.all_reduce(t)
        mean_losses.append(t.item() / world)
    return {
        "ref": reference.state_dict(),
        "ref_losses": ref_losses,
        "losses": mean_losses,
        "state": full_model_state_dict(engine, rank0_only=False),
    }


def test_a_backward_that_raised_leaves_the_next_step_exact():
    results = run_distributed(_backward_raises, 2)
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["ref_losses"]), rtol=1e-5, atol=1e-6)
        compared = 0
        for key, value in got["ref"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
            compared += 1
        assert compared == len(got["ref"]) > 0


def _sync_in_subgroup(rank: int, world: int) -> dict:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    torch.manual_seed(100 + rank)  # every rank starts different; sync must give each group its first rank's values
    model = ToyLM()
    started = {k: v.clone() for k, v in model.state_dict().items()}
    engine = fully_shard(model, process_group=mine, auto_wrap_policy={Block}, sync_module_states=True)
    return {"started": started, "state": full_model_state_dict(engine, rank0_only=False)}


def test_sync_module_states_stays_inside_the_process_group():
    results = run_distributed(_sync_in_subgroup, 4)
    for rank, got in enumerate(results):
        first = results[rank // 2 * 2]["started"]  # the group's first rank
        other = results[(1 - rank // 2) * 2]["started"]
        compared = 0
        for key, value in first.items():
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=0, msg=f"rank {rank} {key}")
            compared += 1
        assert compared == len(first) > 0
        assert not torch.equal(first["emb.weight"], other["emb.weight"])  # the two groups really started apart


def _restore(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = ToyLM()
    reference = copy.deepcopy(model)  # trained by this process alone on the whole batch: the independent expectation
    engine = fully_shard(model, auto_wrap_policy={Block})
    x, y = batch(0)
    for net, (inputs, targets) in ((model, (x[rank::world], y[rank::world])), (reference, (x, y))):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        loss_fn(net(inputs), targets).backward()
        optimizer.step()
    expected = reference.state_dict()
    engine.restore_unsharded("cpu")
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    with torch.no_grad():
        out = model(x) if rank == 0 else None  # rank 0 alone: no collective may run
    return {
        "expected": expected,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "hooks": hooks,
        "out": out,
        "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
    }


def test_restore_unsharded_gives_an_ordinary_module():
    results = run_distributed(_restore, 2)
    torch.manual_seed(0)
    shapes = {n: tuple(p.shape) for n, p in ToyLM().named_parameters()}
    for got in results:
        assert got["hooks"] == 0
        assert got["shapes"] == shapes
        assert got["state"].keys() == got["expected"].keys()
        compared = 0
        for key, value in got["expected"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
            compared += 1
        assert compared == len(got["expected"]) > 0
    reference = ToyLM()
    reference.load_state_dict(results[0]["expected"])
    with torch.no_grad():
        torch.testing.assert_close(results[0]["out"], reference(batch(0)[0]), rtol=1e-5, atol=1e-6)
