"""Checkpoints across pipeline layouts (issue 13): a checkpoint saved under P=2 x D=2 resumes under P=1 (plain
fsdp_custom on 2 ranks), on one device and under DDP, and theirs resume under P=2 x D=2, in both the sharded and
the full format, with the unsplit model's parameter names.

Every training run is tests/scripts/pipeline_checkpoint_run.py (ChainLM, SGD with momentum over two param groups,
so the optimizer state and its numbering matter), launched as users launch scripts, several jobs per launch, the
independent launches at once. An epoch is 2 steps on the same global batches on every layout: a run that saves at the
end of epoch 1 and a fresh run that resumes from it for epoch 2 must end where the independent reference ends, an
uninterrupted 4-step run on one device (strategy "auto", no pipelining). A sharded checkpoint reaches DDP and the
one-device run as plain Lightning reads it: converted to a full file by ``lightning_fsdp.checkpoint.convert`` first.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from functools import partial

import pytest
import torch

from lightning_fsdp.checkpoint.common import CheckpointMismatchError
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.safe_load import read_dcp_metadata
from lightning_fsdp.checkpoint.sharded import read_sharded_checkpoint_full
from lightning_fsdp.pipeline.checkpoint import OptimizerMap, PipelineCheckpoint, _optimizer_map, unsplit_order
from tests.toolbox.launch import in_background, run_script

P2 = ["--devices", "4", "--pp", "2"]
RTOL, ATOL = 1e-5, 1e-6
LAUNCH_S = 400  # one launch, next to the others running at once; a guard against a hang, not a measurement
N_PARAMS = 21  # ChainLM: embedding, 4 blocks of 2 linears, norm, head
STAGE1_KEY = "model.head.bias"  # a parameter of the second stage only (checked below)


class Runs:
    """Each launch once per module, all started in the background (tests/toolbox/launch.py's ``in_background``), each
    after the launches whose checkpoints it reads."""

    def __init__(self, folder: str) -> None:
        self.dir = folder
        self._prepare_lock = threading.Lock()  # two launches may need the same converted file
        self._submitted = threading.Event()
        # The dict's order starts every launch after those it reads; one-device and DDP wait for p2_save only.
        order = ["p2_save", "p2_interleaved", "p1", "ddp", "single", "p2_resume"]
        assert sorted(order) == sorted(self.specs())
        self._futures: dict[str, Future] = in_background({name: partial(self._launch, name) for name in order})
        self._submitted.set()

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def specs(self) -> dict[str, tuple[list[str], list[dict], list[str]]]:
        p = self.path
        return {
            # Trains 2 epochs under P=2 x D=2, saving after the first in every format (local is refused); and
            # 1 epoch with one param group (SGD over self.parameters()), saving a full file.
            "p2_save": (
                P2,
                [
                    {"name": "save", "save_full": p("p2.ckpt"), "save_sharded": p("p2s.ckpt"), "save_local": p("p2l")},
                    {"name": "save_g1", "epochs": 1, "groups": 1, "save_full": p("p2_g1.ckpt")},
                ],
                [],
            ),
            # Interleaved1F1B: pipeline rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (not runs of the model).
            "p2_interleaved": (
                [*P2, "--schedule", "Interleaved1F1B"],
                [{"name": "save", "epochs": 1, "save_full": p("p2i.ckpt"), "save_sharded": p("p2is.ckpt")}],
                [],
            ),
            # One device, strategy "auto": the references, and the resumes of the P=2 checkpoints.
            "single": (
                ["--devices", "1", "--strategy", "single"],
                [
                    {"name": "ref"},
                    {"name": "ref_g1", "groups": 1},
                    {"name": "from_p2_full", "resume": p("p2.ckpt")},
                    {"name": "from_p2_sharded", "resume": p("p2s_as_full.ckpt")},
                    {"name": "from_p2_full_g1", "groups": 1, "resume": p("p2_g1.ckpt")},
                    {"name": "from_p2i_full", "resume": p("p2i.ckpt")},
                    {"name": "from_p2i_sharded", "resume": p("p2is_as_full.ckpt")},
                ],
                ["p2_save", "p2_interleaved"],
            ),
            # Plain fsdp_custom on 2 ranks: its own save (for the reverse direction), and the resumes.
            "p1": (
                ["--devices", "2", "--pp", "1"],
                [
                    {"name": "save", "save_full": p("p1.ckpt"), "save_sharded": p("p1s.ckpt")},
                    {"name": "from_p2_sharded", "resume": p("p2s.ckpt")},
                    {"name": "from_p2_full", "resume": p("p2.ckpt")},
                ],
                ["p2_save"],
            ),
            "ddp": (
                ["--devices", "2", "--strategy", "ddp"],
                [
                    {"name": "save", "save_full": p("ddp.ckpt")},
                    {"name": "from_p2_full", "resume": p("p2.ckpt")},
                    {"name": "from_p2_sharded", "resume": p("p2s_as_full.ckpt")},
                ],
                ["p2_save"],
            ),
            # The reverse: P=1 and DDP checkpoints under P=2 x D=2; P=2's own; checkpoints that lack a key of the
            # second stage only (every rank must raise, the first stage's too).
            "p2_resume": (
                P2,
                [
                    {"name": "from_p1_sharded", "resume": p("p1s.ckpt")},
                    {"name": "from_p1_full", "resume": p("p1.ckpt")},
                    {"name": "from_ddp_full", "resume": p("ddp.ckpt")},
                    {"name": "from_p2_sharded", "resume": p("p2s.ckpt")},
                    {"name": "bad_full", "resume": p("bad.ckpt")},
                    {"name": "bad_sharded", "resume": p("bad_s.ckpt")},
                ],
                ["p1", "ddp"],
            ),
        }

    def prepare(self, name: str) -> None:
        """Files a launch reads that no launch writes: conversions, damaged copies."""
        p = self.path
        if name in ("single", "ddp") and not os.path.exists(p("p2s_as_full.ckpt")):
            convert(p("p2s.ckpt"), p("p2s_as_full.ckpt"))  # plain Lightning reads a sharded checkpoint this way
        if name == "single":
            convert(p("p2is.ckpt"), p("p2is_as_full.ckpt"))
        if name == "p2_resume":
            bad = torch.load(p("p1.ckpt"), weights_only=False)
            del bad["state_dict"][STAGE1_KEY]
            torch.save(bad, p("bad.ckpt"))
            convert(p("bad.ckpt"), p("bad_s.ckpt"), to="sharded")

    def _launch(self, name: str) -> list[dict]:
        self._submitted.wait()
        args, jobs, needs = self.specs()[name]
        for need in needs:
            self.get(need)
        with self._prepare_lock:
            self.prepare(name)
        out = self.path(f"out_{name}")
        run_script("pipeline_checkpoint_run.py", "--out", out, *args, "--jobs", json.dumps(jobs), timeout=LAUNCH_S)
        files = sorted(os.listdir(out), key=lambda f: int(f[4:-3]))
        return [torch.load(os.path.join(out, f), weights_only=False) for f in files]

    def get(self, name: str) -> list[dict]:
        """Every rank's results of launch ``name``."""
        return self._futures[name].result()

    def wait_all(self) -> None:
        for future in self._futures.values():
            future.exception()  # waits; the tests report errors

    def job(self, name: str, job: str) -> list[dict]:
        return [rank[job] for rank in self.get(name)]


@pytest.fixture(scope="module")
def runs():
    folder = tempfile.mkdtemp(prefix="pp_ckpt_")
    runs = Runs(folder)
    yield runs
    runs.wait_all()  # no launch still writing into the folder
    shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ comparisons
def ended(ranks: list[dict]) -> dict:
    """One run's end: the union over its ranks of the parameters and momentum buffers they hold, by name (ranks
    holding the same piece must agree exactly), and the global batch's loss per step (the mean over the ranks)."""
    params: dict[str, torch.Tensor] = {}
    momentum: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank}: {result['error']}"
        assert result["params"] and sorted(result["params"]) == sorted(result["momentum"]), rank
        for found, held in ((params, result["params"]), (momentum, result["momentum"])):
            for key, value in held.items():
                if key in found:
                    assert torch.equal(found[key], value), f"rank {rank} disagrees on {key}"
                found[key] = value
    losses = torch.tensor([r["losses"] for r in ranks]).mean(0)
    return {"params": params, "momentum": momentum, "losses": losses, "ranks": ranks}


def assert_ends_where(run: dict, ref: dict, what: str) -> int:
    """``run`` (resumed after 2 steps) ends where ``ref`` (4 uninterrupted steps) ends; returns the tensors compared."""
    assert all(r["start_step"] == 2 and r["end_step"] == 4 for r in run["ranks"]), what
    names = ref["ranks"][0]["names"]
    assert len(names) == N_PARAMS
    # Same parameter names as the unsplit model: each rank holds some, in the model's order; together all of them.
    for rank in run["ranks"]:
        assert rank["names"] == [n for n in names if n in set(rank["names"])], what
    assert sorted(run["params"]) == sorted(run["momentum"]) == sorted(names), what
    compared = 0
    for kind in ("params", "momentum"):
        for key in names:
            torch.testing.assert_close(
                run[kind][key],
                ref[kind][key],
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m, k=key, t=kind: f"{what} {t} {k}: {m}",
            )
            compared += 1
    torch.testing.assert_close(run["losses"], ref["losses"][2:], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    return compared


# ------------------------------------------------------------------------------------------------ resume parity
def test_p2_checkpoints_resume_under_p1_one_device_and_ddp(runs):
    ref = ended(runs.job("single", "ref"))
    assert len(ref["losses"]) == 4
    resumed = {
        "P=1 fsdp_custom (2 ranks) <- P=2 sharded": ("p1", "from_p2_sharded"),
        "P=1 fsdp_custom (2 ranks) <- P=2 full": ("p1", "from_p2_full"),
        "one device <- P=2 full": ("single", "from_p2_full"),
        "one device <- P=2 sharded (converted)": ("single", "from_p2_sharded"),
        "DDP (2 ranks) <- P=2 full": ("ddp", "from_p2_full"),
        "DDP (2 ranks) <- P=2 sharded (converted)": ("ddp", "from_p2_sharded"),
    }
    compared = sum(assert_ends_where(ended(runs.job(*where)), ref, what) for what, where in resumed.items())
    assert compared == len(resumed) * 2 * N_PARAMS  # 6 runs x (21 parameters + 21 momentum buffers)
    # The resumed runs restarted from the checkpoint, not from scratch: the state moved on after the save.
    saved = torch.load(runs.path("p2.ckpt"), weights_only=False)
    assert saved["global_step"] == 2
    assert not torch.allclose(saved["state_dict"]["model.emb.weight"], ref["params"]["model.emb.weight"])


def test_p1_and_ddp_checkpoints_resume_under_p2(runs):
    ref = ended(runs.job("single", "ref"))
    resumed = {
        "P=2 x D=2 <- P=1 sharded": "from_p1_sharded",
        "P=2 x D=2 <- P=1 full": "from_p1_full",
        "P=2 x D=2 <- DDP full": "from_ddp_full",
        "P=2 x D=2 <- P=2 sharded": "from_p2_sharded",
    }
    compared = 0
    for what, job in resumed.items():
        ranks = runs.job("p2_resume", job)
        run = ended(ranks)
        # Each stage on its two data-parallel ranks: ranks 0, 1 hold the first stage, 2, 3 the second.
        stage0, stage1 = set(ranks[0]["params"]), set(ranks[2]["params"])
        assert stage0 == set(ranks[1]["params"]) and stage1 == set(ranks[3]["params"]) and not stage0 & stage1
        compared += assert_ends_where(run, ref, what)
    assert compared == len(resumed) * 2 * N_PARAMS


def test_one_param_group_over_self_parameters(runs):
    ref = ended(runs.job("single", "ref_g1"))
    run = ended(runs.job("single", "from_p2_full_g1"))
    assert run["ranks"][0]["groups"] == [ref["ranks"][0]["names"]]
    assert assert_ends_where(run, ref, "one device <- P=2 full, one param group") == 2 * N_PARAMS
    saved = torch.load(runs.path("p2_g1.ckpt"), weights_only=False)["optimizer_states"][0]
    assert [g["params"] for g in saved["param_groups"]] == [list(range(N_PARAMS))]


def test_interleaved_stages_checkpoint_in_the_model_order(runs):
    ref = ended(runs.job("single", "ref"))
    names = ref["ranks"][0]["names"]
    held = [r["names"] for r in runs.job("p2_interleaved", "save")]
    assert held[0] == held[1] and held[2] == held[3] and sorted(held[0] + held[2]) == sorted(names)
    assert held[0] != names[: len(held[0])]  # rank 0's pieces are not a run at the model's start: interleaved
    compared = assert_ends_where(ended(runs.job("single", "from_p2i_full")), ref, "one device <- interleaved full")
    compared += assert_ends_where(
        ended(runs.job("single", "from_p2i_sharded")), ref, "one device <- interleaved sharded (converted)"
    )
    assert compared == 2 * 2 * N_PARAMS
    # Both files list the parameters in the unsplit model's order, not pipeline rank by pipeline rank.
    full = torch.load(runs.path("p2i.ckpt"), weights_only=False)
    whole = read_sharded_checkpoint_full(runs.path("p2is.ckpt"))
    assert list(full["state_dict"]) == list(whole["state_dict"]) == names
    (a,), (b,) = full["optimizer_states"], whole["optimizer_states"]
    assert a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i]["momentum_buffer"], b["state"][i]["momentum_buffer"]) for i in a["state"])


# ------------------------------------------------------------------------------------------------ the files
def test_full_file_is_the_file_ddp_writes(runs):
    runs.get("ddp")
    ours = torch.load(runs.path("p2.ckpt"), weights_only=False)
    ddp = torch.load(runs.path("ddp.ckpt"), weights_only=False)
    assert ours["global_step"] == ddp["global_step"] == 2
    assert list(ours["state_dict"]) == list(ddp["state_dict"])  # the unsplit model's keys, in its order
    compared = 0
    for key, value in ddp["state_dict"].items():
        got = ours["state_dict"][key]
        assert got.shape == value.shape and got.dtype == value.dtype, key
        torch.testing.assert_close(got, value, rtol=RTOL, atol=ATOL, msg=key)
        compared += 1
    (a,), (b,) = ours["optimizer_states"], ddp["optimizer_states"]
    assert a["param_groups"] == b["param_groups"]  # settings and the unsplit optimizer's indices
    assert [len(g["params"]) for g in a["param_groups"]] == [10, 11]
    assert sorted(a["state"]) == sorted(b["state"]) == list(range(N_PARAMS))
    for index, entry in b["state"].items():
        torch.testing.assert_close(a["state"][index]["momentum_buffer"], entry["momentum_buffer"], rtol=RTOL, atol=ATOL)
        compared += 1
    assert compared == 2 * N_PARAMS


def test_sharded_directory_describes_the_whole_model(runs):
    ranks = runs.get("p2_save")
    path = runs.path("p2s.ckpt")
    metadata = read_dcp_metadata(path)
    # Every rank wrote its own rows; the metadata lists every parameter of both stages at its full shape.
    assert {info.relative_path for info in metadata.storage_data.values()} == {f"__{r}_0.distcp" for r in range(4)}
    full = torch.load(runs.path("p2.ckpt"), weights_only=False)
    for key, value in full["state_dict"].items():
        assert tuple(metadata.state_dict_metadata[f"model.{key}"].size) == tuple(value.shape), key
    info = torch.load(os.path.join(path, "meta.pt"), weights_only=False)["lightning_fsdp"]
    assert info["pipeline"]["size"] == 2 and info["pipeline"]["data_size"] == 2
    assert info["pipeline"]["model_keys"] == list(full["state_dict"])
    # Read whole (as convert does), it is the full file of the same save, exactly: names, order, indices, values.
    whole = read_sharded_checkpoint_full(path)
    assert list(whole["state_dict"]) == list(full["state_dict"])
    compared = 0
    for key, value in full["state_dict"].items():
        assert torch.equal(whole["state_dict"][key], value), key
        compared += 1
    (a,), (b,) = whole["optimizer_states"], full["optimizer_states"]
    assert a["param_groups"] == b["param_groups"] and sorted(a["state"]) == sorted(b["state"])
    for index, entry in b["state"].items():
        assert torch.equal(a["state"][index]["momentum_buffer"], entry["momentum_buffer"]), index
        compared += 1
    assert compared == 2 * N_PARAMS
    # The stage layout this test relies on: STAGE1_KEY lives on the second stage's ranks (2, 3) only.
    held = [set(r["save"]["params"]) for r in ranks]
    assert [STAGE1_KEY in h for h in held] == [False, False, True, True]


# ------------------------------------------------------------------------------------------------ errors
def test_errors_raise_on_every_rank(runs):
    for job in ("bad_full", "bad_sharded"):
        ranks = runs.job("p2_resume", job)
        assert len(ranks) == 4
        for rank, result in enumerate(ranks):
            kind, message = result["error"]
            assert kind == CheckpointMismatchError.__name__, (job, rank, message)
            assert f"missing keys ['{STAGE1_KEY}']" in message and "unexpected keys []" in message, (job, rank)
            # The first stage's ranks have every key they hold: they raise because the second stage's did.
            assert ("[raised on rank 2]" in message) == (rank < 2), (job, rank, message)
    # state_dict_type="local" is refused on every rank, at the save, and nothing is written; training goes on.
    for rank, result in enumerate(runs.job("p2_save", "save")):
        kind, message = result["save_errors"]["local"]
        assert kind == "ValueError" and "state_dict_type='local' with pipeline_parallel_size > 1" in message, rank
        assert result["end_step"] == 4
    assert not os.path.exists(runs.path("p2l"))


# ------------------------------------------------------------------------------------------------ numbering
def test_unsplit_order_follows_the_model_not_the_ranks():
    pieces = ["emb", "blocks.0", "blocks.1", "blocks.2", "head"]
    # Interleaved: pipeline rank 0 holds stages 0 and 2 (emb, blocks.1), rank 1 stages 1 and 3; ``scale`` is the
    # LightningModule's own parameter and ``aux`` a child registered after the model: both on every rank.
    rank0 = ["scale", "model.emb.weight", "model.blocks.1.w", "model.blocks.1.b", "aux.w"]
    rank1 = ["scale", "model.blocks.0.w", "model.blocks.2.w", "model.head.w", "model.head.b", "aux.w"]
    assert unsplit_order([rank0, rank1], ["model", "aux"], "model", pieces) == [
        "scale",
        "model.emb.weight",
        "model.blocks.0.w",
        "model.blocks.1.w",
        "model.blocks.1.b",
        "model.blocks.2.w",
        "model.head.w",
        "model.head.b",
        "aux.w",
    ]


class _Layout:
    pp_rank = 1


def test_optimizer_numbering_rule_and_refusals():
    order = ["a.w", "a.b", "b.w", "b.b", "c.w", "c.b"]
    same = ["{'lr': 0.1}"]
    # One group over self.parameters(): indices in the model's order, whichever rank holds a parameter.
    one = _optimizer_map(0, [[["a.w", "a.b", "c.w", "c.b"]], [["b.w", "b.b"]]], [same, same], order, _Layout)
    assert one.groups == (tuple(order),) and one.by_rank == ((0, 1, 4, 5), (2, 3)) and one.local == (2, 3)
    # Two groups (matrices / the rest): each group in the model's order, the groups one after the other.
    two = _optimizer_map(
        0, [[["a.w", "c.w"], ["a.b", "c.b"]], [["b.w"], ["b.b"]]], [same * 2, same * 2], order, _Layout
    )
    assert two.groups == (("a.w", "b.w", "c.w"), ("a.b", "b.b", "c.b"))
    assert two.by_rank == ((0, 2, 3, 5), (1, 4)) and two.sizes == [3, 3]
    # A group listing its parameters against the model's order has no known unsplit numbering: refused.
    with pytest.raises(ValueError, match=r"param group 0 on pipeline rank 0 lists its parameters in another order"):
        _optimizer_map(0, [[["c.w", "a.w"]], [["b.w"]]], [same, same], order, _Layout)
    with pytest.raises(ValueError, match=r"has \[2, 1\] param groups on pipeline ranks \[0, 1\]"):
        _optimizer_map(0, [[["a.w"], ["a.b"]], [["b.w"]]], [same * 2, same], order, _Layout)
    with pytest.raises(ValueError, match="param group 0 has different settings on the pipeline ranks"):
        _optimizer_map(0, [[["a.w"]], [["b.w"]]], [same, ["{'lr': 0.2}"]], order, _Layout)


def test_full_optimizer_state_narrowed_to_a_rank():
    mapping = OptimizerMap(groups=(("a", "b", "c"), ("d",)), local=(1, 3), by_rank=((0, 2), (1, 3)))
    info = PipelineCheckpoint(_Layout, [["x"], ["y"]], ["a", "b"], {"b"}, [mapping])

    class Here:
        param_groups = [{"params": [0]}, {"params": [1]}]

    state = {"state": {0: "sa", 1: "sb", 2: "sc", 3: "sd"}, "param_groups": [{"params": [0, 1, 2]}, {"params": [3]}]}
    assert info.local_optimizer_state(0, state, Here, "x") == {
        "state": {0: "sb", 1: "sd"},
        "param_groups": [{"params": [0]}, {"params": [1]}],
    }
    with pytest.raises(CheckpointMismatchError, match=r"sizes \[2, 1\], but this run's has \[3, 1\] over all"):
        info.local_optimizer_state(0, {"state": {}, "param_groups": [{"params": [0, 1]}, {"params": [2]}]}, Here, "x")
    # Keys of other stages are dropped from a full model state; keys the unsplit model lacks stay (unexpected).
    assert info.local_model_state({"a": 1, "b": 2, "z": 3}) == {"b": 2, "z": 3}
