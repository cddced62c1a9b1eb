"""Tensor parallelism composed with the engine's sharding, on 4 gloo ranks against one device on the same global batch
(fp32, SGD with momentum and AdamW, norm clipping): TP=2 x DP=2 with FULL_SHARD, and TP=2 x HYBRID_SHARD (each data-
parallel rank its own shard group, the two replicas all-reducing). The model is parallelized as a user does it, with
torch's ``parallelize_module`` on the tensor-parallel sub-mesh, then sharded over the data-parallel one. One launch
carries every case, a local checkpoint refused at another layout, and the full format's state dicts (model and
optimizer, the unsplit model's shapes) loaded back into a fresh TP x DP model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_fsdp.checkpoint import local
from lightning_fsdp.checkpoint.common import CheckpointMismatchError, CheckpointRun, load_model_state_dict
from lightning_fsdp.checkpoint.full import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_optimizer_state_dict,
)
from lightning_fsdp.engine import fully_shard
from tests.toolbox.compare import assert_all_close, assert_optimizer_equal, assert_tensors_equal
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, parallelize_toy_lm
from tests.toolbox.one_device import toy_lm_on_step_batches
from tests.toolbox.training import sgd_with_momentum, train_on_shares

STEPS, BATCH, CLIP = 3, 8, 0.05
adamw: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = partial(torch.optim.AdamW, lr=0.01)
OPTIMIZERS = {"sgd": sgd_with_momentum, "adamw": adamw}
# The other sharding strategies and the engine's prefetch controls under TP (SGD with momentum, as the rest).
ENGINE_CASES: dict[str, dict[str, object]] = {
    "shard_grad_op": {"sharding_strategy": "SHARD_GRAD_OP"},
    "no_shard": {"sharding_strategy": "NO_SHARD"},
    "prefetch": {"forward_prefetch": True, "backward_prefetch": "BACKWARD_POST", "limit_all_gathers": False},
}


def tp2_dp2(rank: int, world_size: int, folder: str) -> dict:
    """Per case, what ``train_tp_dp`` returns; under ``"local"`` the error of loading a TP=2 x DP=2 local checkpoint
    (written into ``folder``) at TP=1 x DP=4."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    results = {name: train_tp_dp(mesh, make_optimizer) for name, make_optimizer in OPTIMIZERS.items()}
    torch.manual_seed(0)
    model = parallelize_toy_lm(ToyLM(), mesh["tensor_parallel"])
    engine = fully_shard(model, auto_wrap_policy={Block}, process_group=mesh["data_parallel"].get_group())
    local.save_local_checkpoint({"state_dict": local.local_model_state_dict(engine)}, f"{folder}/local", engine, None)
    results["meta"] = materialised_from_meta(mesh)
    plain = fully_shard(ToyLM(), auto_wrap_policy={Block})
    try:
        local.load_local_checkpoint(f"{folder}/local", CheckpointRun(plain))
    except CheckpointMismatchError as err:
        results["local"] = str(err)
    alone = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank creates every group
    results["hybrid"] = train_tp_dp(mesh, sgd_with_momentum, hybrid_shard_group=alone)
    for name, options in ENGINE_CASES.items():
        results[name] = train_tp_dp(mesh, sgd_with_momentum, **options)
    return results


def materialised_from_meta(mesh: DeviceMesh) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], bool]]:
    """ToyLM built on the meta device, parallelized there, then sharded (the engine materialises each parameter's
    local shard and runs its module's ``reset_parameters`` on the DTensor): per parameter of the blocks, its shard's
    shape here, its full shape and whether its values are finite and not all equal (initialised)."""
    with torch.device("meta"):
        model = parallelize_toy_lm(ToyLM(), mesh["tensor_parallel"])
    engine = fully_shard(model, auto_wrap_policy={Block}, process_group=mesh["data_parallel"].get_group())
    full = full_model_state_dict(engine, rank0_only=False)
    shards = dict(model.named_parameters())
    return {
        name: (
            tuple(shards[name].shape),
            tuple(full[name].shape),
            bool(full[name].isfinite().all() and full[name].std() > 0),
        )
        for name in full
        if name.startswith("block")
    }


def train_tp_dp(
    mesh: DeviceMesh,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    hybrid_shard_group: dist.ProcessGroup | None = None,
    **options: object,
) -> tuple:
    """ToyLM parallelized over ``mesh['tensor_parallel']`` and sharded over ``mesh['data_parallel']`` (with
    ``hybrid_shard_group``: HYBRID_SHARD, sharded over that group and replicated over the data-parallel one), trained
    with clipping (``options``: more of ``fully_shard``'s): the mean loss over the data-parallel ranks at each step,
    the full state dict, each step's norm, and how many parameters this rank holds as TP pieces."""
    dp = mesh["data_parallel"]
    torch.manual_seed(0)
    model = parallelize_toy_lm(ToyLM(), mesh["tensor_parallel"])
    if hybrid_shard_group is None:
        engine = fully_shard(model, auto_wrap_policy={Block}, process_group=dp.get_group(), **options)
    else:
        engine = fully_shard(
            model,
            auto_wrap_policy={Block},
            sharding_strategy="HYBRID_SHARD",
            process_group=hybrid_shard_group,
            replicate_group=dp.get_group(),
        )
    norms = []

    def clip() -> None:
        norms.append(float(engine.clip_grad_norm_(model.parameters(), CLIP)))

    optimizer = make_optimizer(model.parameters())
    losses = train_on_shares(model, optimizer, STEPS, BATCH, dp.get_local_rank(), dp.size(), before_step=clip)
    means = []
    for loss in losses:
        dist.all_reduce(loss, group=dp.get_group())
        means.append(float(loss) / dp.size())
    specs = [slot.tensor_parallel for p in model.parameters() if (slot := engine.slot_of(p)) is not None]
    pieces = sum(spec is not None and spec.is_split for spec in specs)
    state = full_model_state_dict(engine, rank0_only=False)
    optimizer_state = full_optimizer_state_dict(engine, optimizer, rank0_only=False)
    # The full state loaded into a fresh TP x DP model gives its rows back (what the full format's load does).
    fresh = parallelize_toy_lm(ToyLM(), mesh["tensor_parallel"])
    fresh_engine = fully_shard(fresh, auto_wrap_policy={Block}, process_group=dp.get_group())
    load_model_state_dict(fresh_engine, state)
    fresh_optimizer = make_optimizer(fresh.parameters())
    load_full_optimizer_state_dict(fresh_engine, fresh_optimizer, optimizer_state)
    reloaded = (
        full_model_state_dict(fresh_engine, rank0_only=False),
        full_optimizer_state_dict(fresh_engine, fresh_optimizer, rank0_only=False),
    )
    return means, state, norms, pieces, optimizer_state, reloaded


def test_tp2_dp2_and_tp2_hybrid_match_one_device(tmp_path):
    results = run_distributed(tp2_dp2, 4, str(tmp_path))
    for rank in range(4):  # every rank refuses the local checkpoint of another layout, naming both
        assert "written with tensor_parallel_size=2, this run has tensor_parallel_size=1" in results[rank]["local"]
    # Meta-device init: block1.fc1.weight (6, 5) is split 3 + 3 by TP, each piece's 3 rows 2 + 1 over DP.
    unsplit = {k: tuple(v.shape) for k, v in ToyLM().state_dict().items() if k.startswith("block")}
    for rank in range(4):
        meta = results[rank]["meta"]
        assert {k: v[1] for k, v in meta.items()} == unsplit
        assert all(initialised for _, _, initialised in meta.values()), meta
        assert meta["block1.fc1.weight"][0] == ((2, 5) if rank < 2 else (1, 5)), "rows of the TP piece over DP"
    compared = 0
    cases = [*OPTIMIZERS.items(), ("hybrid", sgd_with_momentum), *((n, sgd_with_momentum) for n in ENGINE_CASES)]
    for name, make_optimizer in cases:
        ref = toy_lm_on_step_batches(STEPS, BATCH, clip_norm=CLIP, optimizer=make_optimizer)
        losses, state, norms, pieces, optimizer_state, (reloaded, reloaded_optimizer) = results[0][name]
        # block1.fc1 weight and bias, block1.fc2 weight (its bias is replicated), block2.fc1 weight and bias
        assert pieces == 5, f"{name}: {pieces} parameters held as TP pieces"
        torch.testing.assert_close(losses, ref.losses, rtol=1e-5, atol=1e-6)
        compared += assert_all_close(state, ref.model.state_dict(), f"TP=2 x DP=2 {name}")
        # The full optimizer state is the unsplit one's (momentum / Adam moments of the unsplit shapes).
        ref_optimizer = ref.optimizer.state_dict()
        assert sorted(optimizer_state["state"]) == sorted(ref_optimizer["state"])
        for index, entry in ref_optimizer["state"].items():
            compared_entries = assert_all_close(optimizer_state["state"][index], entry, f"{name} optimizer {index}")
            assert compared_entries == len(entry)
        assert_tensors_equal(reloaded, state, f"{name}: the full state dict loaded back")
        assert_optimizer_equal(reloaded_optimizer, optimizer_state, f"{name}: the full optimizer state loaded back")
        for rank in range(1, 4):
            assert results[rank][name][2] == norms, f"{name}: rank {rank} clipped by another norm"
    assert compared == len(cases) * len(ToyLM().state_dict())
