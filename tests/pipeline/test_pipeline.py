"""Pipeline parallelism composed with sharding (docs/pipeline.md).

The parity tests run tests/scripts/pipeline_run.py as users run their scripts: P=2 pipeline ranks x D=2 data ranks
on 4 gloo processes against the same LightningModule on one device, on the same global batches (the data rank d
takes samples d, d+2, ...). The reference does not pipeline at all: ``pipelined_loss`` is then the plain
``loss_fn(model(x), y)``. Every launch of the module (the parity runs, their references and the three that must fail
on every rank) is independent: a module fixture starts them all, a few at a time (tests/toolbox/launch.py's
``in_background``), and each test waits for the ones it checks. The other tests check the options and the cutting of
a model, without processes.
"""

from __future__ import annotations

import subprocess
import tempfile
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.options import PipelineOptions
from lightning_fsdp.pipeline import pipeline_pieces, plan_stages
from lightning_fsdp.pipeline.split import AbsentPiece, keep_only, meta_copy, stage_view
from tests.toolbox.launch import (
    argument_groups,
    in_background,
    join_configurations,
    run_configurations,
    run_script,
    run_together,
)

LAUNCH_S = 300  # per run of a launch, next to other launches; a guard against a hang, not a measurement


def run_pipelines(folder: Path, world: tuple[str, ...], args: list[str], only_rank: bool = False) -> list:
    """One launch of tests/scripts/pipeline_run.py running the configurations in ``args`` (``--and`` between them)
    on ``world``: for each, its ranks' results (each run writes OUT/rank<r>.pt), or with ``only_rank`` rank 0's."""
    configs = [[*world, *group] for group in argument_groups(args)]
    outs = run_configurations("pipeline_run.py", folder, join_configurations(configs), LAUNCH_S)
    results = []
    for out in outs:
        ranks = [torch.load(f, weights_only=False) for f in sorted(out.glob("rank*.pt"), key=lambda f: int(f.stem[4:]))]
        results.append(ranks[0] if only_rank else ranks)
    return results


CASES = [
    # (schedule, training flags): each schedule with SGD+momentum (a wrong gradient scale shows) and clipping by the
    # global norm (binding: the unclipped gradient norm is larger), accumulation and AdamW across the cases.
    ("GPipe", ("--optimizer", "sgd", "--accumulate", "2", "--clip", "0.3")),
    ("1F1B", ("--optimizer", "adamw", "--accumulate", "2", "--clip", "0.3")),
    ("1F1B", ("--optimizer", "sgd", "--clip", "0.3", "--micro", "4")),
    ("Interleaved1F1B", ("--optimizer", "sgd", "--accumulate", "2", "--clip", "0.3")),
]


@pytest.mark.parametrize("schedule,training", CASES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
@pytest.mark.parametrize("wrap", [False, True], ids=["root-unit", "block-units"])
def test_p2_d2_ends_where_one_device_ends(launched, schedule, training, wrap):
    if wrap and schedule == "GPipe":
        pytest.skip("units per block: covered by 1F1B and Interleaved1F1B")
    ref = launched["ref", training].result()
    ranks = launched["p2d2", schedule, training, wrap].result()
    assert len(ranks) == 4
    compared = 0
    covered: set[str] = set()
    for rank, got in enumerate(ranks):
        # The loss every rank's step returned and Lightning logged is the global batch's.
        assert len(got["losses"]) == len(ref["losses"]) == 4
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            torch.tensor(got["val_losses"]), torch.tensor(ref["val_losses"]), rtol=1e-5, atol=1e-6
        )
        for name in ("train_loss", "val_loss"):
            assert got["metrics"][name] == pytest.approx(ref["metrics"][name], rel=1e-5), (rank, name)
        # Each rank holds its stage's pieces under the unsplit model's names, with the reference's values.
        assert got["state"], rank
        for key, value in got["state"].items():
            torch.testing.assert_close(value, ref["state"][key], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}")
            compared += 1
            covered.add(key)
    assert covered == set(ref["state"]), set(ref["state"]) - covered  # every parameter was on some stage
    assert compared == 2 * len(ref["state"])  # each stage on its two data-parallel ranks


COMPOSED = [
    # (strategy flags, training flags, tolerance): the other options compose with pipelining.
    (("--sharding", "SHARD_GRAD_OP", "--wrap", "--checkpointing"), ("--optimizer", "sgd", "--clip", "0.3"), 1e-5),
    (("--sharding", "NO_SHARD"), ("--optimizer", "sgd"), 1e-5),
    # bf16 parameters and autocast against the one-device bf16-mixed run (autocast only there): bf16 rounding.
    (("--wrap",), ("--optimizer", "sgd", "--precision", "bf16-mixed"), 5e-3),
]


@pytest.mark.parametrize("strategy,training,tol", COMPOSED, ids=lambda v: "-".join(v) if isinstance(v, tuple) else "")
def test_sharding_strategies_checkpointing_and_bf16_compose(launched, strategy, training, tol):
    ref = launched["ref", training].result()
    ranks = launched["composed", strategy, training].result()
    compared = 0
    for got in ranks:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=tol, atol=tol)
        for key, value in got["state"].items():
            torch.testing.assert_close(value, ref["state"][key], rtol=tol, atol=tol, msg=key)
            compared += 1
    assert compared == 2 * len(ref["state"])


# ------------------------------------------------------------------------------------------- cutting a model
class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.big = nn.Linear(4, 40)
        self.head = nn.Linear(40, 5)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.big(h))


def test_pieces_expand_containers_in_forward_order():
    assert pipeline_pieces(Chain()) == ["emb", "blocks.0", "blocks.1", "blocks.2", "big", "head"]


def test_explicit_and_balanced_cuts():
    model = Chain()
    assert plan_stages(model, 2, ["blocks.2"]) == [["emb", "blocks.0", "blocks.1"], ["blocks.2", "big", "head"]]
    # Parameters: emb 20, blocks 20 each, big 200, head 205: the balanced cut isolates the two large pieces.
    sizes = {n: sum(p.numel() for p in model.get_submodule(n).parameters()) for n in pipeline_pieces(model)}
    assert sizes == {"emb": 20, "blocks.0": 20, "blocks.1": 20, "blocks.2": 20, "big": 200, "head": 205}
    assert plan_stages(model, 3, None) == [["emb", "blocks.0", "blocks.1", "blocks.2"], ["big"], ["head"]]
    assert plan_stages(model, 2, None) == [["emb", "blocks.0", "blocks.1", "blocks.2", "big"], ["head"]]


def test_views_share_pieces_and_keep_names():
    model = Chain()
    stages = plan_stages(model, 2, ["blocks.2"])
    view = stage_view(model, stages[1])
    assert view.head is model.head and isinstance(view.emb, AbsentPiece) and not isinstance(model.emb, AbsentPiece)
    meta = meta_copy(model)
    assert all(p.is_meta for p in meta.parameters()) and not any(p.is_meta for p in model.parameters())
    keep_only(model, stages[1])
    assert [n for n, _ in model.named_parameters()] == [
        "blocks.2.weight",
        "blocks.2.bias",
        "big.weight",
        "big.bias",
        "head.weight",
        "head.bias",
    ]
    x = torch.randn(3, 4)
    torch.testing.assert_close(stage_view(model, stages[1])(x), model.head(model.big(model.blocks[2](x))))


# -------------------------------------------------------------------------------------- the chain contract
class _Pieces(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.pos = nn.Embedding(3, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 5)


class TwoEmbeddings(_Pieces):  # GPT-2's wte(idx) + wpe(pos)
    def forward(self, x):
        h = self.emb(x) + self.pos(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class SkipAcross(_Pieces):
    def forward(self, x):
        h0 = h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h + h0)


class ScaledBeforeHead(_Pieces):
    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h * 2)


def _run_stages(model: nn.Module, split: list[str]) -> int:
    """Every stage view of ``model``'s meta copy under the chain check, as the runtime runs them; the stages run."""
    from lightning_fsdp.pipeline.contract import chain_checked

    stages = plan_stages(model, len(split) + 1, split)
    pieces = [p for stage in stages for p in stage]
    meta = meta_copy(model)
    x = (torch.zeros(2, 3, dtype=torch.long, device="meta"),)
    for index, stage in enumerate(stages):
        view = stage_view(meta, stage)
        with torch.no_grad(), chain_checked(view, pieces, index, x):
            out = view(*x)
        x = (out,)
    return len(stages)


def test_chain_models_pass_the_check():
    from tests.scripts.pipeline_run import chain_lm

    assert _run_stages(chain_lm(), ["blocks.2"]) == 2
    assert _run_stages(chain_lm(), ["blocks.1", "blocks.2", "blocks.3"]) == 4


@pytest.mark.parametrize(
    "model,split,message",
    [
        (TwoEmbeddings, ["blocks.0"], r"stage 1: piece 'pos' \(on another stage\) is given something other"),
        (TwoEmbeddings, ["blocks.1"], r"stage 1: piece 'pos'"),
        (SkipAcross, ["blocks.1"], r"stage 0: after the stage's last piece the forward's own code computes add"),
        (ScaledBeforeHead, ["head"], r"stage 1: the forward's own code computes mul with the values the earlier"),
        (ScaledBeforeHead, ["blocks.1"], r"stage 0: after the stage's last piece .* computes mul"),
    ],
    ids=["wte+wpe-a", "wte+wpe-b", "skip", "scale-head", "scale-blocks"],
)
def test_forwards_that_are_not_chains_are_refused(model, split, message):
    # Each of these would compute a different model once cut, without any error: refused instead.
    from lightning_fsdp.pipeline.contract import BrokenChainError

    with pytest.raises(BrokenChainError, match=message):
        _run_stages(model(), split)


# -------------------------------------------------------------------------------------------------- bad input
def test_cut_point_that_names_no_module():
    with pytest.raises(ValueError, match=r"\['blocks\.7'\].*not pieces of Chain.*'blocks\.0'"):
        plan_stages(Chain(), 2, ["blocks.7"])


def test_cut_points_out_of_order_or_at_the_start():
    with pytest.raises(ValueError, match="forward order"):
        plan_stages(Chain(), 3, ["big", "blocks.1"])
    with pytest.raises(ValueError, match="without the first piece 'emb'"):
        plan_stages(Chain(), 2, ["emb"])


def test_more_stages_than_pieces():
    with pytest.raises(ValueError, match="6 pieces .* but 8 pipeline stages"):
        plan_stages(Chain(), 8, None)


def test_tied_weights_across_stages():
    model = Chain()
    model.head.weight = nn.Parameter(model.big.weight.t().contiguous())  # untied: fine
    plan_stages(model, 2, ["head"])
    model.blocks[2].weight = model.blocks[0].weight
    with pytest.raises(ValueError, match=r"'blocks\.0\.weight' \(stage 0\) and 'blocks\.2\.weight' \(stage 1\)"):
        plan_stages(model, 2, ["blocks.2"])


def test_parameter_outside_any_piece():
    model = Chain()
    model.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"\['scale'\] sit on the model itself"):
        pipeline_pieces(model)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"pipeline_parallel_size": 0}, r"pipeline_parallel_size=0 must be a positive int"),
        ({"pipeline_parallel_size": 2, "pipeline_schedule": "ZBV"}, r"pipeline_schedule='ZBV'.*'1F1B', 'GPipe'"),
        ({"pipeline_parallel_size": 4, "pipeline_microbatches": 2}, r"pipeline_microbatches=2 .*'1F1B' and 4 stages"),
        (
            {"pipeline_parallel_size": 2, "pipeline_schedule": "Interleaved1F1B", "pipeline_microbatches": 5},
            r"multiple of the number of rounds \(2",
        ),
        (
            {"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B", "pipeline_stages_per_rank": 2},
            "one stage per pipeline rank",
        ),
        ({"pipeline_parallel_size": 2, "pipeline_split": ["a", "b"]}, r"names 2 cut points; 2 stages .* need 1"),
        ({"pipeline_parallel_size": 2, "sharding_strategy": "HYBRID_SHARD"}, "hybrid sharding inside a stage"),
        ({"pipeline_parallel_size": 2, "state_dict_type": "local"}, "state_dict_type='local' with pipeline_paral"),
    ],
)
def test_bad_options_raise_when_the_strategy_is_built(kwargs, message):
    # Raised in FSDPStrategy.__init__, on every rank alike, before any process group exists.
    with pytest.raises(ValueError, match=message):
        FSDPStrategy(**kwargs)


def test_pipeline_size_must_divide_the_world():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 does not divide the 3 processes.*\[1, 3\]"):
        PipelineOptions.parse(2).check_world(3)


def test_world_not_divisible_fails_on_every_rank_before_any_collective(launched):
    # 3 processes, P=2: each rank raises in setup, before the strategy creates a group; none is left waiting.
    proc = launched["fails", "world"].result()
    assert proc.returncode != 0
    assert "pipeline_parallel_size=2 does not divide the 3 processes" in proc.stderr


def test_calling_the_split_model_directly_is_refused(launched):
    # A training_step that calls self.model(x) would compute only this rank's stages: every rank must refuse it.
    proc = launched["fails", "direct"].result()
    assert proc.returncode != 0
    assert "ChainLM is cut into pipeline stages" in proc.stderr, proc.stderr[-3000:]


def test_cut_point_naming_no_module_fails_on_every_rank_before_any_group(launched):
    # Each of the 4 ranks raises in setup, before the strategy creates the (pipeline, data) groups: none waits.
    proc = launched["fails", "split"].result()
    assert proc.returncode != 0
    assert proc.stderr.count("pipeline_split names ['blocks.9'], which are not pieces of ChainLM") >= 4, proc.stderr[
        -3000:
    ]


# ------------------------------------------------------------------------------------------- the launches
FAILING = {
    # (the launch's flags); each must fail on every rank
    "world": ("--devices", "3", "--pp", "2"),
    "direct": ("--devices", "4", "--pp", "2", "--direct"),
    "split": ("--devices", "4", "--pp", "2", "--split", "blocks.9"),
}


def _failing_run(folder: Path, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    # A rank left waiting would show as the timeout.
    return run_script("pipeline_run.py", "--out", folder / "x", *args, cwd=folder, timeout=240, check=False)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """Every run of the module: ``{key: its result, when waited for}``. The runs that succeed share launches
    (tests/toolbox/launch.py's ``run_together``): the 4-process ones two launches, the one-device references one;
    the runs that must fail each have their own."""
    folder = tmp_path_factory.mktemp("pp")
    p2d2: dict = {}
    for schedule, training in CASES:
        for wrap in (False, True):
            if wrap and schedule == "GPipe":
                continue  # skipped by the test
            p2d2["p2d2", schedule, training, wrap] = ("--schedule", schedule, *training, *(["--wrap"] if wrap else []))
    for strategy, training, _ in COMPOSED:
        p2d2["composed", strategy, training] = (*strategy, *training)
    refs = {("ref", t): t for t in dict.fromkeys([*(t for _, t in CASES), *(t for _, t, _ in COMPOSED)])}
    pipelined = partial(run_pipelines, folder, ("--devices", "4", "--pp", "2"))
    one_device = partial(run_pipelines, folder, ("--devices", "1", "--pp", "1"), only_rank=True)
    fails = {
        ("fails", name): partial(_failing_run, Path(tempfile.mkdtemp(dir=folder)), args)
        for name, args in FAILING.items()
    }
    return {**run_together(pipelined, p2d2, launches=2), **run_together(one_device, refs), **in_background(fails)}
