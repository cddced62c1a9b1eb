"""Property-based parity: random module trees, option sets and training schedules, sharded on 2 gloo processes,
train exactly like the unsharded single-process reference (losses, parameters and eval outputs every step, BatchNorm
buffers per rank, a checkpoint round trip in the middle). See tests/engine/property_cases.py for what is generated, how
the
reference is built and the tolerance rule, and tests/engine/property_pool.py for the persistent worker pool the examples
run on.

Every example must compare values, never quietly skip them: the step-0 loss at the base tolerance, and at least
MIN_COMPARED (90%) of every step's values (each at the base tolerance or at one widened by its tensor's measured
drift; a tensor whose drift makes any tolerance meaningless counts as chaotic, not compared). The counts are
reported as hypothesis events (``--hypothesis-show-statistics``) and as a summary at the end of the module
(``LIGHTNING_FSDP_PROPERTY_REPORT=path.json`` also writes every example's counts).

Profiles (``LIGHTNING_FSDP_HYPOTHESIS_PROFILE``):

* ``default``: a bounded, deterministic run for CI (derandomized, no example database): the explicit examples below
  and 50 generated ones, about 30-50 s on two shared cores.
* ``thorough``: 400 randomly drawn examples (a new draw each run; hypothesis prints the seed/blob of a
  failure to reproduce it), e.g. ``LIGHTNING_FSDP_HYPOTHESIS_PROFILE=thorough pytest tests/engine/test_property.py``.

``LIGHTNING_FSDP_HYPOTHESIS_EXAMPLES=N`` overrides the number of examples of either profile.
``LIGHTNING_FSDP_PROPERTY_FEATURES=flips,fault,forwards,evals,prefetch`` (any subset, or ``none``) chooses the
optional schedule features the generator draws (default: all); the explicit examples always run.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, currently_in_test_context, event, given, settings

from tests.engine.property_cases import (
    CASES,
    CHAOS_RTOL,
    DRIFT_K,
    FEATURES,
    MIN_COMPARED,
    STEPS,
    describe,
    features_of,
)
from tests.engine.property_pool import WorkerPool

# No "explain" phase: it re-runs many variants of a failing case, each a full distributed run.
_COMMON = dict(
    deadline=None,
    database=None,
    print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("default", max_examples=50, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=400, derandomize=False, **_COMMON)
_PROFILE = os.environ.get("LIGHTNING_FSDP_HYPOTHESIS_PROFILE", "default")
_EXAMPLES = os.environ.get("LIGHTNING_FSDP_HYPOTHESIS_EXAMPLES")
_SETTINGS = settings(settings.get_profile(_PROFILE), **({"max_examples": int(_EXAMPLES)} if _EXAMPLES else {}))


def _linear(tie=None, bias=True, frozen="none"):
    return {"kind": "linear", "bias": bias, "tie": tie, "frozen": frozen}


# Every feature at once: nesting of every container, every leaf kind, a 1x1 Linear, a 1-row embedding tied to a head,
# a tied (D, D) weight, frozen parameters, a branch unused on some steps, BatchNorm running statistics.
EVERYTHING = {
    "seed": 7,
    "dim": 3,
    "tree": {
        "kind": "seq",
        "children": [
            {"kind": "embedding", "vocab": 1, "frozen": "none"},
            {
                "kind": "block",
                "scalar_skip": True,
                "children": [
                    _linear(),
                    {
                        "kind": "list",
                        "children": [
                            {"kind": "scalar", "frozen": "none"},
                            {"kind": "conv1d", "channels": 3, "kernel": 3, "bias": True, "frozen": "bias"},
                            {"kind": "batchnorm", "affine": True, "momentum": 0.1, "frozen": "none"},
                        ],
                    },
                ],
            },
            {
                "kind": "branch",
                "period": 2,
                "phase": 1,
                "children": [
                    _linear(tie=0, bias=False),
                    {"kind": "tiedpair", "bias": True, "frozen": "bias"},
                    {"kind": "bottleneck", "hidden": 1, "bias": True, "frozen": "none"},
                ],
            },
            {"kind": "conv2d", "channels": 2, "kernel": [3, 3], "bias": True, "frozen": "none"},
            {"kind": "layernorm", "affine": True, "bias": True, "frozen": "none"},
            {"kind": "head", "tie": 0, "frozen": "none"},
            _linear(frozen="all"),
            {"kind": "batchnorm", "affine": False, "momentum": None, "frozen": "none"},
        ],
    },
}


def _everything(strategy, wrap, accumulate, clip, optimizer, checkpoint, prefetch=None, schedule=None, tree=None):
    case = {
        **EVERYTHING,
        "options": {
            "strategy": strategy,
            "wrap": wrap,
            "accumulate": accumulate,
            "clip": clip,
            "optimizer": optimizer,
            "checkpoint": checkpoint,
        },
    }
    if prefetch is not None:
        case["options"]["prefetch"] = prefetch
    if schedule is not None:
        case["schedule"] = schedule
    if tree is not None:
        case["tree"] = tree
    return case


def _options(
    strategy="FULL_SHARD", wrap=None, accumulate=1, clip=None, optimizer="sgd", checkpoint=None, prefetch=None
):
    return {
        "strategy": strategy,
        "wrap": wrap or {"kind": "none"},
        "accumulate": accumulate,
        "clip": clip,
        "optimizer": optimizer,
        "checkpoint": checkpoint,
        "prefetch": prefetch,
    }


def _classes(*names):
    return {"kind": "classes", "classes": list(names)}


def _eval(step, where="after_step", grad=False, train=False, reverse=False, index=0):
    return {"step": step, "where": where, "grad": grad, "train": train, "reverse": reverse, "index": index}


_BN = {"kind": "batchnorm", "affine": True, "momentum": 0.1, "frozen": "none"}
_RAISER = {"kind": "raiser", "frozen": "none"}
# Three wrapped ResLinear units and a BatchNorm in a block: the small tree most schedule examples below share.
_UNITS_TREE = {
    "kind": "seq",
    "children": [
        _linear(),
        {"kind": "block", "scalar_skip": False, "children": [_linear(), _BN]},
        _linear(),
        {"kind": "list", "children": [_linear(), _linear(bias=False)]},
    ],
}

EXPLICIT: dict[str, dict[str, Any]] = {
    # Minimal cases of bugs these tests found (kept so that they fail first, fast and small):
    # - a unit called twice in one forward whose first call's input needs no gradient: only the second call is
    #   awaited, the unit is reduced after it, and the first call's gradients arrive late ("arrived after their unit
    #   had been reduced"), though one process trains this model fine.
    "unit_called_twice": {
        "seed": 3,
        "dim": 3,
        "options": _options(wrap=_classes("ResLinear")),
        "tree": {"kind": "seq", "children": [{"kind": "repeat", "children": [_linear()]}, _linear()]},
    },
    # - an int auto_wrap_policy makes an nn.ModuleList (no forward, so its hooks never run) a unit: the parameters it
    #   owns are used as local shards, i.e. un-averaged gradients under NO_SHARD, a shape error on the rank with 0
    #   rows otherwise (torch's size-based policy never wraps ModuleList/ModuleDict).
    "modulelist_unit": {
        "seed": 1,
        "dim": 3,
        "options": _options("NO_SHARD", {"kind": "min", "n": 4}),
        "tree": {
            "kind": "seq",
            "children": [{"kind": "list", "children": [{"kind": "scalar", "frozen": "none"}] * 3}, _linear()],
        },
    },
    # - a full optimizer checkpoint of a 0-dim parameter's AdamW state (exp_avg saved 0-dim) loads unsliced into the
    #   optimizer over its shard (shape (1,) or (0,)): the next step raises a shape error.
    "scalar_param_full_checkpoint": {
        "seed": 2,
        "dim": 3,
        "options": _options(optimizer="adamw", checkpoint={"mode": "full", "after_step": 0}),
        "tree": {
            "kind": "seq",
            "children": [{"kind": "block", "scalar_skip": True, "children": [_linear()]}, _linear()],
        },
    },
    # - a forward with grad enabled whose output is dropped (no backward) leaves the step open until the next root
    #   forward: a requires_grad flip right after it was not honoured in the next step (the parameter frozen before
    #   step 2 was still updated in step 2; the one unfrozen before step 2 got a wrong update), and a sharded or local
    #   checkpoint saved right after it could not be loaded ("'<unnamed parameter 0>' in the checkpoint", "split into
    #   rows None across ranks in the checkpoint").
    "freeze_after_dropped_forward": {
        "seed": 938,
        "dim": 1,
        "options": _options(),
        "tree": {"kind": "seq", "children": [_linear(bias=False), _linear(bias=False)]},
        "schedule": {
            "flips": [{"before_step": 2, "every": 3, "offset": 0}],
            "evals": [_eval(1, grad=True, train=True)],
        },
    },
    "unfreeze_after_dropped_forward": {
        "seed": 938,
        "dim": 1,
        "options": _options(),
        "tree": {"kind": "seq", "children": [_linear(bias=False, frozen="all"), _linear(bias=False)]},
        "schedule": {
            "flips": [{"before_step": 2, "every": 3, "offset": 0}],
            "evals": [_eval(1, grad=True, train=True)],
        },
    },
    "sharded_checkpoint_after_dropped_forward": {
        "seed": 5,
        "dim": 3,
        "options": _options(wrap=_classes("ResLinear"), checkpoint={"mode": "sharded", "after_step": 0}),
        "tree": {"kind": "seq", "children": [_linear(), _linear()]},
        "schedule": {"evals": [_eval(0, grad=True, train=True)]},
    },
    "local_checkpoint_after_dropped_forward": {
        "seed": 5,
        "dim": 3,
        "options": _options("NO_SHARD", checkpoint={"mode": "local", "after_step": 0}),
        "tree": {"kind": "seq", "children": [_linear(), _linear()]},
        "schedule": {"evals": [_eval(0, grad=True, train=True)]},
    },
    # Every tree feature at once, four option sets. Before drift-scaled tolerances two of these compared nothing: a
    # BatchNorm running mean drifting by 2e-7 under a 1-ulp nudge stopped the whole comparison at step 0.
    "everything_full_shard": _everything(
        "FULL_SHARD", _classes("Block", "Branch", "Linear"), 2, 0.1, "sgd", {"mode": "sharded", "after_step": 1}
    ),
    "everything_shard_grad_op": _everything(
        "SHARD_GRAD_OP",
        {"kind": "callable", "classes": ["ListBlock", "Conv2dLeaf"], "n": 10},
        1,
        None,
        "adamw",
        {"mode": "local", "after_step": 0},
    ),
    "everything_no_shard": _everything(
        "NO_SHARD", {"kind": "min", "n": 10}, 2, 1.0, "sgd", {"mode": "full", "after_step": 2}
    ),
    "everything_no_wrap": _everything(
        "FULL_SHARD", {"kind": "none"}, 1, 0.01, "adamw", {"mode": "full", "after_step": 1}
    ),
    # One per schedule feature (each alone, on wrapped units):
    # - requires_grad flips between steps: the leaf frozen at build (a whole unit) is unfrozen before step 1 with
    #   every other parameter of index 0 mod 2, then every parameter of index 1 mod 3 flips before step 2.
    "flips": {
        "seed": 11,
        "dim": 3,
        "options": _options(wrap=_classes("ResLinear", "Block")),
        "tree": {
            "kind": "seq",
            "children": [
                _linear(frozen="all"),
                {"kind": "block", "scalar_skip": False, "children": [_linear(), _BN]},
                _linear(),
                _linear(frozen="bias"),
            ],
        },
        "schedule": {
            "flips": [{"before_step": 1, "every": 2, "offset": 0}, {"before_step": 2, "every": 3, "offset": 1}]
        },
    },
    # - flips with AdamW, SHARD_GRAD_OP, gradient accumulation and a checkpoint in between (the loaded copy is built
    #   with the initial flags and flipped like the others from the next step on).
    "flips_adamw_checkpoint": {
        "seed": 12,
        "dim": 4,
        "options": _options(
            "SHARD_GRAD_OP", _classes("ResLinear", "ListBlock"), 2, 0.1, "adamw", {"mode": "sharded", "after_step": 1}
        ),
        "tree": _UNITS_TREE,
        "schedule": {
            "flips": [{"before_step": 1, "every": 1, "offset": 0}, {"before_step": 3, "every": 2, "offset": 1}]
        },
    },
    # - a forward that raises inside a wrapped Raiser unit, after two units ran, at step 1: caught, then the normal
    #   forward and backward.
    "fault_in_unit": {
        "seed": 13,
        "dim": 3,
        "options": _options(wrap=_classes("ResLinear", "Raiser", "Block")),
        "tree": {
            "kind": "seq",
            "children": [
                _linear(),
                {"kind": "block", "scalar_skip": True, "children": [_linear(), _RAISER, _linear()]},
                _linear(),
            ],
        },
        "schedule": {"fault": {"step": 1, "micro": 0}},
    },
    # - the same between the two micro-batches' backward passes (accumulation), SHARD_GRAD_OP.
    "fault_between_micro_batches": {
        "seed": 14,
        "dim": 3,
        "options": _options("SHARD_GRAD_OP", _classes("ResLinear", "Raiser"), accumulate=2),
        "tree": {"kind": "seq", "children": [_linear(), _linear(), _RAISER, _linear()]},
        "schedule": {"fault": {"step": 2, "micro": 1}},
    },
    # - no Raiser leaf: the root raises after every unit of the body ran (all gathered, none post-forwarded), step 0.
    "fault_in_root": {
        "seed": 15,
        "dim": 3,
        "options": _options(wrap=_classes("ResLinear", "ListBlock")),
        "tree": _UNITS_TREE,
        "schedule": {"fault": {"step": 0, "micro": 0}},
    },
    # - two forwards (different inputs) per backward, their mean loss back-propagated once.
    "two_forwards": {
        "seed": 16,
        "dim": 3,
        "options": _options(wrap=_classes("ResLinear", "Block")),
        "tree": _UNITS_TREE,
        "schedule": {"forwards": 2},
    },
    # - two forwards with accumulation, SHARD_GRAD_OP, AdamW, a unit called twice in each forward.
    "two_forwards_repeat": {
        "seed": 17,
        "dim": 4,
        "options": _options("SHARD_GRAD_OP", _classes("ResLinear", "Repeat"), 2, None, "adamw"),
        "tree": {"kind": "seq", "children": [{"kind": "repeat", "children": [_linear(), _BN]}, _linear()]},
        "schedule": {"forwards": 2},
    },
    # - eval forwards between steps: no_grad in eval mode; no_grad in train mode (BatchNorm statistics move); and a
    #   grad-enabled forward whose output is dropped without a backward.
    "evals_between_steps": {
        "seed": 18,
        "dim": 3,
        "options": _options(wrap=_classes("ResLinear", "Block")),
        "tree": _UNITS_TREE,
        "schedule": {"evals": [_eval(0), _eval(1, train=True), _eval(2, grad=True, train=True)]},
    },
    # - an eval forward with the units in another order (list and block children reversed), after the recorded
    #   order froze, with forward prefetching following the recorded order.
    "eval_reversed_order": {
        "seed": 19,
        "dim": 3,
        "options": _options(
            wrap=_classes("ResLinear", "Block"), prefetch={"forward": True, "backward": "BACKWARD_PRE", "limit": True}
        ),
        "tree": _UNITS_TREE,
        "schedule": {"evals": [_eval(1, reverse=True), _eval(2, reverse=True, grad=True)]},
    },
    # - a no_grad forward between a micro-batch's forward and its backward.
    "eval_before_backward": {
        "seed": 20,
        "dim": 3,
        "options": _options(wrap=_classes("ResLinear", "Block")),
        "tree": _UNITS_TREE,
        "schedule": {"evals": [_eval(1, "before_backward"), _eval(2, "before_backward", train=True)]},
    },
    # - prefetching in both directions without the limit on gathers, and a branch that changes the order of units
    #   from step to step.
    "prefetch_changing_order": {
        "seed": 21,
        "dim": 3,
        "options": _options(
            wrap=_classes("ResLinear", "Branch"),
            prefetch={"forward": True, "backward": "BACKWARD_POST", "limit": False},
        ),
        "tree": {
            "kind": "seq",
            "children": [
                _linear(),
                {"kind": "branch", "period": 2, "phase": 1, "children": [_linear(), _linear()]},
                _linear(),
                _linear(),
            ],
        },
    },
    # Every tree feature and every schedule feature at once, on two option sets.
    "everything_scheduled_full_shard": _everything(
        "FULL_SHARD",
        _classes("Block", "Branch", "Linear", "Raiser"),
        2,
        0.1,
        "sgd",
        {"mode": "sharded", "after_step": 1},
        prefetch={"forward": True, "backward": "BACKWARD_PRE", "limit": True},
        tree={
            "kind": "seq",
            "children": EVERYTHING["tree"]["children"][:3] + [_RAISER] + EVERYTHING["tree"]["children"][3:],
        },
        schedule={
            "flips": [{"before_step": 1, "every": 3, "offset": 1}, {"before_step": 2, "every": 2, "offset": 0}],
            "fault": {"step": 1, "micro": 1},
            "forwards": 2,
            "evals": [_eval(0, reverse=True), _eval(2, "before_backward", train=True, index=1)],
        },
    ),
    "everything_scheduled_shard_grad_op": _everything(
        "SHARD_GRAD_OP",
        {"kind": "callable", "classes": ["ListBlock", "Conv2dLeaf", "Raiser"], "n": 3},
        1,
        None,
        "adamw",
        {"mode": "local", "after_step": 0},
        prefetch={"forward": True, "backward": "BACKWARD_POST", "limit": False},
        tree={
            "kind": "seq",
            "children": EVERYTHING["tree"]["children"][:5] + [_RAISER] + EVERYTHING["tree"]["children"][5:],
        },
        schedule={
            "flips": [{"before_step": 0, "every": 2, "offset": 1}, {"before_step": 3, "every": 1, "offset": 0}],
            "fault": {"step": 2, "micro": 0},
            "forwards": 2,
            "evals": [_eval(1, grad=True, train=True, reverse=True), _eval(3, index=1)],
        },
    ),
}


# ============================================================================================ the checks
class _Report:
    """Every example's counts (rank 0's values; every rank's fractions are checked), for the summary."""

    def __init__(self) -> None:
        self.examples: dict[str, dict[str, Any]] = {}

    def add(self, case: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
        totals = {key: sum(s[key] for s in steps) for key in ("values", "base", "widened", "chaotic", "beyond_base")}
        totals["compared"] = totals["base"] + totals["widened"]
        totals["max_widening"] = max(s["max_widening"] for s in steps)
        totals["max_error_ratio"] = max(s["max_error_ratio"] for s in steps)
        totals["chaotic_max_error_ratio"] = max(s["chaotic_max_error_ratio"] for s in steps)
        totals["min_step_fraction"] = min((s["base"] + s["widened"]) / s["values"] for s in steps)
        totals["features"] = features_of(case)
        self.examples[repr(case)] = totals
        return totals

    def summary(self) -> str:
        rows = list(self.examples.values())
        if not rows:
            return "property tests: no example ran"
        compared = sorted(r["compared"] for r in rows)
        widened = [r for r in rows if r["widened"]]
        widened_values = sum(r["widened"] for r in rows)
        chaotic = [r for r in rows if r["chaotic"]]
        lines = [
            f"property tests: {len(rows)} examples; values compared per example (rank 0, all steps) min "
            f"{compared[0]}, median {statistics.median(compared):g}, max {compared[-1]}; "
            f"{sum(1 for c in compared if c == 0)} compared none; total {sum(compared)} values",
            f"  widened tolerance (max(base, {DRIFT_K:g} x drift)): {len(widened)} examples, "
            f"{widened_values} values ({widened_values / max(1, sum(compared)):.2%}), "
            f"at most {max((r['max_widening'] for r in rows), default=0):.3g} x the base tolerance; values whose "
            f"error exceeded the base tolerance: {sum(r['beyond_base'] for r in rows)} in "
            f"{sum(1 for r in rows if r['beyond_base'])} examples, the largest error "
            f"{max(r['max_error_ratio'] for r in rows):.3g} x the base tolerance",
            f"  chaotic (widened tolerance > {CHAOS_RTOL:g} x magnitude, not compared): {len(chaotic)} examples, "
            f"{sum(r['chaotic'] for r in rows)} values (their error, for information: at most "
            f"{max(r['chaotic_max_error_ratio'] for r in rows):.3g} x the base tolerance); lowest fraction of a "
            f"step's values compared {min(r['min_step_fraction'] for r in rows):.1%}",
        ]
        by_feature = {
            f: sum(1 for r in rows if f in r["features"]) for f in sorted({f for r in rows for f in r["features"]})
        }
        lines.append(
            f"  examples using each schedule feature: {by_feature or 'none'} (generator features: "
            f"{','.join(sorted(FEATURES)) or 'none'})"
        )
        return "\n".join(lines)


_REPORT = _Report()


@pytest.fixture(scope="module")
def pool(request):
    workers = WorkerPool(world_size=2)
    yield workers
    workers.close()
    text = _REPORT.summary()
    path = os.environ.get("LIGHTNING_FSDP_PROPERTY_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"summary": text, "examples": _REPORT.examples}, f, indent=1)
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n" + text)


def _bucket(value: float, edges: tuple[float, ...]) -> str:
    for edge in edges:
        if value <= edge:
            return f"<= {edge:g}"
    return f"> {edges[-1]:g}"


def _check(pool: WorkerPool, case: dict[str, Any]) -> None:
    results = pool.run(case)
    info = results[0]["info"]
    context = f"(units: {info['units']})\n" + describe(case)
    problems = [f"rank {rank}: {message}" for rank, result in enumerate(results) for message in result["errors"]]
    assert not problems, "sharded training differs from the unsharded reference " + context + "\n" + "\n".join(problems)

    # Nothing is quietly left uncompared: every rank compared the step-0 loss at the base tolerance, and at least
    # MIN_COMPARED of every step's values.
    for rank, result in enumerate(results):
        steps = result["info"]["comparison"]
        assert len(steps) == STEPS, f"rank {rank} reported {len(steps)} steps " + context
        assert steps[0]["loss_at_base"], f"rank {rank} did not compare the step-0 loss " + context
        for s in steps:
            compared = s["base"] + s["widened"]
            assert s["values"] > 0 and compared >= MIN_COMPARED * s["values"], (
                f"rank {rank}, step {s['step']}: only {compared} of {s['values']} values compared; chaotic "
                f"(widened tolerance above {CHAOS_RTOL:g} x magnitude): {s['chaotic_tensors']} " + context
            )
    totals = _REPORT.add(case, info["comparison"])
    assert totals["compared"] > 0
    if not currently_in_test_context():
        return  # an explicit example: the summary counts it
    event(f"features: {'+'.join(totals['features']) or 'none'}")
    event(f"values compared per example: {_bucket(totals['compared'], (50, 200, 1000))}")
    event(
        "tolerance: "
        + (
            "base only"
            if not totals["widened"]
            else f"widened for some values, at most {_bucket(totals['max_widening'], (10, 100, 1000))} x base"
        )
    )
    event(
        "values beyond the base tolerance (within the widened one): "
        + ("none" if not totals["beyond_base"] else _bucket(totals["max_error_ratio"], (10, 100, 1000)) + " x base")
    )
    event(
        "chaotic values (not compared): "
        + ("none" if not totals["chaotic"] else f"{totals['chaotic'] / totals['values']:.0%} of the example's")
    )
    for where in sorted(set(info["fault_where"])):
        event(f"injected fault raised in: {where}")


@pytest.mark.parametrize("name", list(EXPLICIT))
def test_explicit_case_matches_unsharded_reference(pool, name):
    _check(pool, EXPLICIT[name])


@_SETTINGS
@given(case=CASES)
def test_sharded_training_matches_unsharded_reference(pool, case):
    _check(pool, case)
