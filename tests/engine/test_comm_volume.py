"""The engine's own byte counters against bytes computed here from the model's parameter shapes.

Per step, FULL_SHARD gathers every unit twice (forward, backward) except the root, which stays gathered from its
forward to its backward, and, once the first step has recorded the order, the last unit of the forward, whose backward
comes next; it reduce-scatters the gradients once; SHARD_GRAD_OP gathers once; NO_SHARD only
all-reduces. Together that is the 3x (2x) of the parameter bytes, within padding.

The expected values are derived in this file, not read from the engine (its units, slots or layouts):

- units: with ``auto_wrap_policy={Block}`` ``block1`` and ``block2`` are units owning their own parameters; the root
  owns everything else (the embedding and the head tied to it count once, the frozen layer is included);
- chunking rule: a parameter of shape ``(d0, ...)`` is split on dim 0 over the N ranks with ``c = ceil(d0 / N)``
  rows per rank; rank ``r`` keeps rows ``[min(r*c, d0), min((r+1)*c, d0))``, and in a flat collective every rank
  contributes ``c`` rows (``c * prod(shape[1:])`` elements, missing rows zero-padded);
- an all-gather's input is this rank's padded chunks of every parameter of the unit (frozen ones too); a
  reduce-scatter's input is N such chunks of every trainable parameter plus one used-flag per trainable parameter
  in each chunk (the flags tell the engine which parameters no rank used); NO_SHARD all-reduces the whole
  trainable gradients plus the flags.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fsdp.engine import fully_shard
from tests.toolbox.distributed import run_distributed
from tests.toolbox.models import Block, ToyLM, batch, loss_fn

WORLD = 2
FLOAT_BYTES = 4
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
STEPS = 2


def volumes(rank, world_size):
    results = {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = ToyLM(dim=16)
        engine = fully_shard(model, sharding_strategy=strategy, auto_wrap_policy={Block})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        shard_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        per_step, grad_shapes = [], {}
        for step in range(STEPS):
            engine.shard_comm.stats.reset()
            x, y = batch(step, size=4)
            loss_fn(model(x[rank::2]), y[rank::2]).backward()
            grad_shapes = {name: tuple(p.grad.shape) for name, p in model.named_parameters() if p.grad is not None}
            optimizer.step()
            optimizer.zero_grad()
            stats = engine.shard_comm.stats
            per_step.append(
                (stats.all_gather_bytes, stats.reduce_scatter_bytes, stats.all_reduce_bytes, stats.peak_gathered_units)
            )
        results[strategy] = (per_step, shard_shapes, grad_shapes)
    return results


@pytest.fixture(scope="module")
def measured():
    return run_distributed(volumes, WORLD)


# ------------------------------------------------------------------------------ expected values, from shapes
def _rows(shape: tuple) -> tuple[int, int]:
    """(rows, elements per row); a 0-dim parameter is one row of one element."""
    return (shape[0] if shape else 1), (math.prod(shape[1:]) if len(shape) > 1 else 1)


def chunk_numel(shape: tuple, n: int) -> int:
    """Elements each rank contributes for this parameter to a flat collective: c = ceil(d0 / n) rows."""
    rows, row_numel = _rows(shape)
    return -(-rows // n) * row_numel


def local_shape(shape: tuple, n: int, rank: int) -> tuple:
    rows, _ = _rows(shape)
    c = -(-rows // n)
    start = min(rank * c, rows)
    return (min(start + c, rows) - start, *shape[1:])


def unit_params() -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """The parameters each unit owns, by the rule in the module docstring (named_parameters lists a tie once)."""
    model = ToyLM(dim=16)
    units: dict[str, list] = {"<root>": [], "block1": [], "block2": []}
    for name, param in model.named_parameters():
        units[name.split(".")[0] if name.startswith("block") else "<root>"].append((name, param))
    return units


def expected_bytes(n: int) -> dict[str, dict[str, int]]:
    """Per unit: this rank's all-gather input, reduce-scatter input and (n = 1 layout) all-reduce bytes."""
    out = {}
    for unit, params in unit_params().items():
        trainable = [p for _, p in params if p.requires_grad]
        out[unit] = {
            "gather": FLOAT_BYTES * sum(chunk_numel(tuple(p.shape), n) for _, p in params),
            "reduce_scatter": FLOAT_BYTES
            * n
            * (sum(chunk_numel(tuple(p.shape), n) for p in trainable) + len(trainable)),
            "all_reduce": FLOAT_BYTES * (sum(p.numel() for p in trainable) + len(trainable)),
        }
    return out


def test_expected_values_by_hand():
    # The formulas above, checked against arithmetic done by hand for ToyLM(dim=16) over 2 ranks:
    # root:   emb 7x16 -> 4 rows (64), tiny 1x16 -> 1 row (16), frozen 16x16 -> 8 rows (128), frozen bias 16 -> 8,
    #         norm weight 16 -> 8, norm bias 16 -> 8: 232 elements; trainable 64+16+8+8 = 96, 4 parameters.
    # block1: fc1 6x16 -> 3 rows (48), bias 6 -> 3, fc2 16x6 -> 8 rows (48), bias 16 -> 8: 107 elements, 4 trainable.
    # block2: fc1 3x16 -> 2 rows (32), bias 3 -> 2, fc2 16x3 -> 8 rows (24), bias 16 -> 8: 66 elements, 4 trainable.
    units = unit_params()
    assert [len(units[u]) for u in ("<root>", "block1", "block2")] == [6, 4, 4]  # 14 parameters, the tie once
    two = expected_bytes(2)
    assert {u: v["gather"] for u, v in two.items()} == {"<root>": 4 * 232, "block1": 4 * 107, "block2": 4 * 66}
    # Reduce-scatter input: 2 chunks of (trainable padded elements + 4 flags).
    assert {u: v["reduce_scatter"] for u, v in two.items()} == {
        "<root>": 4 * 2 * (96 + 4),
        "block1": 4 * 2 * (107 + 4),
        "block2": 4 * 2 * (66 + 4),
    }
    # NO_SHARD: whole trainable gradients (root 112+16+16+16, block1 96+6+96+16, block2 48+3+48+16) plus 4 flags each.
    assert {u: v["all_reduce"] for u, v in two.items()} == {
        "<root>": 4 * (160 + 4),
        "block1": 4 * (214 + 4),
        "block2": 4 * (115 + 4),
    }


def _total(expected: dict, key: str, units=("<root>", "block1", "block2")) -> int:
    return sum(expected[u][key] for u in units)


def _model_bytes():
    params = list(ToyLM(dim=16).parameters())
    return (
        sum(p.numel() * 4 for p in params),
        sum(p.numel() * 4 for p in params if p.requires_grad),
        sum(p[0].numel() * 4 for p in params),
    )


def test_full_shard_gathers_twice_and_reduces_once(measured):
    expected = expected_bytes(WORLD)
    # Every unit in forward, again in backward except the root (kept gathered from its forward to its backward); from
    # the second step on also except block2, the last unit of the forward (kept gathered into its backward).
    first = _total(expected, "gather") + _total(expected, "gather", ("block1", "block2"))
    later = _total(expected, "gather") + _total(expected, "gather", ("block1",))
    scatter = _total(expected, "reduce_scatter")
    assert (first, later, scatter) == (4 * 578, 4 * 512, 4 * 2 * 281)  # 232 + 2 x (107 + 66); 232 + 2 x 107 + 66
    full, trainable, row_bytes = _model_bytes()
    root = expected["<root>"]["gather"]
    compared = 0
    for per_step, _, _ in (r["FULL_SHARD"] for r in measured):
        for step, (gathered, scattered, reduced, peak) in enumerate(per_step):
            assert (gathered, scattered, reduced) == (first if step == 0 else later, scatter, 0), step
            # One block at a time while the first step records the order; from then on the default backward
            # prefetch keeps the next block in flight beside the one computing.
            assert peak == (1 if step == 0 else 2)
            # Across both ranks the gathers deliver 2x the parameters (less the root's once, and the last unit's
            # once after the first step), and the reduction takes one full gradient: the 3x of the parameter bytes,
            # within padding.
            kept = root if step == 0 else root + expected["block2"]["gather"]
            assert abs(2 * gathered - (2 * full - 2 * kept)) <= 4 * row_bytes
            assert abs(scattered - trainable) <= 2 * row_bytes
            compared += 1
    assert compared == WORLD * STEPS


def test_shard_grad_op_gathers_once(measured):
    expected = expected_bytes(WORLD)
    gather, scatter = _total(expected, "gather"), _total(expected, "reduce_scatter")
    assert gather == 4 * 405  # 232 + 107 + 66
    full, trainable, row_bytes = _model_bytes()
    compared = 0
    for per_step, _, _ in (r["SHARD_GRAD_OP"] for r in measured):
        for gathered, scattered, reduced, peak in per_step:
            assert (gathered, scattered, reduced) == (gather, scatter, 0)
            assert abs(2 * gathered - full) <= 2 * row_bytes  # 1x the parameters, counted over both ranks
            assert peak == 2  # both blocks stay gathered from their forward to their backward
            compared += 1
    assert compared == WORLD * STEPS


def test_no_shard_only_all_reduces(measured):
    expected = expected_bytes(WORLD)
    reduce = _total(expected, "all_reduce")
    _, trainable, _ = _model_bytes()
    assert reduce == trainable + 4 * 12 == 4 * 501  # the gradients plus one flag per trainable parameter
    compared = 0
    for per_step, _, _ in (r["NO_SHARD"] for r in measured):
        for gathered, scattered, reduced, _ in per_step:
            assert (gathered, scattered, reduced) == (0, 0, reduce)
            compared += 1
    assert compared == WORLD * STEPS


def test_each_rank_holds_its_rows_of_every_parameter(measured):
    reference = dict(ToyLM(dim=16).named_parameters())
    compared = 0
    for rank, result in enumerate(measured):
        for strategy in STRATEGIES:
            _, shard_shapes, grad_shapes = result[strategy]
            assert sorted(shard_shapes) == sorted(reference)
            for name, param in reference.items():
                shape = tuple(param.shape)
                want = shape if strategy == "NO_SHARD" else local_shape(shape, WORLD, rank)
                assert shard_shapes[name] == want, (strategy, rank, name)
                if param.requires_grad:
                    assert grad_shapes[name] == want, (strategy, rank, name)
                else:
                    assert name not in grad_shapes
                compared += 1
    assert compared == WORLD * len(STRATEGIES) * len(reference) == 2 * 3 * 14
    # Rank 1's tiny (1 row over 2 ranks) holds no row at all, and the 7-row embedding splits 4 + 3.
    assert measured[1]["FULL_SHARD"][1]["tiny"] == (0, 16)
    assert [measured[r]["FULL_SHARD"][1]["emb.weight"] for r in (0, 1)] == [(4, 16), (3, 16)]
