"""``cpu_offload``: where the shards, the reduced gradients and the optimizer state live, and that offloading changes
no number.

``fully_shard(..., cpu_offload=True, device=D)`` keeps every unit's shards in host memory (so their gradients and
an optimizer's state built from them are there too); a unit's shard is copied to ``D`` only to be gathered, and its
reduced gradient is copied back. ``FSDPStrategy(cpu_offload=True)`` asks for that on an accelerator; on the CPU
accelerator everything is in host memory already and the option is accepted and changes nothing.

On a CPU-only machine the host and the compute device are the same, so the placement checks below can only show
that everything is on the host and nothing is missing (no gradient or optimizer state lost on the way); that the
host copy is what differs from the compute device is checked by the tests marked ``cuda``, which run where a CUDA
device is present.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_fsdp.checkpoint.full import full_model_state_dict
from lightning_fsdp.engine import fully_shard
from tests.toolbox.compare import assert_all_close
from tests.toolbox.distributed import run_distributed
from tests.toolbox.launch import run_script
from tests.toolbox.models import Block, ToyLM, batch, loss_fn

STEPS = 3
NUM_PARAMS = 14  # ToyLM's parameters, the tied embedding / head once
NUM_TRAINABLE = 12  # all but the frozen Linear's weight and bias
NUM_STATE_KEYS = 15  # state_dict() names the tied weight twice (emb.weight, head.weight)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def train_engine(rank: int, world_size: int, device: str, offload: bool) -> dict:
    """ToyLM on ``device`` sharded with ``cpu_offload=offload``, 3 steps of SGD with momentum."""
    torch.manual_seed(0)
    model = ToyLM().to(device)
    engine = fully_shard(model, auto_wrap_policy={Block}, cpu_offload=offload, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compute_devices = set()
    # Where the units compute: the device of the (full) weight each Block's first Linear sees in forward.
    hooks = [
        block.fc1.register_forward_pre_hook(lambda m, _: compute_devices.add(str(m.weight.device)))
        for block in (model.block1, model.block2)
    ]
    losses = []
    for step in range(STEPS):
        x, y = batch(step, size=4)
        loss = loss_fn(model(x[rank::world_size].to(device)), y[rank::world_size].to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step < STEPS - 1:
            optimizer.zero_grad()
    for hook in hooks:
        hook.remove()
    placement = {
        name: {
            "shard": str(p.device),
            "grad": str(p.grad.device) if p.grad is not None else "none",
            "state": sorted(str(v.device) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)),
        }
        for name, p in model.named_parameters()
    }
    params = {k: v.cpu() for k, v in full_model_state_dict(engine, rank0_only=False).items()}
    return {"losses": losses, "placement": placement, "params": params, "compute": sorted(compute_devices)}


def check_placement(placement: dict, frozen: set[str], *, host: str, trained: str) -> int:
    """Every shard on ``host``; every trainable one has a gradient and a momentum buffer on ``trained``; the
    frozen ones have neither. Returns how many parameters were checked."""
    for name, where in placement.items():
        assert where["shard"] == host, (name, where)
        if name in frozen:
            assert (where["grad"], where["state"]) == ("none", []), (name, where)
        else:
            assert (where["grad"], where["state"]) == (trained, [trained]), (name, where)
    return len(placement)


FROZEN = {"frozen.weight", "frozen.bias"}


def check_same_training(with_offload: dict, without: dict, atol: float = 0.0) -> int:
    """Same losses and final parameters; exactly on the CPU, within ``atol`` where kernels may be nondeterministic
    (CUDA's embedding backward). Returns how many state_dict entries were compared."""
    torch.testing.assert_close(torch.tensor(with_offload["losses"]), torch.tensor(without["losses"]), rtol=0, atol=atol)
    return assert_all_close(with_offload["params"], without["params"], "with offload vs without", rtol=0, atol=atol)


def _trained(embedding: torch.Tensor) -> bool:
    """The embedding moved away from its initial value (both runs start from ``manual_seed(0)``)."""
    torch.manual_seed(0)
    return not torch.equal(embedding, ToyLM().emb.weight.detach())


# ------------------------------------------------------------------------------------------ engine, on the CPU
@pytest.fixture(scope="module")
def cpu_runs() -> tuple[list[dict], list[dict]]:
    return run_distributed(train_engine, 2, "cpu", True), run_distributed(train_engine, 2, "cpu", False)


def test_engine_keeps_shards_gradients_and_optimizer_state_on_the_host(cpu_runs):
    offloaded, _ = cpu_runs
    checked = 0
    for result in offloaded:
        checked += check_placement(result["placement"], FROZEN, host="cpu", trained="cpu")
        assert result["compute"] == ["cpu"]
    assert checked == 2 * NUM_PARAMS
    assert len(FROZEN) == NUM_PARAMS - NUM_TRAINABLE


def test_engine_trains_the_same_with_and_without_offload(cpu_runs):
    offloaded, plain = cpu_runs
    compared = sum(check_same_training(a, b) for a, b in zip(offloaded, plain))
    assert compared == 2 * NUM_STATE_KEYS
    assert _trained(
        plain[0]["params"]["emb.weight"]
    )  # the comparison is between trained models, not two copies of the initial one


# ---------------------------------------------------------------------------------------- engine, on a GPU
@cuda
def test_engine_offloads_to_the_host_while_computing_on_cuda():
    offloaded = run_distributed(train_engine, 1, "cuda", True)[0]
    plain = run_distributed(train_engine, 1, "cuda", False)[0]
    on_host = run_distributed(train_engine, 1, "cpu", False)[0]
    assert check_placement(offloaded["placement"], FROZEN, host="cpu", trained="cpu") == NUM_PARAMS
    assert offloaded["compute"] == ["cuda:0"]  # gathered onto the GPU to compute
    assert check_placement(plain["placement"], FROZEN, host="cuda:0", trained="cuda:0") == NUM_PARAMS
    # The same arithmetic on the same device whether the shards wait on the host or on the GPU.
    assert check_same_training(offloaded, plain, atol=1e-6) == NUM_STATE_KEYS
    for name, value in on_host["params"].items():
        torch.testing.assert_close(offloaded["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert _trained(plain["params"]["emb.weight"])


# -------------------------------------------------------------------------------------- through the strategy
def run_strategy(out: Path, devices: int, offload: bool, accelerator: str = "cpu") -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    args = ["--out", out, "--devices", str(devices), "--offload", str(int(offload)), "--accelerator", accelerator]
    run_script("cpu_offload_run.py", *args, cwd=out, timeout=300)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def _model_names(names: set[str]) -> set[str]:
    return {f"model.{n}" for n in names}


def test_strategy_on_cpu_accepts_offload_and_changes_nothing(tmp_path):
    offloaded = run_strategy(tmp_path / "offload", 2, True)
    plain = run_strategy(tmp_path / "plain", 2, False)
    checked = compared = 0
    for a, b in zip(offloaded, plain):
        assert a["root_device"] == "cpu"
        checked += check_placement(a["placement"], _model_names(FROZEN), host="cpu", trained="cpu")
        assert len(a["losses"]) == len(b["losses"]) == 4  # 16 samples, 4 per global batch
        assert a["losses"] == b["losses"]
        for key, value in b["state"].items():
            assert torch.equal(a["state"][key], value), key
            compared += 1
    assert checked == 2 * NUM_PARAMS
    assert compared == 2 * NUM_STATE_KEYS
    assert _trained(plain[0]["state"]["model.emb.weight"])


@cuda
def test_strategy_offloads_to_the_host_on_cuda(tmp_path):
    offloaded = run_strategy(tmp_path / "offload", 1, True, "gpu")[0]
    plain = run_strategy(tmp_path / "plain", 1, False, "gpu")[0]
    assert offloaded["root_device"] == plain["root_device"] == "cuda:0"
    frozen = _model_names(FROZEN)
    assert check_placement(offloaded["placement"], frozen, host="cpu", trained="cpu") == NUM_PARAMS
    assert check_placement(plain["placement"], frozen, host="cuda:0", trained="cuda:0") == NUM_PARAMS
    assert len(offloaded["losses"]) == len(plain["losses"]) == 4
    torch.testing.assert_close(torch.tensor(offloaded["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=1e-6)
    assert sorted(offloaded["state"]) == sorted(plain["state"]) and len(plain["state"]) == NUM_STATE_KEYS
    for key, value in plain["state"].items():
        torch.testing.assert_close(offloaded["state"][key], value, rtol=0, atol=1e-6, msg=key)
    assert _trained(plain["state"]["model.emb.weight"])
