"""Property-based parity: random module trees and option sets, sharded on 2 gloo processes, train exactly like the
unsharded single-process reference (losses and parameters every step, BatchNorm buffers per rank, a checkpoint round
trip in the middle). See tests/property_cases.py for what is generated and how the reference is built, and
tests/property_pool.py for the persistent worker pool the examples run on.

Profiles (``LIGHTNING_FSDP_HYPOTHESIS_PROFILE``):

* ``default``: a bounded, deterministic run for CI (derandomized, no example database): the explicit examples below
  and 50 generated ones, about 30-50 s on two shared cores.
* ``thorough``: 400 randomly drawn examples (a new draw each run; hypothesis prints the seed/blob of a
  failure to reproduce it), e.g. ``LIGHTNING_FSDP_HYPOTHESIS_PROFILE=thorough pytest tests/test_property.py``.

``LIGHTNING_FSDP_HYPOTHESIS_EXAMPLES=N`` overrides the number of examples of either profile.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings

from tests.property_cases import CASES, STEPS, describe
from tests.property_pool import WorkerPool

# No "explain" phase: it re-runs many variants of a failing case, each a full distributed run.
_COMMON = dict(deadline=None, database=None, print_blob=True,
               phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("default", max_examples=50, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=400, derandomize=False, **_COMMON)
_PROFILE = os.environ.get("LIGHTNING_FSDP_HYPOTHESIS_PROFILE", "default")
_EXAMPLES = os.environ.get("LIGHTNING_FSDP_HYPOTHESIS_EXAMPLES")
_SETTINGS = settings(settings.get_profile(_PROFILE),
                     **({"max_examples": int(_EXAMPLES)} if _EXAMPLES else {}))


def _linear(tie=None, bias=True, frozen="none"):
    return {"kind": "linear", "bias": bias, "tie": tie, "frozen": frozen}


# Every feature at once: nesting of every container, every leaf kind, a 1x1 Linear, a 1-row embedding tied to a head,
# a tied (D, D) weight, frozen parameters, a branch unused on some steps, BatchNorm running statistics.
EVERYTHING = {
    "seed": 7,
    "dim": 3,
    "tree": {"kind": "seq", "children": [
        {"kind": "embedding", "vocab": 1, "frozen": "none"},
        {"kind": "block", "scalar_skip": True, "children": [
            _linear(),
            {"kind": "list", "children": [
                {"kind": "scalar", "frozen": "none"},
                {"kind": "conv1d", "channels": 3, "kernel": 3, "bias": True, "frozen": "bias"},
                {"kind": "batchnorm", "affine": True, "momentum": 0.1, "frozen": "none"},
            ]},
        ]},
        {"kind": "branch", "period": 2, "phase": 1, "children": [
            _linear(tie=0, bias=False),
            {"kind": "tiedpair", "bias": True, "frozen": "bias"},
            {"kind": "bottleneck", "hidden": 1, "bias": True, "frozen": "none"},
        ]},
        {"kind": "conv2d", "channels": 2, "kernel": [3, 3], "bias": True, "frozen": "none"},
        {"kind": "layernorm", "affine": True, "bias": True, "frozen": "none"},
        {"kind": "head", "tie": 0, "frozen": "none"},
        _linear(frozen="all"),
        {"kind": "batchnorm", "affine": False, "momentum": None, "frozen": "none"},
    ]},
}


def _everything(strategy, wrap, accumulate, clip, optimizer, checkpoint):
    return {**EVERYTHING, "options": {"strategy": strategy, "wrap": wrap, "accumulate": accumulate, "clip": clip,
                                      "optimizer": optimizer, "checkpoint": checkpoint}}


def _options(strategy="FULL_SHARD", wrap=None, accumulate=1, clip=None, optimizer="sgd", checkpoint=None):
    return {"strategy": strategy, "wrap": wrap or {"kind": "none"}, "accumulate": accumulate, "clip": clip,
            "optimizer": optimizer, "checkpoint": checkpoint}


# Minimal cases of bugs these tests found (kept as explicit examples so that they fail first, fast and small):
# - an int auto_wrap_policy makes an nn.ModuleList (no forward, so its hooks never run) a unit: the parameters it owns
#   are used as local shards, i.e. un-averaged gradients under NO_SHARD, a shape error on the rank with 0 rows
#   otherwise (torch's size-based policy never wraps ModuleList/ModuleDict).
MODULELIST_UNIT = {"seed": 1, "dim": 3, "options": _options("NO_SHARD", {"kind": "min", "n": 4}), "tree": {
    "kind": "seq", "children": [{"kind": "list", "children": [{"kind": "scalar", "frozen": "none"}] * 3},
                                _linear()]}}
# - a full optimizer checkpoint of a 0-dim parameter's AdamW state (exp_avg saved 0-dim) loads unsliced into the
#   optimizer over its shard (shape (1,) or (0,)): the next step raises a shape error.
SCALAR_PARAM_FULL_CHECKPOINT = {"seed": 2, "dim": 3, "options": _options(
    optimizer="adamw", checkpoint={"mode": "full", "after_step": 0}), "tree": {
    "kind": "seq", "children": [{"kind": "block", "scalar_skip": True, "children": [_linear()]}, _linear()]}}
# - a unit called twice in one forward whose first call's input needs no gradient: only the second call is awaited,
#   the unit is reduced after it, and the first call's gradients arrive late ("arrived after their unit had been
#   reduced"), though one process trains this model fine.
UNIT_CALLED_TWICE = {"seed": 3, "dim": 3, "options": _options(wrap={"kind": "classes", "classes": ["ResLinear"]}),
                     "tree": {"kind": "seq", "children": [{"kind": "repeat", "children": [_linear()]}, _linear()]}}


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(world_size=2)
    yield workers
    workers.close()


@_SETTINGS
@given(case=CASES)
@example(case=UNIT_CALLED_TWICE)
@example(case=MODULELIST_UNIT)
@example(case=SCALAR_PARAM_FULL_CHECKPOINT)
@example(case=_everything("FULL_SHARD", {"kind": "classes", "classes": ["Block", "Branch", "Linear"]}, 2, 0.1, "sgd",
                          {"mode": "sharded", "after_step": 1}))
@example(case=_everything("SHARD_GRAD_OP", {"kind": "callable", "classes": ["ListBlock", "Conv2dLeaf"], "n": 10}, 1,
                          None, "adamw", {"mode": "local", "after_step": 0}))
@example(case=_everything("NO_SHARD", {"kind": "min", "n": 10}, 2, 1.0, "sgd", {"mode": "full", "after_step": 2}))
@example(case=_everything("FULL_SHARD", {"kind": "none"}, 1, 0.01, "adamw", {"mode": "full", "after_step": 1}))
def test_sharded_training_matches_unsharded_reference(pool, case):
    results = pool.run(case)
    chaotic = results[0]["info"]["chaotic_from"]  # the same on every rank: each computes the whole reference
    event(f"steps compared with the reference: {STEPS if chaotic is None else chaotic} of {STEPS}")
    problems = [f"rank {rank}: {message}" for rank, result in enumerate(results) for message in result["errors"]]
    assert not problems, (
        f"sharded training differs from the unsharded reference (units: {results[0]['info']['units']})\n"
        + describe(case) + "\n" + "\n".join(problems)
    )
