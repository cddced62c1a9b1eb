"""Random module trees, option sets and training schedules for the property-based parity tests
(tests/engine/test_property.py), and the code the pool's workers run for one case: sharded training on every rank
beside an unsharded reference computed in the same process, compared step by step.

A case is plain data (a dict), so it crosses multiprocessing queues and reads well in a failure report::

    {"seed": int, "dim": D, "tree": NODE, "options": OPTIONS, "schedule": SCHEDULE}

    NODE: a container {"kind": "seq" | "list" | "block" | "repeat" | "branch", "children": [NODE, ...]} ("repeat"
          runs its children twice; "branch" also has "period" and "phase": it runs its children only on
          micro-batches whose running index i = step * accumulate + micro has i % period == phase, identically on
          every rank; "list" and "block" run their children in reverse order in a "reverse" eval forward), or a leaf
          (see ``_Builder._leaf``; a "layernorm" over D = 1 is ``x + LayerNorm(x)`` without affine parameters):
          {"kind": "linear" | "tiedpair" | "bottleneck" | "scalar" | "conv1d" | "conv2d" | "embedding" | "layernorm" |
          "batchnorm" | "head" | "raiser", "frozen": "none" | "all" | "weight" | "bias", ...}; "linear" and "head"
          leaves may "tie" their weight to an earlier linear leaf's / embedding's weight (the same nn.Parameter);
          "tiedpair" is two Linear modules sharing a weight; "block" has a parameter of its own, 0-dim if
          "scalar_skip"; "raiser" adds a bias and raises the injected fault (see SCHEDULE) when it is armed.
    OPTIONS: {"strategy": FULL_SHARD | SHARD_GRAD_OP | NO_SHARD, "wrap": {"kind": "none" | "classes" | "min" |
          "callable", ...}, "accumulate": 1 | 2, "clip": None | max-norm, "optimizer": "sgd" | "adamw",
          "checkpoint": None | {"mode": "full" | "sharded" | "local", "after_step": k},
          "prefetch": None (the engine's defaults) | {"forward": bool, "backward": "BACKWARD_PRE" | "BACKWARD_POST" |
          None, "limit": bool (limit_all_gathers)}}
    SCHEDULE (every key optional; missing means none of it):
          {"flips": [{"before_step": s, "every": n, "offset": o}, ...]: before step s, toggle requires_grad of every
                    parameter whose index i (in named_parameters order, the root's own output layer excluded, so
                    something always trains) has i % n == o % n; the optimizer keeps every parameter, so a frozen
                    one gets no gradient and no update,
           "fault": None | {"step": s, "micro": m}: before micro-batch m % accumulate of step s, a forward with the
                    fault armed; it raises in the first "raiser" leaf it reaches, or in the root after the whole
                    body ran; the loop catches it and goes on with the normal forward,
           "forwards": 1 | 2: forwards (of different inputs) per micro-batch, their mean loss back-propagated once,
           "evals": [{"step": s, "where": "after_step" | "before_backward", "grad": bool, "train": bool,
                      "reverse": bool, "index": i}, ...]: an extra forward of another batch after step s's optimizer
                    step, or between micro-batch 0's forward and its backward; under no_grad unless "grad" (then its
                    output is dropped without a backward), in eval mode unless "train", with the branch index i, and
                    list/block children in reverse order if "reverse" (another order of units). Its output is
                    compared like a parameter.}

The model is ``Root``: ``out(body(x))`` with ``body`` built from the tree and ``out`` a trainable Linear(D, 2), so
every step has something to differentiate. Every leaf maps (B, D) -> (B, D); integer ids for embeddings reach the
leaves through a small context object the training loop fills (nn.Sequential passes one tensor only).

The reference is what data-parallel training must compute, run in one process on the same global batch: for each
micro-batch it runs every rank's chunk separately and back-propagates the mean of the ranks' losses. BatchNorm
normalises with each rank's own chunk statistics and every rank keeps its own running statistics (as torch's
FSDP does: it never synchronises buffers), so the reference keeps one copy of the buffers per rank and swaps it in
for that rank's chunk; rank r's buffers are compared with the reference's copy r. The schedule (flips, fault,
forwards, evals) is carried out by the same functions for the reference, the probes and the sharded run.

Tolerances. Sharded and unsharded arithmetic round differently (gradients are summed across ranks in another
order), and some random cases amplify rounding-size differences by themselves (BatchNorm over a 2-sample chunk nearly
constant in a feature; AdamW dividing a gradient that is zero in exact arithmetic and rounding noise in fp32 by its
own magnitude). So next to the reference every worker trains PROBES probes: the same reference with its initial
parameters and every step's gradients (before clipping and the optimizer step) multiplied by 1 +- eps (fp32's unit
in the last place, a random sign per element, another pattern per probe). For every compared tensor T (a loss, a
parameter, a rank's buffer, an eval output) its drift is max over probes and elements of |probe - reference|, and
each value is compared with

    |sharded - reference| <= max(ATOL + RTOL * |reference|, DRIFT_K * drift(T))     (RTOL 1e-5, ATOL 1e-6, K = 10)

The step-0 loss is always compared at the base tolerance (no parameter has been updated yet). A tensor whose widened
tolerance DRIFT_K * drift exceeds CHAOS_RTOL (1e-2) times its largest magnitude (and its base tolerance) is not
compared: its values are counted as chaotic and reported (tests/engine/test_property.py requires at least MIN_COMPARED
of each step's values to be compared, and reports the counts). Nothing else is ever skipped.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn

STEPS = 4
GLOBAL_BATCH = 16  # per rank: 8 samples, or 4 per micro-batch with accumulation
OUT = 2
VOCAB_IDS = 5  # ids are drawn from [0, 5); an embedding of V rows looks up ids % V
RTOL, ATOL = 1e-5, 1e-6  # the base tolerance
PROBES = 2  # nudged copies of the reference that measure each tensor's drift
DRIFT_K = 10.0  # a value may differ from the reference by DRIFT_K times its tensor's measured drift
CHAOS_RTOL = 1e-2  # a widened tolerance above this fraction of the tensor's magnitude compares nothing: chaotic
MIN_COMPARED = 0.9  # the fraction of each step's values that must be compared (tests/engine/test_property.py checks it)
MAX_ERRORS = 6

# The generator's optional features (``LIGHTNING_FSDP_PROPERTY_FEATURES``: a comma-separated subset, "none" for the
# generator without any of them). Explicit examples always run.
ALL_FEATURES = ("flips", "fault", "forwards", "evals", "prefetch")
_FEATURES_ENV = os.environ.get("LIGHTNING_FSDP_PROPERTY_FEATURES", ",".join(ALL_FEATURES))
FEATURES = frozenset(f.strip() for f in _FEATURES_ENV.split(",") if f.strip() and f.strip() != "none")
if FEATURES - set(ALL_FEATURES):
    raise ValueError(
        f"LIGHTNING_FSDP_PROPERTY_FEATURES: unknown {sorted(FEATURES - set(ALL_FEATURES))}; "
        f"choose from {', '.join(ALL_FEATURES)} or none"
    )


# ============================================================================================ the modules
class Context:
    """Per-forward data the training loop sets: the chunk's ids and which micro-batch this is."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.index = 0  # step * accumulate + micro: decides which branches run
        self.reverse = False  # list and block containers run their children in reverse order
        self.armed = False  # the next Raiser leaf (or else the root, after the body) raises InjectedFault


class InjectedFault(Exception):
    """The exception a forward with the fault armed raises; the training loop catches it."""


class ResLinear(nn.Module):
    def __init__(self, dim: int, bias: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Bottleneck(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc2(torch.tanh(self.fc1(x))))


class ScalarGate(nn.Module):
    """A Linear(1, 1): both its parameters have fewer rows than there are ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x.mean(-1, keepdim=True)))


class Conv1dLeaf(nn.Module):
    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, channels, kernel, padding=kernel // 2, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.conv(x.unsqueeze(1))).mean(1)


class Conv2dLeaf(nn.Module):
    def __init__(self, channels: int, kernel: tuple[int, int], bias: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, kernel, padding=(kernel[0] // 2, kernel[1] // 2), bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = torch.stack([x, torch.tanh(x)], 1).unsqueeze(1)  # (B, 1, 2, D)
        return x + torch.tanh(self.conv(image)).mean((1, 2))


class EmbedLeaf(nn.Module):
    def __init__(self, vocab: int, dim: int, ctx: Context) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.emb(self.ctx.ids % self.emb.num_embeddings)


class HeadLeaf(nn.Module):
    """A Linear(D, V) without bias, its weight optionally the (V, D) weight of an earlier embedding."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.head(x)).mean(-1, keepdim=True)


class TiedPair(nn.Module):
    """Two Linear(D, D) modules sharing one weight Parameter: ``x + tanh(b(tanh(a(x))))``."""

    def __init__(self, dim: int, bias: bool) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim, bias=bias)
        self.b = nn.Linear(dim, dim, bias=bias)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.b(torch.tanh(self.a(x))))


class ResNorm(nn.Module):
    """``x + LayerNorm(x)`` without affine parameters: the layernorm leaf when D = 1 (see ``_Builder._leaf``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(x)


class ResBatchNorm(nn.Module):
    """``x + BatchNorm1d(x)``: the batchnorm leaf. A BatchNorm subtracts each feature's batch mean, so a bias right
    before it (a Linear's, a raiser's) would get a gradient that is zero in exact arithmetic and rounding noise in
    fp32, which AdamW scales up to full-size updates: nothing left to compare. The identity path keeps it real."""

    def __init__(self, dim: int, momentum: float | None, affine: bool) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(dim, momentum=momentum, affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(x)


class Raiser(nn.Module):
    """``x + bias``; raises InjectedFault instead when the context is armed (after its unit, if any, was gathered)."""

    def __init__(self, dim: int, ctx: Context) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, dim))
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.armed:
            raise InjectedFault("raiser")
        return x + self.bias


class Block(nn.Module):
    """A container with a parameter of its own, 0-dim or of one row (fewer rows than ranks): ``chain(x) + skip * x``."""

    def __init__(self, children: list[nn.Module], scalar_skip: bool, ctx: Context) -> None:
        super().__init__()
        for i, child in enumerate(children):
            self.add_module(f"c{i}", child)
        self.skip = nn.Parameter(torch.tensor(0.5) if scalar_skip else torch.full((1,), 0.5))
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        children = list(self.children())
        for child in reversed(children) if self.ctx.reverse else children:
            h = child(h)
        return h + self.skip * x


class ListBlock(nn.Module):
    def __init__(self, children: list[nn.Module], ctx: Context) -> None:
        super().__init__()
        self.layers = nn.ModuleList(children)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = list(self.layers)
        for layer in reversed(layers) if self.ctx.reverse else layers:
            x = layer(x)
        return x


class Repeat(nn.Module):
    """Runs its children twice in a row: each child module (a unit, if wrapped) is called twice per forward."""

    def __init__(self, children: list[nn.Module]) -> None:
        super().__init__()
        self.body = nn.Sequential(*children)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.body(x))


class Branch(nn.Module):
    """Runs its children only on some micro-batches (the same ones on every rank): unused parameters."""

    def __init__(self, children: list[nn.Module], period: int, phase: int, ctx: Context) -> None:
        super().__init__()
        self.body = nn.Sequential(*children)
        self.period, self.phase = period, phase % period
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.index % self.period == self.phase:
            return self.body(x)
        return x


class Root(nn.Module):
    def __init__(self, body: nn.Module, dim: int, ctx: Context) -> None:
        super().__init__()
        self.body = body
        self.out = nn.Linear(dim, OUT)
        self.ctx = ctx

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.ctx.ids = ids
        h = self.body(x)
        if self.ctx.armed:  # no Raiser leaf ran: raise here, after every unit of the body ran
            raise InjectedFault("root")
        return self.out(h)


WRAP_CLASSES: dict[str, type[nn.Module]] = {
    cls.__name__: cls
    for cls in (
        Block,
        ListBlock,
        Repeat,
        Branch,
        nn.Sequential,
        ResLinear,
        Bottleneck,
        TiedPair,
        ScalarGate,
        Conv1dLeaf,
        Conv2dLeaf,
        EmbedLeaf,
        HeadLeaf,
        Raiser,
        nn.Linear,
        nn.Conv1d,
        nn.Conv2d,
        nn.Embedding,
        nn.LayerNorm,
        nn.BatchNorm1d,
    )
}


# ============================================================================================ building
class _Builder:
    def __init__(self, dim: int, ctx: Context) -> None:
        self.dim = dim
        self.ctx = ctx
        self.linears: list[nn.Linear] = []  # (D, D) weights a later "linear" leaf may tie to
        self.embeddings: list[nn.Embedding] = []

    def node(self, spec: dict[str, Any]) -> nn.Module:
        kind = spec["kind"]
        if kind in ("seq", "list", "block", "repeat", "branch"):
            children = [self.node(c) for c in spec["children"]]
            if kind == "seq":
                return nn.Sequential(*children)
            if kind == "list":
                return ListBlock(children, self.ctx)
            if kind == "block":
                return Block(children, spec["scalar_skip"], self.ctx)
            if kind == "repeat":
                return Repeat(children)
            return Branch(children, spec["period"], spec["phase"], self.ctx)
        leaf = self._leaf(spec)
        frozen = spec.get("frozen", "none")
        for name, param in leaf.named_parameters():
            if frozen == "all" or name.endswith("." + frozen) or name == frozen:
                param.requires_grad_(False)
        return leaf

    def _leaf(self, spec: dict[str, Any]) -> nn.Module:
        kind, d = spec["kind"], self.dim
        if kind == "linear":
            leaf = ResLinear(d, spec["bias"])
            if spec.get("tie") is not None and self.linears:
                leaf.lin.weight = self.linears[spec["tie"] % len(self.linears)].weight
            self.linears.append(leaf.lin)
            return leaf
        if kind == "tiedpair":
            return TiedPair(d, spec["bias"])
        if kind == "bottleneck":
            return Bottleneck(d, spec["hidden"], spec["bias"])
        if kind == "scalar":
            return ScalarGate()
        if kind == "conv1d":
            return Conv1dLeaf(spec["channels"], spec["kernel"], spec["bias"])
        if kind == "conv2d":
            return Conv2dLeaf(spec["channels"], tuple(spec["kernel"]), spec["bias"])
        if kind == "embedding":
            leaf = EmbedLeaf(spec["vocab"], d, self.ctx)
            self.embeddings.append(leaf.emb)
            return leaf
        if kind == "head":
            if spec.get("tie") is not None and self.embeddings:
                emb = self.embeddings[spec["tie"] % len(self.embeddings)]
                leaf = HeadLeaf(d, emb.num_embeddings)
                leaf.head.weight = emb.weight
            else:
                leaf = HeadLeaf(d, 3)
            return leaf
        if kind == "layernorm":
            if d == 1:
                # Over one feature a LayerNorm outputs its bias whatever its input: everything before it gets
                # gradients that are zero in exact arithmetic and rounding noise in fp32 (its weight too: it scales
                # x - mean(x) = 0), which AdamW scales up to full-size updates, so nothing would be left to compare.
                # With one feature the leaf is x + LayerNorm(x), without affine parameters.
                return ResNorm(d)
            return nn.LayerNorm(d, elementwise_affine=spec["affine"], bias=spec["bias"])
        if kind == "batchnorm":
            return ResBatchNorm(d, spec["momentum"], spec["affine"])
        if kind == "raiser":
            return Raiser(d, self.ctx)
        raise ValueError(f"unknown leaf kind {kind!r}")


def build_model(case: dict[str, Any], seed_offset: int = 0) -> tuple[Root, Context]:
    """The case's model, initialised from its seed (``seed_offset`` gives other initial values, same structure)."""
    torch.manual_seed(case["seed"] + seed_offset)
    ctx = Context()
    builder = _Builder(case["dim"], ctx)
    return Root(builder.node(case["tree"]), case["dim"], ctx), ctx


def wrap_policy(spec: dict[str, Any]) -> Any:
    kind = spec["kind"]
    if kind == "none":
        return None
    if kind == "classes":
        return {WRAP_CLASSES[name] for name in spec["classes"]}
    if kind == "min":
        return spec["n"]
    classes = tuple(WRAP_CLASSES[name] for name in spec["classes"])
    threshold = spec["n"]

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True
        return isinstance(module, classes) and nonwrapped_numel >= threshold

    return policy


def make_optimizer(params: Any, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def global_batch(case: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case["seed"] * 1009 + step)
    x = torch.randn(GLOBAL_BATCH, case["dim"], generator=g)
    ids = torch.randint(0, VOCAB_IDS, (GLOBAL_BATCH,), generator=g)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g)
    return x, ids, y


def chunk(batch: tuple[torch.Tensor, ...], micro: int, accumulate: int, rank: int, world: int) -> list[torch.Tensor]:
    """Micro-batch ``micro`` of the global batch (every accumulate-th row), then rank's contiguous part of it."""
    out = []
    for t in batch:
        t = t[micro::accumulate]
        b = t.shape[0] // world
        out.append(t[rank * b : (rank + 1) * b])
    return out


def loss_fn(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(pred, target)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def _load_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    # New tensors rather than copy_: BatchNorm's autograd node saved the previous chunk's running stats, and an
    # in-place write would bump their version before that chunk's backward.
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = values[f"{prefix}.{name}" if prefix else name].clone()


# ============================================================================================ the schedule
# One implementation for the reference, its probes and the sharded run: ``ranks`` is every rank for the reference
# (one chunk each, BatchNorm buffers swapped in) and this rank for the sharded run.
def schedule(case: dict[str, Any]) -> dict[str, Any]:
    given = case.get("schedule") or {}
    return {
        "flips": given.get("flips", []),
        "fault": given.get("fault"),
        "forwards": given.get("forwards", 1),
        "evals": given.get("evals", []),
    }


def requires_grad_flags(initial: dict[str, bool], case: dict[str, Any], step: int) -> dict[str, bool]:
    """Each parameter's requires_grad during ``step``: as built, toggled by every flip before this step."""
    flags = dict(initial)
    toggled = [name for name in initial if not name.startswith("out.")]
    for flip in schedule(case)["flips"]:
        if flip["before_step"] <= step:
            for i, name in enumerate(toggled):
                if i % flip["every"] == flip["offset"] % flip["every"]:
                    flags[name] = not flags[name]
    return flags


def apply_requires_grad(model: nn.Module, flags: dict[str, bool]) -> None:
    for name, param in model.named_parameters():
        if param.requires_grad != flags[name]:
            param.requires_grad_(flags[name])


def _forward_inputs(x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """The k-th forward's inputs of a micro-batch: the chunk itself, then a transformed copy (other values)."""
    if k == 0:
        return x, ids, y
    return -x.roll(k, -1) * (1 + 0.5 * k), (ids + k) % VOCAB_IDS, y.flip(-1)


def _failing_forward(model: nn.Module, ctx: Context, x: torch.Tensor, ids: torch.Tensor) -> str:
    """A forward with the fault armed; returns where it raised ("raiser" or "root")."""
    ctx.armed = True
    try:
        model(x, ids)
    except InjectedFault as err:
        return str(err)
    finally:
        ctx.armed = False
    raise AssertionError("the armed forward did not raise")  # cannot happen: the root raises if no Raiser did


def eval_forward(
    model: nn.Module, ctx: Context, case: dict[str, Any], spec: dict[str, Any], step: int, rank: int, world: int
) -> torch.Tensor:
    x, ids, _ = chunk(global_batch(case, 100 + step), 0, 1, rank, world)
    was_training, index = model.training, ctx.index
    ctx.index, ctx.reverse = spec["index"], spec["reverse"]
    model.train(spec["train"])
    try:
        with torch.set_grad_enabled(spec["grad"]):
            out = model(x, ids)
    finally:
        model.train(was_training)
        ctx.index, ctx.reverse = index, False
    return out.detach().clone()


class _Trainer:
    """What the reference and the sharded run share: one training step of the case's schedule over ``ranks``."""

    case: dict[str, Any]
    model: Root
    ctx: Context
    optimizer: torch.optim.Optimizer

    def _record_initial_flags(self) -> None:
        self.initial_flags = {name: p.requires_grad for name, p in self.model.named_parameters()}

    def _on_ranks(self, rank: int, fn: Any) -> Any:  # overridden by the reference to swap the rank's buffers in
        return fn()

    def _clip(self, max_norm: float) -> None:
        raise NotImplementedError

    def _before_optimizer(self, step: int) -> None:
        pass

    def train_step(self, step: int, ranks: list[int], world: int) -> tuple[dict[int, float], dict[int, dict]]:
        """One optimizer step; returns each rank's loss (summed over its micro-batches, each divided by accumulate)
        and the eval outputs {eval index: {rank: output}}, and notes where injected faults raised."""
        opts, plan = self.case["options"], schedule(self.case)
        accumulate = opts["accumulate"]
        apply_requires_grad(self.model, requires_grad_flags(self.initial_flags, self.case, step))
        batch = global_batch(self.case, step)
        losses = {r: 0.0 for r in ranks}
        evals: dict[int, dict[int, torch.Tensor]] = {}
        for micro in range(accumulate):
            total = None
            for rank in ranks:

                def micro_loss(rank: int = rank) -> torch.Tensor:
                    self.ctx.index = step * accumulate + micro
                    x, ids, y = chunk(batch, micro, accumulate, rank, world)
                    fault = plan["fault"]
                    if fault is not None and fault["step"] == step and fault["micro"] % accumulate == micro:
                        self.fault_where.append(_failing_forward(self.model, self.ctx, x, ids))
                    loss = None
                    for k in range(plan["forwards"]):
                        xk, idsk, yk = _forward_inputs(x, ids, y, k)
                        part = loss_fn(self.model(xk, idsk), yk)
                        loss = part if loss is None else loss + part
                    for i, spec in enumerate(plan["evals"]):
                        if spec["step"] == step and spec["where"] == "before_backward" and micro == 0:
                            evals.setdefault(i, {})[rank] = eval_forward(
                                self.model, self.ctx, self.case, spec, step, rank, world
                            )
                    return loss / plan["forwards"] / accumulate

                loss = self._on_ranks(rank, micro_loss)
                losses[rank] += loss.item()
                total = loss if total is None else total + loss
            (total / len(ranks)).backward()
        self._before_optimizer(step)
        if opts["clip"] is not None:
            self._clip(opts["clip"])
        self.optimizer.step()
        self.optimizer.zero_grad()
        for i, spec in enumerate(plan["evals"]):
            if spec["step"] == step and spec["where"] == "after_step":
                for rank in ranks:
                    evals.setdefault(i, {})[rank] = self._on_ranks(
                        rank, lambda rank=rank: eval_forward(self.model, self.ctx, self.case, spec, step, rank, world)
                    )
        return losses, evals


# ============================================================================================ the reference
class Reference(_Trainer):
    """Unsharded training on the whole global batch in this process, one forward per rank's chunk.

    ``probe`` k > 0: the same with every initial parameter and every step's gradients multiplied by 1 +- eps (about
    one unit in the last place, a random sign per element, a pattern per k): the size of the rounding differences
    between sharded and unsharded arithmetic. How far it moves from the reference is each tensor's drift.
    """

    def __init__(self, case: dict[str, Any], world: int, *, probe: int = 0) -> None:
        self.case, self.world, self.probe = case, world, probe
        self.model, self.ctx = build_model(case)
        self.fault_where: list[str] = []
        self._record_initial_flags()
        if probe:
            with torch.no_grad():
                self._nudge([p for p in self.model.parameters()], 0)
        self.rank_buffers = [_buffers(self.model) for _ in range(world)]
        self.optimizer = make_optimizer(self.model.parameters(), case["options"]["optimizer"])

    def _nudge(self, tensors: list[torch.Tensor], salt: int) -> None:
        g = torch.Generator().manual_seed(self.case["seed"] * 7919 + self.probe * 104729 + salt)
        for t in tensors:
            sign = torch.randint(0, 2, t.shape, generator=g).to(t.dtype) * 2 - 1
            t.mul_(1 + sign * torch.finfo(t.dtype).eps)

    def _on_ranks(self, rank: int, fn: Any) -> Any:
        _load_buffers(self.model, self.rank_buffers[rank])
        out = fn()
        self.rank_buffers[rank] = _buffers(self.model)
        return out

    def _before_optimizer(self, step: int) -> None:
        if self.probe:
            with torch.no_grad():
                self._nudge([p.grad for p in self.model.parameters() if p.grad is not None], 1 + step)

    def _clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self, step: int) -> tuple[list[float], dict[int, list[torch.Tensor]]]:
        """Each rank's loss and the eval outputs {eval index: [output of rank r, ...]}."""
        losses, evals = self.train_step(step, list(range(self.world)), self.world)
        return [losses[r] for r in range(self.world)], {
            i: [by_rank[r] for r in range(self.world)] for i, by_rank in evals.items()
        }

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}


# ============================================================================================ one case, sharded
class _Sharded(_Trainer):
    def __init__(self, case: dict[str, Any], seed_offset: int = 0) -> None:
        from lightning_fsdp.engine import fully_shard

        opts = case["options"]
        self.case = case
        self.model, self.ctx = build_model(case, seed_offset)
        self.fault_where: list[str] = []
        self._record_initial_flags()
        prefetch = opts.get("prefetch") or {}
        extra = {}
        if prefetch:
            extra = {
                "forward_prefetch": prefetch["forward"],
                "backward_prefetch": prefetch["backward"],
                "limit_all_gathers": prefetch["limit"],
            }
        self.engine = fully_shard(
            self.model, sharding_strategy=opts["strategy"], auto_wrap_policy=wrap_policy(opts["wrap"]), **extra
        )
        self.optimizer = make_optimizer(self.model.parameters(), opts["optimizer"])

    def _clip(self, max_norm: float) -> None:
        self.engine.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self, step: int, rank: int, world: int) -> tuple[float, dict[int, torch.Tensor]]:
        losses, evals = self.train_step(step, [rank], world)
        return losses[rank], {i: by_rank[rank] for i, by_rank in evals.items()}

    def params(self) -> dict[str, torch.Tensor]:
        with self.engine.unsharded():
            return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def optimizer_state(self) -> dict:
        from lightning_fsdp.checkpoint.full import full_optimizer_state_dict

        return full_optimizer_state_dict(self.engine, self.optimizer, rank0_only=False)


class _Errors(list):
    def equal(self, what: str, actual: Any, expected: Any) -> None:
        if isinstance(actual, dict) or isinstance(expected, dict):
            if not isinstance(actual, dict) or not isinstance(expected, dict) or set(actual) != set(expected):
                keys = lambda d: sorted(d) if isinstance(d, dict) else type(d).__name__  # noqa: E731
                self.add(f"{what}: keys {keys(actual)} != {keys(expected)}")
                return
            for key in expected:
                self.equal(f"{what}[{key!r}]", actual[key], expected[key])
            return
        if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)) and len(actual) == len(expected):
            for i, (a, e) in enumerate(zip(actual, expected)):
                self.equal(f"{what}[{i}]", a, e)
            return
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
            if actual.shape != expected.shape or actual.dtype != expected.dtype or not torch.equal(actual, expected):
                self.add(f"{what}: {actual!r} != {expected!r} (must be exact)")
            return
        if actual != expected:
            self.add(f"{what}: {actual!r} != {expected!r}")

    def add(self, message: str) -> None:
        if len(self) < MAX_ERRORS:
            self.append(message)
        elif len(self) == MAX_ERRORS:
            self.append("... (further mismatches not shown)")


class _Comparison:
    """Compares tensors with the reference at the drift-scaled tolerance (see the module docstring) and counts, per
    step, the values compared at the base tolerance, with a widened one, and not at all (chaotic)."""

    def __init__(self, errors: _Errors) -> None:
        self.errors = errors
        self.steps: list[dict[str, Any]] = []

    def begin_step(self, step: int) -> None:
        self.current = {
            "step": step,
            "values": 0,
            "base": 0,
            "widened": 0,
            "chaotic": 0,
            "beyond_base": 0,
            "max_widening": 0.0,
            "max_error_ratio": 0.0,
            "chaotic_max_error_ratio": 0.0,
            "chaotic_tensors": [],
            "loss_at_base": False,
        }
        self.steps.append(self.current)

    def close(self, what: str, actual: Any, expected: Any, probes: list[Any], *, widen: bool = True) -> None:
        counts = self.current
        actual = torch.as_tensor(actual).detach()
        expected = torch.as_tensor(expected).detach()
        n = expected.numel()
        counts["values"] += n
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            counts["base"] += n
            self.errors.add(f"{what}: {actual.dtype}{list(actual.shape)} != {expected.dtype}{list(expected.shape)}")
            return
        if n == 0:
            return
        if not expected.is_floating_point():
            counts["base"] += n
            if not torch.equal(actual, expected):
                self.errors.add(f"{what}: {actual!r} != {expected!r} (must be exact)")
            return
        e, a = expected.double(), actual.double()
        base = ATOL + RTOL * e.abs()
        drift = 0.0
        if widen:
            for probe in probes:
                drift = max(drift, float((torch.as_tensor(probe).detach().double() - e).abs().max()))
        wide = DRIFT_K * drift
        scale = float(e.abs().max())
        if wide > max(float(base.max()), CHAOS_RTOL * scale):
            # Not compared. The error is recorded for the report only (no tolerance would mean anything here).
            counts["chaotic"] += n
            error_ratio = float(((a - e).abs() / base).max())
            counts["chaotic_max_error_ratio"] = max(counts["chaotic_max_error_ratio"], error_ratio)
            counts["chaotic_tensors"].append(f"{what}: drift {drift:.1e}, largest magnitude {scale:.1e}")
            return
        allowed = base.clamp(min=wide)
        error = (a - e).abs()
        widened = wide > base
        counts["widened"] += int(widened.sum())
        counts["base"] += n - int(widened.sum())
        counts["beyond_base"] += int((error > base).sum())
        if bool(widened.any()):
            counts["max_widening"] = max(counts["max_widening"], float((wide / base[widened]).max()))
        finite = torch.isfinite(error)
        if bool(finite.any()):
            counts["max_error_ratio"] = max(counts["max_error_ratio"], float((error[finite] / base[finite]).max()))
        bad = ~(error <= allowed)  # NaN counts as a mismatch
        if bool(bad.any()):
            worst = int(torch.where(torch.isnan(error), torch.inf, error).argmax())
            self.errors.add(
                f"{what}: {int(bad.sum())} of {n} values differ; the largest at flat index {worst}: "
                f"{float(a.flatten()[worst]):.8g} vs reference {float(e.flatten()[worst]):.8g} (error "
                f"{float(error.flatten()[worst]):.2e}, allowed {float(allowed.flatten()[worst]):.2e} = max(base "
                f"rtol {RTOL:g}/atol {ATOL:g}, {DRIFT_K:g} x drift {drift:.1e}))"
            )


def run_case(case: dict[str, Any], rank: int, world: int, workdir: str) -> dict[str, Any]:
    """Train the case sharded on this rank beside the reference; returns {"errors": [...], "info": {...}}.

    Mismatches are collected, not raised: every rank runs the whole schedule, so the ranks' collectives stay in step.
    """
    errors = _Errors()
    comparison = _Comparison(errors)
    reference = Reference(case, world)
    probes = [Reference(case, world, probe=k) for k in range(1, PROBES + 1)]
    run = _Sharded(case)
    names = [n for n, _ in reference.model.named_parameters()]
    errors.equal("parameter names", [n for n, _ in run.model.named_parameters()], names)
    info: dict[str, Any] = {"units": [u.name for u in run.engine.units], "losses": [], "fault_where": []}
    checkpoint = case["options"]["checkpoint"]
    plan = schedule(case)
    for step in range(STEPS):
        comparison.begin_step(step)
        loss, evals = run.step(step, rank, world)
        ref_losses, ref_evals = reference.step(step)
        probe_steps = [probe.step(step) for probe in probes]
        info["losses"].append(loss)
        comparison.close(
            f"step {step}: loss of rank {rank}",
            loss,
            ref_losses[rank],
            [p_losses[rank] for p_losses, _ in probe_steps],
            widen=step > 0,
        )
        if step == 0:
            comparison.current["loss_at_base"] = True
        expected, params = reference.params(), run.params()
        probe_params = [probe.params() for probe in probes]
        for name in names:
            comparison.close(
                f"step {step}: parameter {name}", params[name], expected[name], [p[name] for p in probe_params]
            )
        own = _buffers(run.model)
        for name, value in reference.rank_buffers[rank].items():
            comparison.close(
                f"step {step}: buffer {name} of rank {rank}",
                own[name],
                value,
                [probe.rank_buffers[rank][name] for probe in probes],
            )
        for i in sorted(ref_evals):
            if i not in evals:
                errors.add(f"step {step}: eval forward {i} did not run")
                continue
            spec = plan["evals"][i]
            comparison.close(
                f"step {step}: output of eval forward {i} ({spec['where']}) on rank {rank}",
                evals[i],
                ref_evals[i][rank],
                [p_evals[i][rank] for _, p_evals in probe_steps],
            )
        if checkpoint is not None and checkpoint["after_step"] == step:
            info["fault_where"] += run.fault_where
            run = _round_trip(run, checkpoint["mode"], [reference, *probes], rank, world, workdir, errors, step)
    info["fault_where"] += run.fault_where
    errors.equal("where the injected faults raised", info["fault_where"], reference.fault_where[rank::world])
    info["comparison"] = comparison.steps
    return {"errors": list(errors), "info": info}


def _round_trip(
    run: _Sharded,
    mode: str,
    references: list[Reference],
    rank: int,
    world: int,
    workdir: str,
    errors: _Errors,
    step: int,
) -> _Sharded:
    """Save ``run`` in ``mode`` to real files, load into a freshly sharded copy (other initial values) and check that
    it holds exactly what was saved. Adjusts the reference's per-rank buffers to the format's semantics."""
    # The formats by module: each call below names the format it exercises.
    from lightning_fsdp.checkpoint import common, full, local, sharded

    params, optimizer_state, buffers = run.params(), run.optimizer_state(), _buffers(run.model)
    path = os.path.join(workdir, f"{mode}-step{step}" + (".pt" if mode == "full" else ".ckpt"))
    if mode == "full":
        state = {
            "state_dict": full.full_model_state_dict(run.engine),
            "optimizer_states": [full.full_optimizer_state_dict(run.engine, run.optimizer)],
            "global_step": step + 1,
        }
        if rank == 0:
            torch.save(state, path)
        dist.barrier()
    elif mode == "sharded":
        sharded.save_sharded_checkpoint(
            {
                "state_dict": sharded.sharded_model_state_dict(run.engine),
                "optimizer_states": [sharded.sharded_optimizer_state_dict(run.engine, run.optimizer)],
                "global_step": step + 1,
            },
            path,
        )
    else:
        local.save_local_checkpoint(
            {
                "state_dict": local.local_model_state_dict(run.engine),
                "optimizer_states": [local.local_optimizer_state_dict(run.optimizer)],
                "global_step": step + 1,
            },
            path,
            run.engine,
            [run.optimizer],
        )
    del run  # nothing of the saving run survives into the continuation
    fresh = _Sharded(references[0].case, seed_offset=1)
    if mode == "full":
        loaded = torch.load(path, weights_only=True)
        common.load_full_model_state_dict(fresh.engine, loaded["state_dict"])
        full.load_full_optimizer_state_dict(fresh.engine, fresh.optimizer, loaded["optimizer_states"][0])
    else:
        load = sharded.load_sharded_checkpoint if mode == "sharded" else local.load_local_checkpoint
        loaded = load(path, common.CheckpointRun(fresh.engine, [fresh.optimizer]))
        common.load_sharded_model_state_dict(fresh.engine, loaded["state_dict"])
        fresh.optimizer.load_state_dict(loaded["optimizer_states"][0])
    errors.equal("global_step", loaded["global_step"], step + 1)
    errors.equal(f"after the {mode} round trip: parameters", fresh.params(), params)
    errors.equal(f"after the {mode} round trip: optimizer state", fresh.optimizer_state(), optimizer_state)
    # Buffers. local: each rank gets its own back. full: rank 0's (it wrote the file). sharded: replicated tensors are
    # written once by DCP, by whichever rank its planner picks, so each buffer must be exactly one rank's value and
    # the same on every rank.
    after = _buffers(fresh.model)
    every_before: list[Any] = [None] * world
    every_after: list[Any] = [None] * world
    dist.all_gather_object(every_before, buffers)
    dist.all_gather_object(every_after, after)
    for name in buffers:
        if mode == "local":
            errors.equal(f"after the local round trip: buffer {name}", after[name], buffers[name])
            continue
        sources = [0] if mode == "full" else range(world)
        source = next((r for r in sources if torch.equal(after[name], every_before[r][name])), None)
        if source is None:
            errors.add(
                f"after the {mode} round trip: buffer {name} = {after[name]!r} is no rank's saved value "
                f"{[b[name] for b in every_before]}"
            )
            continue
        for r in range(world):
            errors.equal(f"after the {mode} round trip: buffer {name} on rank {r}", every_after[r][name], after[name])
        for reference in references:
            for r in range(world):
                reference.rank_buffers[r][name] = reference.rank_buffers[source][name].clone()
    return fresh


# ============================================================================================ strategies
FROZEN = st.sampled_from(["none", "none", "none", "all", "weight", "bias"])
TIE = st.none() | st.integers(0, 3)


def _leaf(kind: str, **fields: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries({"kind": st.just(kind), **fields})


LEAVES = st.one_of(
    _leaf("linear", bias=st.booleans(), tie=TIE, frozen=FROZEN),
    _leaf("tiedpair", bias=st.booleans(), frozen=FROZEN),
    _leaf("bottleneck", hidden=st.sampled_from([1, 2, 3]), bias=st.booleans(), frozen=FROZEN),
    _leaf("scalar", frozen=FROZEN),
    _leaf(
        "conv1d", channels=st.sampled_from([1, 3]), kernel=st.sampled_from([1, 3]), bias=st.booleans(), frozen=FROZEN
    ),
    _leaf(
        "conv2d",
        channels=st.sampled_from([1, 2]),
        kernel=st.sampled_from([[1, 1], [1, 3], [3, 3], [3, 1]]),
        bias=st.booleans(),
        frozen=FROZEN,
    ),
    _leaf("embedding", vocab=st.sampled_from([1, 2, 5]), frozen=FROZEN),
    _leaf("head", tie=TIE, frozen=FROZEN),
    _leaf("layernorm", affine=st.booleans(), bias=st.booleans(), frozen=FROZEN),
    _leaf("batchnorm", affine=st.booleans(), momentum=st.sampled_from([0.1, 0.5, None]), frozen=FROZEN),
    *([_leaf("raiser", frozen=FROZEN)] if "fault" in FEATURES else []),
)


def _containers(children: st.SearchStrategy, min_size: int = 1) -> st.SearchStrategy:
    kids = st.lists(children, min_size=min_size, max_size=4)
    return st.one_of(
        st.fixed_dictionaries({"kind": st.just("seq"), "children": kids}),
        st.fixed_dictionaries({"kind": st.just("list"), "children": kids}),
        st.fixed_dictionaries({"kind": st.just("block"), "children": kids, "scalar_skip": st.booleans()}),
        st.fixed_dictionaries({"kind": st.just("repeat"), "children": kids}),
        st.fixed_dictionaries(
            {"kind": st.just("branch"), "children": kids, "period": st.sampled_from([2, 3]), "phase": st.integers(0, 2)}
        ),
    )


# The body is always a container of at least two nodes: hypothesis favours the simplest draw (a single leaf) otherwise.
TREES = _containers(st.recursive(LEAVES, _containers, max_leaves=6), min_size=2)
CLASS_NAMES = st.lists(st.sampled_from(sorted(WRAP_CLASSES)), min_size=1, max_size=3, unique=True)
WRAPS = st.one_of(
    st.just({"kind": "none"}),
    st.fixed_dictionaries({"kind": st.just("classes"), "classes": CLASS_NAMES}),
    st.fixed_dictionaries({"kind": st.just("min"), "n": st.sampled_from([1, 4, 10, 30, 100])}),
    st.fixed_dictionaries({"kind": st.just("callable"), "classes": CLASS_NAMES, "n": st.sampled_from([1, 10, 30])}),
)
CHECKPOINTS = st.builds(
    lambda mode, step: None if mode is None else {"mode": mode, "after_step": step},
    st.sampled_from([None, "full", "sharded", "local"]),
    st.integers(0, STEPS - 2),
)


def _feature(name: str, strategy: st.SearchStrategy, off: Any) -> st.SearchStrategy:
    """``strategy`` if the feature is switched on (LIGHTNING_FSDP_PROPERTY_FEATURES), else always ``off``."""
    return strategy if name in FEATURES else st.just(off)


PREFETCH = _feature(
    "prefetch",
    st.none()
    | st.fixed_dictionaries(
        {
            "forward": st.booleans(),
            "backward": st.sampled_from(["BACKWARD_PRE", "BACKWARD_POST", None]),
            "limit": st.booleans(),
        }
    ),
    None,
)
OPTIONS = st.fixed_dictionaries(
    {
        "strategy": st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]),
        "wrap": WRAPS,
        "accumulate": st.sampled_from([1, 2]),
        "clip": st.sampled_from([None, 0.01, 0.1, 1.0]),
        "optimizer": st.sampled_from(["sgd", "adamw"]),
        "checkpoint": CHECKPOINTS,
        "prefetch": PREFETCH,
    }
)
FLIPS = _feature(
    "flips",
    st.lists(
        st.fixed_dictionaries(
            {"before_step": st.integers(0, STEPS - 1), "every": st.sampled_from([1, 2, 3]), "offset": st.integers(0, 2)}
        ),
        max_size=2,
    ),
    [],
)
FAULTS = _feature(
    "fault", st.none() | st.fixed_dictionaries({"step": st.integers(0, STEPS - 1), "micro": st.integers(0, 1)}), None
)
FORWARDS = _feature("forwards", st.sampled_from([1, 2]), 1)
EVALS = _feature(
    "evals",
    st.lists(
        st.fixed_dictionaries(
            {
                "step": st.integers(0, STEPS - 1),
                "where": st.sampled_from(["after_step", "before_backward"]),
                "grad": st.booleans(),
                "train": st.booleans(),
                "reverse": st.booleans(),
                "index": st.integers(0, 5),
            }
        ),
        max_size=2,
    ),
    [],
)
SCHEDULES = st.fixed_dictionaries({"flips": FLIPS, "fault": FAULTS, "forwards": FORWARDS, "evals": EVALS})
# Options and schedule first: hypothesis draws in this order and the (large) tree drawn first skewed the options to
# their simplest values.
CASES = st.fixed_dictionaries(
    {
        "options": OPTIONS,
        "schedule": SCHEDULES,
        "seed": st.integers(0, 2**16),
        "dim": st.sampled_from([3, 1, 4]),
        "tree": TREES,
    }
).map(
    lambda case: {
        "seed": case["seed"],
        "dim": case["dim"],
        "tree": case["tree"],
        "options": case["options"],
        "schedule": case["schedule"],
    }
)


def features_of(case: dict[str, Any]) -> list[str]:
    """The optional features a case uses (for the reports)."""
    plan, used = schedule(case), []
    if plan["flips"]:
        used.append("flips")
    if plan["fault"] is not None:
        used.append("fault")
    if plan["forwards"] > 1:
        used.append("forwards")
    if plan["evals"]:
        used.append("evals")
    if case["options"].get("prefetch"):
        used.append("prefetch")
    return used


def describe(case: dict[str, Any]) -> str:
    """The case as a short readable line per node, for failure messages."""
    lines = [f"seed={case['seed']} dim={case['dim']} options={case['options']}", f"schedule={schedule(case)}"]

    def walk(node: dict[str, Any], depth: int) -> None:
        fields = {k: v for k, v in node.items() if k not in ("kind", "children")}
        lines.append("  " * (depth + 1) + node["kind"] + (f" {fields}" if fields else ""))
        for child in node.get("children", []):
            walk(child, depth + 1)

    walk(case["tree"], 0)
    return "\n".join(lines)
