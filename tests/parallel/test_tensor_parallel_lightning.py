"""Tensor parallelism under Lightning (docs/parallelism.md): ``FSDPStrategy(tensor_parallel_size=2)`` runs
tests/scripts/tensor_parallel_run.py as a user's script, whose ``configure_model`` parallelizes each block on
``self.device_mesh["tensor_parallel"]``, against the same LightningModule on one device on the same global batches
(the data loader takes ``trainer.distributed_sampler_kwargs``): TP=2 x DP=2 with SGD and momentum, P=2 x TP=2 with
AdamW, both clipping by the global norm (binding: 0.05 is below the gradients' norm); a transformers Llama split by
``tensor_parallel_plan="auto"`` (sequence parallelism) at TP=2 x DP=2 with SGD and momentum, clipping; then the
TP=2 x DP=2 run's sharded checkpoint resumed at TP=1 x DP=4 and at P=2 x TP=2, against the one-device run resumed
from its own checkpoint. The launches start together (tests/toolbox/launch.py's ``in_background``); the checks of
the sizes need no processes."""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.export import export_safetensors
from lightning_fsdp.parallel_dims import ParallelDims
from tests.toolbox.compare import assert_all_close
from tests.toolbox.launch import in_background, run_script

LAUNCH_S = 600  # a guard against a hang, not a measurement
CLIP = ("--clip", "0.05")
# The Llama run: SGD's learning rate 1 so that 3 clipped steps move the weights far beyond the tolerance; 0.5 is
# below the gradients' norm (the reference records it, the test checks it binds).
LLAMA = ("--model", "llama", "--lr", "1", "--clip", "0.5")


def run(out: Path, *args: str) -> list[dict]:
    """One launch of tests/scripts/tensor_parallel_run.py: each rank's results."""
    run_script("tensor_parallel_run.py", "--out", out, *args, cwd=out.parent, timeout=LAUNCH_S)
    files = sorted(out.glob("rank*.pt"), key=lambda f: int(f.stem[4:]))
    return [torch.load(f, weights_only=False) for f in files]


def run_after(before: Future, out: Path, *args: str) -> list[dict]:
    before.result()  # the launch whose checkpoint this one resumes
    return run(out, *args)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("tp")
    ckpt, ref_ckpt = folder / "tp2dp2.ckpt", folder / "ref.ckpt"
    jobs = {
        "tp2dp2": partial(run, folder / "tp2dp2", "--devices", "4", "--tp", "2", *CLIP, "--save", str(ckpt)),
        "p2tp2": partial(
            run, folder / "p2tp2", "--devices", "4", "--tp", "2", "--pp", "2", "--optimizer", "adamw", *CLIP
        ),
        "ref": partial(run, folder / "ref", "--devices", "1", *CLIP, "--save", str(ref_ckpt)),
        "ref-adamw": partial(run, folder / "ref-adamw", "--devices", "1", "--optimizer", "adamw", *CLIP),
        "llama-tp2dp2": partial(run, folder / "llama-tp2dp2", "--devices", "4", "--tp", "2", *LLAMA),
        "llama-ref": partial(run, folder / "llama-ref", "--devices", "1", *LLAMA),
    }
    futures = in_background(jobs)
    resumed = {
        "ref-resumed": partial(
            run_after,
            futures["ref"],
            folder / "refr",
            "--devices",
            "1",
            *CLIP,
            "--steps",
            "5",
            "--resume",
            str(ref_ckpt),
        ),
        "tp1dp4": partial(
            run_after,
            futures["tp2dp2"],
            folder / "tp1dp4",
            "--devices",
            "4",
            "--tp",
            "1",
            *CLIP,
            "--steps",
            "5",
            "--resume",
            str(ckpt),
        ),
        "p2tp2-resumed": partial(
            run_after,
            futures["tp2dp2"],
            folder / "p2tp2r",
            "--devices",
            "4",
            "--tp",
            "2",
            "--pp",
            "2",
            *CLIP,
            "--steps",
            "5",
            "--resume",
            str(ckpt),
        ),
    }
    return {**futures, **in_background(resumed), "paths": [ckpt, ref_ckpt]}


def _data_parallel_mean(ranks: list[dict], data: int, tensor: int) -> list[float]:
    """Each step's loss over the global batch: the mean of the data-parallel ranks' (every TP rank has its DP
    rank's), in the layout's order (global rank = d * T + t)."""
    steps = len(ranks[0]["losses"])
    return [sum(ranks[d * tensor]["losses"][s] for d in range(data)) / data for s in range(steps)]


def _compare_states(ranks: list[dict], ref: dict, what: str) -> int:
    """Every rank's full state (its stages' keys under pipelining) against the reference; every key covered."""
    compared, covered = 0, set()
    for rank, got in enumerate(ranks):
        expected = {k: ref["state"][k] for k in got["state"]}
        compared += assert_all_close(got["state"], expected, f"{what} rank {rank}")
        covered |= set(got["state"])
    assert covered == set(ref["state"]), f"{what}: keys no rank holds: {set(ref['state']) - covered}"
    return compared


def test_tp2_dp2_matches_one_device(launched):
    ranks, ref = launched["tp2dp2"].result(), launched["ref"].result()[0]
    assert len(ranks) == 4
    for rank, got in enumerate(ranks):
        assert got["mesh_dims"] == ("data_parallel", "tensor_parallel")
        assert got["sampler"] == {"num_replicas": 2, "rank": rank // 2}, "a TP group reads its DP rank's samples"
        assert got["losses"] == ranks[rank // 2 * 2]["losses"], "the ranks of one TP group computed the same loss"
    torch.testing.assert_close(_data_parallel_mean(ranks, 2, 2), ref["losses"], rtol=1e-5, atol=1e-6)
    assert _compare_states(ranks, ref, "TP=2 x DP=2") == 4 * len(ref["state"])


def test_p2_tp2_matches_one_device_with_adamw(launched):
    ranks, ref = launched["p2tp2"].result(), launched["ref-adamw"].result()[0]
    assert len(ranks) == 4
    for got in ranks:
        assert got["mesh_dims"] == ("pipeline_parallel", "data_parallel", "tensor_parallel")
        assert got["sampler"] == {"num_replicas": 1, "rank": 0}
        # pipelined_loss returns the global batch's loss on every rank of the pipeline
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    assert _compare_states(ranks, ref, "P=2 x TP=2") == 2 * len(ref["state"])


def test_llama_with_the_built_in_plan_matches_one_device(launched):
    """A transformers ``LlamaForCausalLM`` split by ``tensor_parallel_plan="auto"`` with sequence parallelism (the
    norms' gradients are ``Partial`` over TP) at TP=2 x DP=2, SGD with momentum, clipping by norm: each step's loss
    over the global batch and every full weight after 3 steps, against one device."""
    ranks, ref = launched["llama-tp2dp2"].result(), launched["llama-ref"].result()[0]
    assert len(ranks) == 4 and len(ref["losses"]) == 3
    assert min(ref["grad_norms"]) > 0.5, f"clipping must bind: gradient norms {ref['grad_norms']}"
    for rank, got in enumerate(ranks):
        assert got["mesh_dims"] == ("data_parallel", "tensor_parallel")
        assert got["sampler"] == {"num_replicas": 2, "rank": rank // 2}
        # the plan ran, with sequence parallelism: the residual stream holds half of each of 4 sequences of 8
        assert got["final_norm_output"] == ("(Shard(dim=1),)", (4, 4, 32))
    torch.testing.assert_close(_data_parallel_mean(ranks, 2, 2), ref["losses"], rtol=1e-5, atol=1e-6)
    assert len(ref["state"]) == 21  # embedding, 2 x (7 projections, 2 norms), the final norm, the head
    assert _compare_states(ranks, ref, "Llama TP=2 x DP=2") == 4 * 21


@pytest.mark.parametrize("layout", ["tp1dp4", "p2tp2-resumed"])
def test_sharded_checkpoint_of_tp2_dp2_resumes_in_another_layout(launched, layout):
    ranks, ref = launched[layout].result(), launched["ref-resumed"].result()[0]
    assert len(ref["losses"]) == 2  # steps 4 and 5, after the checkpoint of step 3
    if layout == "tp1dp4":
        torch.testing.assert_close(_data_parallel_mean(ranks, 4, 1), ref["losses"], rtol=1e-5, atol=1e-6)
        assert _compare_states(ranks, ref, layout) == 4 * len(ref["state"])
    else:
        for got in ranks:
            torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert _compare_states(ranks, ref, layout) == 2 * len(ref["state"])


@pytest.mark.parametrize(
    "world,per_node,pipeline,tensor,message",
    [
        (4, 4, 1, 3, "tensor_parallel_size=3 x pipeline_parallel_size=1 = 3 does not divide the 4 processes"),
        (8, 8, 2, 8, "= 16 does not divide the 8 processes"),
        (8, 4, 1, 8, "tensor_parallel_size=8 with 4 processes per node"),
        (12, 6, 1, 4, "T must divide 6; choose one of [1, 2, 3, 6]"),
    ],
)
def test_sizes_that_cannot_be_placed_are_refused(world, per_node, pipeline, tensor, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ParallelDims.check(world, per_node, pipeline=pipeline, tensor=tensor)


def test_layout_places_tp_innermost_then_data_then_pipeline():
    dims = ParallelDims.check(8, 8, pipeline=2, tensor=2)
    assert (dims.data, dims.shard, dims.replicate) == (2, 2, 1)
    assert [dims.coordinates(r) for r in range(8)] == [(p, d, t) for p in range(2) for d in range(2) for t in range(2)]
    assert [dims.sampler_kwargs(r)["rank"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    hybrid = ParallelDims.check(16, 4, tensor=2, hybrid=True)  # 4 nodes of 4: shard over a node's 2 DP ranks
    assert (hybrid.data, hybrid.shard, hybrid.replicate) == (8, 2, 4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be a positive int"),
        (
            {"tensor_parallel_size": 2, "tensor_parallel_plan": "megatron"},
            "tensor_parallel_plan='megatron' is not valid",
        ),
        ({"tensor_parallel_plan": "auto"}, "needs tensor_parallel_size > 1"),
        ({"tensor_parallel_size": 2, "process_group": lambda: None}, "builds the \\(data_parallel, tensor_parallel\\)"),
    ],
)
def test_bad_tensor_parallel_arguments_raise_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FSDPStrategy(**kwargs)


def test_convert_and_export_read_the_tp2_dp2_sharded_checkpoint(launched, tmp_path):
    """``lightning-fsdp convert`` and ``export`` on the N-D checkpoint: the unsplit model's names and values."""
    ranks = launched["tp2dp2"].result()  # wrote the checkpoint at its end, then each rank's full state
    ckpt = next(Path(p) for p in launched["paths"] if p.name == "tp2dp2.ckpt")
    expected = {f"model.{k}": v for k, v in ranks[0]["state"].items()}
    assert convert(str(ckpt), str(tmp_path / "full.ckpt")) == "full"
    converted = torch.load(tmp_path / "full.ckpt", weights_only=True)["state_dict"]
    assert assert_all_close(converted, expected, "converted", rtol=0, atol=0) == len(expected)
    files = export_safetensors(str(ckpt), str(tmp_path / "hf"), prefix="model.")
    exported = {k: v for f in files if f.endswith(".safetensors") for k, v in load_file(f).items()}
    assert assert_all_close(exported, ranks[0]["state"], "exported", rtol=0, atol=0) == len(ranks[0]["state"])
