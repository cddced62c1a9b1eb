"""Random module trees and option sets for the property-based parity tests (tests/test_property.py), and the code
the pool's workers run for one case: sharded training on every rank beside an unsharded reference computed in the
same process, compared step by step.

A case is plain data (a dict), so it crosses multiprocessing queues and reads well in a failure report::

    {"seed": int, "dim": D, "tree": NODE, "options": OPTIONS}

    NODE: a container {"kind": "seq" | "list" | "block" | "repeat" | "branch", "children": [NODE, ...]} ("repeat"
          runs its children twice; "branch" also has "period" and "phase": it runs its children only on
          micro-batches whose running index i = step * accumulate + micro has i % period == phase, identically on
          every rank), or a leaf (see ``_build_leaf``):
          {"kind": "linear" | "tiedpair" | "bottleneck" | "scalar" | "conv1d" | "conv2d" | "embedding" | "layernorm" |
          "batchnorm" | "head", "frozen": "none" | "all" | "weight" | "bias", ...}; "linear" and "head" leaves may
          "tie" their weight to an earlier linear leaf's / embedding's weight (the same nn.Parameter); "tiedpair" is
          two Linear modules sharing a weight; "block" has a parameter of its own, 0-dim if "scalar_skip".
    OPTIONS: {"strategy": FULL_SHARD | SHARD_GRAD_OP | NO_SHARD, "wrap": {"kind": "none" | "classes" | "min" |
          "callable", ...}, "accumulate": 1 | 2, "clip": None | max-norm, "optimizer": "sgd" | "adamw",
          "checkpoint": None | {"mode": "full" | "sharded" | "local", "after_step": k}}

The model is ``Root``: ``out(body(x))`` with ``body`` built from the tree and ``out`` a trainable Linear(D, 2), so
every step has something to differentiate. Every leaf maps (B, D) -> (B, D); integer ids for embeddings reach the
leaves through a small context object the training loop fills (nn.Sequential passes one tensor only).

The reference is what data-parallel training must compute, run in one process on the same global batch: for each
micro-batch it runs every rank's chunk separately and back-propagates the mean of the ranks' losses. BatchNorm
normalises with each rank's own chunk statistics and every rank keeps its own running statistics (as torch's
FSDP does: it never synchronises buffers), so the reference keeps one copy of the buffers per rank and swaps it in
for that rank's chunk; rank r's buffers are compared with the reference's copy r.
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
RTOL, ATOL = 1e-5, 1e-6
MAX_ERRORS = 6


# ============================================================================================ the modules
class Context:
    """Per-forward data the training loop sets: the chunk's ids and which micro-batch this is."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.index = 0  # step * accumulate + micro: decides which branches run


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


class Block(nn.Module):
    """A container with a parameter of its own, 0-dim or of one row (fewer rows than ranks): ``chain(x) + skip * x``.
    """

    def __init__(self, children: list[nn.Module], scalar_skip: bool) -> None:
        super().__init__()
        for i, child in enumerate(children):
            self.add_module(f"c{i}", child)
        self.skip = nn.Parameter(torch.tensor(0.5) if scalar_skip else torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for child in self.children():
            h = child(h)
        return h + self.skip * x


class ListBlock(nn.Module):
    def __init__(self, children: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(children)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
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
        return self.out(self.body(x))


WRAP_CLASSES: dict[str, type[nn.Module]] = {
    cls.__name__: cls
    for cls in (Block, ListBlock, Repeat, Branch, nn.Sequential, ResLinear, Bottleneck, TiedPair, ScalarGate, Conv1dLeaf, Conv2dLeaf,
                EmbedLeaf, HeadLeaf,
                nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.BatchNorm1d)
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
                return ListBlock(children)
            if kind == "block":
                return Block(children, spec["scalar_skip"])
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
            return nn.LayerNorm(d, elementwise_affine=spec["affine"], bias=spec["bias"])
        if kind == "batchnorm":
            return nn.BatchNorm1d(d, momentum=spec["momentum"], affine=spec["affine"])
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
        out.append(t[rank * b:(rank + 1) * b])
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


# ============================================================================================ the reference
class Reference:
    """Unsharded training on the whole global batch in this process, one forward per rank's chunk."""

    def __init__(self, case: dict[str, Any], world: int, *, perturb: bool = False) -> None:
        self.case, self.world = case, world
        self.model, self.ctx = build_model(case)
        if perturb:
            # About one unit in the last place, with a random sign per element: the size of the rounding differences
            # between sharded and unsharded arithmetic (see run_case).
            g = torch.Generator().manual_seed(case["seed"])
            with torch.no_grad():
                for param in self.model.parameters():
                    sign = torch.randint(0, 2, param.shape, generator=g).to(param.dtype) * 2 - 1
                    param.mul_(1 + sign * torch.finfo(param.dtype).eps)
        self.rank_buffers = [_buffers(self.model) for _ in range(world)]
        self.optimizer = make_optimizer(self.model.parameters(), case["options"]["optimizer"])

    def step(self, step: int) -> list[float]:
        """One optimizer step; returns each rank's loss (summed over its micro-batches, each divided by accumulate)."""
        opts = self.case["options"]
        accumulate = opts["accumulate"]
        batch = global_batch(self.case, step)
        losses = [0.0] * self.world
        for micro in range(accumulate):
            self.ctx.index = step * accumulate + micro
            total = None
            for rank in range(self.world):
                _load_buffers(self.model, self.rank_buffers[rank])
                x, ids, y = chunk(batch, micro, accumulate, rank, self.world)
                loss = loss_fn(self.model(x, ids), y) / accumulate
                self.rank_buffers[rank] = _buffers(self.model)
                losses[rank] += loss.item()
                total = loss if total is None else total + loss
            (total / self.world).backward()
        if opts["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), opts["clip"])
        self.optimizer.step()
        self.optimizer.zero_grad()
        return losses

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}


# ============================================================================================ one case, sharded
class _Sharded:
    def __init__(self, case: dict[str, Any], seed_offset: int = 0) -> None:
        from lightning_fsdp.engine import fully_shard

        opts = case["options"]
        self.case = case
        self.model, self.ctx = build_model(case, seed_offset)
        self.engine = fully_shard(self.model, sharding_strategy=opts["strategy"],
                                  auto_wrap_policy=wrap_policy(opts["wrap"]))
        self.optimizer = make_optimizer(self.model.parameters(), opts["optimizer"])

    def step(self, step: int, rank: int, world: int) -> float:
        opts = self.case["options"]
        accumulate = opts["accumulate"]
        batch = global_batch(self.case, step)
        total = 0.0
        for micro in range(accumulate):
            self.ctx.index = step * accumulate + micro
            x, ids, y = chunk(batch, micro, accumulate, rank, world)
            loss = loss_fn(self.model(x, ids), y) / accumulate
            loss.backward()
            total += loss.item()
        if opts["clip"] is not None:
            self.engine.clip_grad_norm_(self.model.parameters(), opts["clip"])
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total

    def params(self) -> dict[str, torch.Tensor]:
        with self.engine.gathered():
            return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def optimizer_state(self) -> dict:
        from lightning_fsdp.checkpoint.full import full_optimizer_state_dict

        return full_optimizer_state_dict(self.engine, self.optimizer, rank0_only=False)


class _Errors(list):
    def close(self, what: str, actual: Any, expected: Any) -> None:
        actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
        try:
            torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
        except AssertionError as err:
            self.add(f"{what}: {str(err).strip()}")

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


def run_case(case: dict[str, Any], rank: int, world: int, workdir: str) -> dict[str, Any]:
    """Train the case sharded on this rank beside the reference; returns {"errors": [...], "info": {...}}.

    Mismatches are collected, not raised: every rank runs the whole schedule, so the ranks' collectives stay in step.
    """
    errors = _Errors()
    reference = Reference(case, world)
    probe = Reference(case, world, perturb=True)
    run = _Sharded(case)
    names = [n for n, _ in reference.model.named_parameters()]
    errors.equal("parameter names", [n for n, _ in run.model.named_parameters()], names)
    info: dict[str, Any] = {"units": [u.name for u in run.engine.units], "losses": [], "chaotic_from": None}
    checkpoint = case["options"]["checkpoint"]
    for step in range(STEPS):
        loss = run.step(step, rank, world)
        ref_losses = reference.step(step)
        probe_losses = probe.step(step)
        info["losses"].append(loss)
        expected = reference.params()
        if info["chaotic_from"] is None and not _well_conditioned(reference, probe, ref_losses, probe_losses, expected):
            info["chaotic_from"] = step
        if info["chaotic_from"] is None:
            errors.close(f"step {step}: loss of rank {rank}", loss, ref_losses[rank])
            params = run.params()
            for name in names:
                errors.close(f"step {step}: parameter {name}", params[name], expected[name])
            own = _buffers(run.model)
            for name, value in reference.rank_buffers[rank].items():
                errors.close(f"step {step}: buffer {name} of rank {rank}", own[name], value)
        if checkpoint is not None and checkpoint["after_step"] == step:
            run = _round_trip(run, checkpoint["mode"], [reference, probe], rank, world, workdir, errors, step)
    return {"errors": list(errors), "info": info}


def _well_conditioned(reference: Reference, probe: Reference, losses: list[float], probe_losses: list[float],
                      params: dict[str, torch.Tensor]) -> bool:
    """Whether fp32 arithmetic determines this step's results to well within the tolerances.

    Sharded and unsharded training round differently (gradients are summed across ranks in another order), so they
    agree to within RTOL/ATOL only where rounding-size differences stay small. Some random cases are chaotic: e.g.
    BatchNorm over a 2-sample chunk nearly equal in a feature, or AdamW dividing a gradient that is zero in exact
    arithmetic (a bias right before a normalisation) and pure rounding noise in fp32 by its own magnitude. There the
    unsharded run itself moves by more than the tolerance when its initial values move by one ulp. ``probe`` is that
    run; a step counts only if the probe stays within a tenth of the tolerances, and once a step does not count, no
    later step does (the comparison of the sharded run with the reference stops there; exact checks go on).
    """
    def near(a: Any, b: Any) -> bool:
        return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=RTOL / 10, atol=ATOL / 10)

    if not near(probe_losses, losses):
        return False
    probe_params = probe.params()
    if not all(near(probe_params[name], value) for name, value in params.items()):
        return False
    return all(near(p[name], r[name]) for p, r in zip(probe.rank_buffers, reference.rank_buffers) for name in r)


def _round_trip(run: _Sharded, mode: str, references: list[Reference], rank: int, world: int, workdir: str,
                errors: _Errors, step: int) -> _Sharded:
    """Save ``run`` in ``mode`` to real files, load into a freshly sharded copy (other initial values) and check that
    it holds exactly what was saved. Adjusts the reference's per-rank buffers to the format's semantics."""
    from lightning_fsdp.checkpoint.common import load_sharded_model_state_dict
    from lightning_fsdp.checkpoint.full import (
        full_model_state_dict,
        full_optimizer_state_dict,
        load_full_model_state_dict,
        load_full_optimizer_state_dict,
    )
    from lightning_fsdp.checkpoint.local import load_local_checkpoint, local_model_state_dict, \
        local_optimizer_state_dict, save_local_checkpoint
    from lightning_fsdp.checkpoint.sharded import load_sharded_checkpoint, save_sharded_checkpoint, \
        sharded_model_state_dict, sharded_optimizer_state_dict

    params, optimizer_state, buffers = run.params(), run.optimizer_state(), _buffers(run.model)
    path = os.path.join(workdir, f"{mode}-step{step}" + (".pt" if mode == "full" else ".ckpt"))
    if mode == "full":
        state = {"state_dict": full_model_state_dict(run.engine),
                 "optimizer_states": [full_optimizer_state_dict(run.engine, run.optimizer)], "global_step": step + 1}
        if rank == 0:
            torch.save(state, path)
        dist.barrier()
    elif mode == "sharded":
        save_sharded_checkpoint({"state_dict": sharded_model_state_dict(run.engine),
                                 "optimizer_states": [sharded_optimizer_state_dict(run.engine, run.optimizer)],
                                 "global_step": step + 1}, path)
    else:
        save_local_checkpoint({"state_dict": local_model_state_dict(run.engine),
                               "optimizer_states": [local_optimizer_state_dict(run.optimizer)],
                               "global_step": step + 1}, path, run.engine, [run.optimizer])
    del run  # nothing of the saving run survives into the continuation
    fresh = _Sharded(references[0].case, seed_offset=1)
    if mode == "full":
        loaded = torch.load(path, weights_only=True)
        load_full_model_state_dict(fresh.engine, loaded["state_dict"])
        load_full_optimizer_state_dict(fresh.engine, fresh.optimizer, loaded["optimizer_states"][0])
    else:
        load = load_sharded_checkpoint if mode == "sharded" else load_local_checkpoint
        loaded = load(path, fresh.engine, [fresh.optimizer])
        load_sharded_model_state_dict(fresh.engine, loaded["state_dict"])
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
            errors.add(f"after the {mode} round trip: buffer {name} = {after[name]!r} is no rank's saved value "
                       f"{[b[name] for b in every_before]}")
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
    _leaf("conv1d", channels=st.sampled_from([1, 3]), kernel=st.sampled_from([1, 3]), bias=st.booleans(),
          frozen=FROZEN),
    _leaf("conv2d", channels=st.sampled_from([1, 2]), kernel=st.sampled_from([[1, 1], [1, 3], [3, 3], [3, 1]]),
          bias=st.booleans(), frozen=FROZEN),
    _leaf("embedding", vocab=st.sampled_from([1, 2, 5]), frozen=FROZEN),
    _leaf("head", tie=TIE, frozen=FROZEN),
    _leaf("layernorm", affine=st.booleans(), bias=st.booleans(), frozen=FROZEN),
    _leaf("batchnorm", affine=st.booleans(), momentum=st.sampled_from([0.1, 0.5, None]), frozen=FROZEN),
)


def _containers(children: st.SearchStrategy, min_size: int = 1) -> st.SearchStrategy:
    kids = st.lists(children, min_size=min_size, max_size=4)
    return st.one_of(
        st.fixed_dictionaries({"kind": st.just("seq"), "children": kids}),
        st.fixed_dictionaries({"kind": st.just("list"), "children": kids}),
        st.fixed_dictionaries({"kind": st.just("block"), "children": kids, "scalar_skip": st.booleans()}),
        st.fixed_dictionaries({"kind": st.just("repeat"), "children": kids}),
        st.fixed_dictionaries({"kind": st.just("branch"), "children": kids, "period": st.sampled_from([2, 3]),
                               "phase": st.integers(0, 2)}),
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
CHECKPOINTS = st.builds(lambda mode, step: None if mode is None else {"mode": mode, "after_step": step},
                        st.sampled_from([None, "full", "sharded", "local"]), st.integers(0, STEPS - 2))
OPTIONS = st.fixed_dictionaries({
    "strategy": st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]),
    "wrap": WRAPS,
    "accumulate": st.sampled_from([1, 2]),
    "clip": st.sampled_from([None, 0.01, 0.1, 1.0]),
    "optimizer": st.sampled_from(["sgd", "adamw"]),
    "checkpoint": CHECKPOINTS,
})
# Options first: hypothesis draws in this order and the (large) tree drawn first skewed the options to their
# simplest values.
CASES = st.fixed_dictionaries({
    "options": OPTIONS,
    "seed": st.integers(0, 2**16),
    "dim": st.sampled_from([3, 1, 4]),
    "tree": TREES,
}).map(lambda case: {"seed": case["seed"], "dim": case["dim"], "tree": case["tree"], "options": case["options"]})


def describe(case: dict[str, Any]) -> str:
    """The case as a short readable line per node, for failure messages."""
    lines = [f"seed={case['seed']} dim={case['dim']} options={case['options']}"]

    def walk(node: dict[str, Any], depth: int) -> None:
        fields = {k: v for k, v in node.items() if k not in ("kind", "children")}
        lines.append("  " * (depth + 1) + node["kind"] + (f" {fields}" if fields else ""))
        for child in node.get("children", []):
            walk(child, depth + 1)

    walk(case["tree"], 0)
    return "\n".join(lines)

