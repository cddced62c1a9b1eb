"""Tensor parallelism composed with the rest of the strategy, each case against one device on the same global batch
(fp32 unless the case is precision, rtol 1e-5, norm clipping that binds).

Under Lightning, TP=2 x DP=2 (4 gloo ranks), one launch of tests/scripts/tp_compose_run.py running every case's
``Trainer.fit`` in sequence, against one launch of the same script on one device:

- gradient accumulation (``accumulate_grad_batches=2``, SGD with momentum), activation checkpointing (the strategy's
  ``activation_checkpointing_policy``, AdamW), ``weights_after_stage="full"`` (SGD: the module's own parameters after
  ``fit``), ``torch.compile`` of each parallelized block (``aot_eager``, AdamW): each step's loss over the global
  batch and every weight at rtol 1e-5;
- ``precision="bf16-mixed"`` (bf16 gathers, compute and reduction) against one device's ``bf16-mixed`` (autocast):
  not the same rounding, so a stated tolerance (``test_bf16_mixed_...``);
- ``load_pretrained`` of an unsplit safetensors file into TP x DP shards built on the meta device
  (``empty_init=True``): every tensor each rank materialises from the file is its own slice, and training equals one
  device that loaded the same file; the ``local`` checkpoint it then saves, converted to full by ``lightning-fsdp
  convert``, equals the model.

Engine level (no Lightning): HYBRID_SHARD x TP with two shard ranks per replica, TP=2 x (replicate 2 x shard 2) = 8
gloo processes, SGD with momentum and AdamW, against one device.

Faults: after those cases, in the same launch (sparing a second 4-rank start), a TP rank that ``os._exit``s in the
middle of a backward (its TP peer waiting in a DTensor collective) ends every rank of the job within the collective
timeout, nothing left behind.

Every launch starts together (tests/toolbox/launch.py's ``in_background``).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from benchmarks.ranks import clean_env, group_members
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.export import export_safetensors
from lightning_fsdp.checkpoint.full import full_model_state_dict
from lightning_fsdp.engine import fully_shard
from tests.toolbox.compare import assert_all_close
from tests.toolbox.distributed import run_distributed
from tests.toolbox.fault_jobs import MARGIN_S, PEER_GONE, Job
from tests.toolbox.launch import SCRIPTS, in_background, run_script
from tests.toolbox.models import Block, ToyLM, parallelize_toy_lm
from tests.toolbox.one_device import toy_lm_on_step_batches
from tests.toolbox.tp_models import chain_lm, perturbed
from tests.toolbox.training import sgd_with_momentum, train_on_shares

LAUNCH_S = 600  # a guard against a hang, not a measurement
# FSDPStrategy(timeout=...) of the TP launch, whose last case is the fault: above any wait of the cases before it on
# two loaded cores (a rank compiling while its peers wait), far below torch's default of 30 minutes.
FAULT_TIMEOUT_S = 30
FAULT_RANK = 3  # its TP peer is rank 2; ranks 0 and 1 are the other TP group
TP_CASES = "accumulate,checkpointing,full,compile,bf16,pretrained,fault"
REF_CASES = "sgd,adamw,accumulate,bf16,pretrained"
REFERENCE = {"accumulate": "accumulate", "checkpointing": "adamw", "full": "sgd", "compile": "adamw"}
STEPS, BATCH, CLIP = 3, 8, 0.05


def run(out: Path, *args: str) -> list[dict]:
    """One launch of tests/scripts/tp_compose_run.py: each rank's ``{case: result}``."""
    run_script("tp_compose_run.py", "--out", out, *args, cwd=out.parent, timeout=LAUNCH_S)
    files = sorted(out.glob("rank*.pt"), key=lambda f: int(f.stem[4:]))
    return [torch.load(f, weights_only=False) for f in files]


OPTIMIZERS = {"sgd": sgd_with_momentum, "adamw": partial(torch.optim.AdamW, lr=0.01)}


def hybrid_tp(rank: int, world_size: int) -> dict:
    """ToyLM parallelized over TP=2 and sharded HYBRID over (replicate 2 x shard 2), trained with clipping by SGD with
    momentum and by AdamW: per optimizer, what ``train_hybrid`` returns."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tensor_parallel"))
    results = {name: train_hybrid(mesh, make_optimizer) for name, make_optimizer in OPTIMIZERS.items()}
    dist.barrier()
    return results


def train_hybrid(mesh: DeviceMesh, make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]) -> dict:
    """This rank's data-parallel rank and losses, the full state, each step's norm, and the shape of this rank's
    shard of block1.fc1.weight's TP piece (split over its shard group only)."""
    data_rank = mesh["replicate"].get_local_rank() * 2 + mesh["shard"].get_local_rank()
    torch.manual_seed(0)
    model = parallelize_toy_lm(ToyLM(), mesh["tensor_parallel"])
    engine = fully_shard(
        model,
        auto_wrap_policy={Block},
        sharding_strategy="HYBRID_SHARD",
        process_group=mesh["shard"].get_group(),
        replicate_group=mesh["replicate"].get_group(),
    )
    norms: list[float] = []

    def clip() -> None:
        norms.append(float(engine.clip_grad_norm_(model.parameters(), CLIP)))

    optimizer = make_optimizer(model.parameters())
    losses = train_on_shares(model, optimizer, STEPS, BATCH, data_rank, 4, before_step=clip)
    return {
        "losses": [float(loss) for loss in losses],
        "norms": norms,
        "state": full_model_state_dict(engine, rank0_only=False),
        "fc1_rows": tuple(model.block1.fc1.weight.shape),
        "data_rank": data_rank,
    }


def tp_job(folder: Path, *args: str) -> dict:
    """The TP=2 x DP=2 launch under Lightning's launcher: every case, then rank ``FAULT_RANK`` dies mid-backward. Each
    rank's results of the cases before, and what the fault test checks, recorded before every group is killed."""
    job = Job(folder)
    out = folder / "tp"
    try:
        args = ("--out", str(out), "--devices", "4", "--cases", TP_CASES, *args)
        args += ("--fault-rank", str(FAULT_RANK), "--timeout", str(FAULT_TIMEOUT_S))
        proc = job.start_command([sys.executable, SCRIPTS / "tp_compose_run.py", *args], clean_env())
        ended = job.wait_for_exit(proc, FAULT_TIMEOUT_S + MARGIN_S)
        left: list[int] | None = None
        if ended is not None:
            deadline = time.monotonic() + 5
            while group_members(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = group_members(proc.pid)
        seen = {"ended": ended, "fault_at": job.fault_time(), "rc": proc.returncode, "left_behind": left}
        seen.update(output=job.output(), report=job.report())
    finally:
        job.close()
    files = sorted(out.glob("rank*.pt"), key=lambda f: int(f.stem[4:]))
    return {"ranks": [torch.load(f, weights_only=False) for f in files], "fault": seen}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("tpcompose")
    torch.manual_seed(1)
    pretrained = {k: v.detach().clone() for k, v in perturbed(chain_lm(), seed=1).state_dict().items()}
    save_file(pretrained, folder / "pretrained.safetensors")
    files = ("--pretrained", str(folder / "pretrained.safetensors"))
    jobs = {
        "tp": partial(tp_job, folder, *files),
        "ref": partial(run, folder / "ref", "--devices", "1", "--cases", REF_CASES, *files),
        "hybrid": partial(run_distributed, hybrid_tp, 8),
    }
    return {**in_background(jobs), "folder": folder, "pretrained": pretrained}


def _case(launched: dict, case: str) -> list[dict]:
    ranks = launched["tp"].result()["ranks"]
    assert len(ranks) == 4, launched["tp"].result()["fault"]["report"]
    results = [r[case] for r in ranks]
    for rank, result in enumerate(results):
        assert "failed" not in result, f"{case} failed on rank {rank}:\n{result['failed']}"
    return results


def _global_losses(results: list[dict]) -> list[float]:
    """Each forward's loss over the global batch: the mean of the two data-parallel ranks' (global rank d * 2 + t);
    the ranks of one TP group computed the same loss."""
    for rank in (1, 3):
        assert results[rank]["losses"] == results[rank - 1]["losses"], f"rank {rank}: another loss than its TP peer"
    return [(a + b) / 2 for a, b in zip(results[0]["losses"], results[2]["losses"], strict=True)]


def _compare_states(results: list[dict], expected: dict, what: str, **tolerance: float) -> int:
    return sum(
        assert_all_close(r["state"], expected, f"{what} rank {rank}", **tolerance) for rank, r in enumerate(results)
    )


@pytest.mark.parametrize("case", list(REFERENCE))
def test_tp2_dp2_case_matches_one_device(launched, case):
    results = _case(launched, case)
    ref = launched["ref"].result()[0][REFERENCE[case]]
    assert min(ref["grad_norms"]) > CLIP, f"clipping must bind: gradient norms {ref['grad_norms']}"
    forwards = 2 * STEPS if case == "accumulate" else STEPS
    assert len(ref["losses"]) == forwards
    for rank, result in enumerate(results):
        assert result["sampler"] == {"num_replicas": 2, "rank": rank // 2}
    torch.testing.assert_close(_global_losses(results), ref["losses"], rtol=1e-5, atol=1e-6)
    assert _compare_states(results, ref["state"], case) == 4 * len(ref["state"]) == 4 * 21
    first = results[0]
    if case == "checkpointing":
        assert first["fc1_forwards"] == 2 * STEPS, "each block's forward runs again in backward"
    if case == "full":
        # the stage ended with the full model in the module: no engine, DTensor parameters holding full TP pieces
        assert not first["engine_left"] and first["dtensor_params"] == 16
    if case == "compile":
        assert first["graph_breaks"] == 0 and first["frames_compiled"] >= 4, first


def test_bf16_mixed_matches_one_device_bf16_mixed(launched):
    """``precision="bf16-mixed"``: the sharded run gathers bf16 parameters and reduces bf16 gradients, one device
    runs the same module under bf16 autocast with fp32 weights; they round differently (a bf16 element carries 8
    bits: relative rounding 2**-9). Tolerance: each step's loss within rtol 4e-3 (one bf16 ulp, measured 6e-4), and
    each tensor's update over the 3 steps (final minus initial weight) within 3 % of the reference's update in norm
    (measured 1.2 %), where a wrong gradient scale or a gradient on the wrong rows moves it by its own size."""
    results = _case(launched, "bf16")
    ref = launched["ref"].result()[0]
    bf16, fp32 = ref["bf16"], ref["sgd"]
    assert results[0]["fc1_weight_dtype"] == "torch.bfloat16" and bf16["fc1_weight_dtype"] == "torch.float32"
    torch.testing.assert_close(_global_losses(results), bf16["losses"], rtol=4e-3, atol=0)
    assert _global_losses(results) != fp32["losses"], "bf16 compute must show in the losses"
    errors = []
    for rank, result in enumerate(results):
        for name, initial in bf16["initial"].items():
            update, want = result["state"][name] - initial, bf16["state"][name] - initial
            errors.append(float((update - want).norm() / want.norm()))
            assert errors[-1] <= 3e-2, f"rank {rank} {name}: update off by {errors[-1]:.2%} of the reference's"
    assert len(errors) == 4 * 21
    loss_error = max(abs(a - b) / b for a, b in zip(_global_losses(results), bf16["losses"], strict=True))
    print(f"\n[tp bf16] worst update error {max(errors):.2%}, worst loss error {loss_error:.1e} (rtol)")


def test_load_pretrained_reads_each_ranks_slice_then_trains_as_one_device(launched):
    """Built on the meta device under TP=2 x DP=2, filled from the unsplit file: each rank materialised exactly its
    shard of its TP piece of every tensor (no rank read a whole tensor), then trained as one device that loaded the
    same file."""
    results = _case(launched, "pretrained")
    ref = launched["ref"].result()[0]["pretrained"]
    full = launched["pretrained"]
    read_per_tensor = dict.fromkeys(full, 0)
    for rank, result in enumerate(results):
        reads = dict(result["reads"])
        assert len(reads) == len(result["reads"]) == len(full), f"rank {rank} read a tensor twice or missed one"
        assert reads == result["local_shapes"], f"rank {rank}: what it read is not what it holds"
        for name, shape in reads.items():
            read_per_tensor[name] += torch.Size(shape).numel()
    split = {n for n in full if n.startswith("blocks.") and not n.endswith("fc2.bias")}
    assert len(split) == 12  # fc1 weight and bias, fc2 weight, in 4 blocks
    for name, value in full.items():
        # a TP-split tensor is read once over the 4 ranks; a replicated one once per TP rank
        assert read_per_tensor[name] == value.numel() * (1 if name in split else 2), name
    assert results[0]["local_shapes"]["blocks.2.fc1.weight"] == (2, 6), "8 rows: 4 per TP rank, 2 per DP rank"
    torch.testing.assert_close(_global_losses(results), ref["losses"], rtol=1e-5, atol=1e-6)
    assert _compare_states(results, ref["state"], "pretrained") == 4 * len(full)
    # the model's own initial values are not the file's: the load is what made the runs agree
    assert not any(torch.equal(ref["initial"][k], v) for k, v in full.items())


def test_local_checkpoint_of_tp2_dp2_converts_and_exports_as_the_full_model(launched, tmp_path):
    results = _case(launched, "pretrained")
    local = launched["folder"] / "tp" / "local.ckpt"
    assert convert(str(local), str(tmp_path / "full.ckpt")) == "full"
    converted = torch.load(tmp_path / "full.ckpt", weights_only=True)
    expected = {f"model.{k}": v for k, v in results[0]["state"].items()}
    assert assert_all_close(converted["state_dict"], expected, "converted local", rtol=0, atol=0) == 21
    # the optimizer state joined from the TP pieces: the momentum of one device that trained the same
    ref = launched["ref"].result()[0]["pretrained"]["optimizer"]["state"]
    joined = converted["optimizer_states"][0]["state"]
    assert sorted(joined) == sorted(ref) and len(ref) == 21
    for index, entry in ref.items():
        assert assert_all_close(joined[index], entry, f"converted momentum {index}") == 1
    # lightning-fsdp export reads it as the unsplit model too
    files = export_safetensors(str(local), str(tmp_path / "hf"), prefix="model.")
    exported = {k: v for f in files if f.endswith(".safetensors") for k, v in load_file(f).items()}
    assert assert_all_close(exported, results[0]["state"], "exported local", rtol=0, atol=0) == 21


def test_hybrid_shard_with_two_shard_ranks_per_replica_matches_one_device(launched):
    results = launched["hybrid"].result()
    assert len(results) == 8
    compared = 0
    for name, optimizer in OPTIMIZERS.items():
        ref = toy_lm_on_step_batches(STEPS, BATCH, clip_norm=CLIP, optimizer=optimizer)
        runs = [r[name] for r in results]
        assert [r["data_rank"] for r in runs] == [0, 0, 1, 1, 2, 2, 3, 3]
        # block1.fc1.weight (6, 5): 3 rows per TP rank, split 2 + 1 over the 2 ranks of a shard group (not over 4)
        assert [r["fc1_rows"][0] for r in runs] == [2, 2, 1, 1, 2, 2, 1, 1]
        means = [sum(runs[d * 2]["losses"][s] for d in range(4)) / 4 for s in range(STEPS)]
        torch.testing.assert_close(means, ref.losses, rtol=1e-5, atol=1e-6)
        for rank, got in enumerate(runs):
            assert got["norms"] == runs[0]["norms"], f"{name}: rank {rank} clipped by another norm"
            compared += assert_all_close(got["state"], ref.model.state_dict(), f"hybrid x TP {name} rank {rank}")
        assert min(runs[0]["norms"]) > CLIP, "clipping must bind"
    assert compared == 2 * 8 * len(ToyLM().state_dict())


def test_a_tp_rank_that_dies_ends_every_rank_within_the_timeout(launched):
    seen = launched["tp"].result()["fault"]
    assert seen["ended"] is not None, f"the job did not end in time:\n{seen['report']}"
    assert seen["fault_at"] is not None, f"the fault was never injected:\n{seen['report']}"
    elapsed = seen["ended"] - seen["fault_at"]
    print(f"\n[tp fault] exit@rank{FAULT_RANK}/backward: job ended {elapsed:.1f}s after the fault")
    output = seen["output"]
    assert seen["rc"] != 0, seen["report"]
    assert output.count("event=train-start") == 4, seen["report"]  # every rank was training
    assert "event=train-end" not in output, seen["report"]
    # a survivor's collective saw the rank gone, or Lightning's launcher saw its child die
    assert re.search(rf"{PEER_GONE}|terminated with code", output), output[-4000:]
    assert elapsed <= FAULT_TIMEOUT_S + MARGIN_S, elapsed
    assert seen["left_behind"] == [], f"processes left behind:\n{seen['report']}"
