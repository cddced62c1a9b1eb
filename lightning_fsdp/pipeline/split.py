"""Cutting a model into pipeline stages without changing its code or its parameter names.

[Note: pieces, stages and views]
Pieces, ``AbsentPiece`` and the meta copy: docs/pipeline.md ("The contract", "How a step runs"). A stage is a run of
consecutive pieces; its *view* shares the stage's pieces in a shallow copy of the module tree, so torch's
``PipelineStage`` runs the model's own forward.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from itertools import accumulate

import torch
from torch import nn

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


class AbsentPiece(nn.Identity):
    """A piece that lives on another pipeline rank: passes its input through."""

    def extra_repr(self) -> str:
        return "on another pipeline stage"


def pipeline_pieces(model: nn.Module) -> list[str]:
    """The names of ``model``'s pieces in forward order (see [Note: pieces, stages and views])."""
    pieces: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS):
            _refuse_own_tensors(child, name)
            pieces.extend(f"{name}.{inner}" for inner, _ in child.named_children())
        else:
            pieces.append(name)
    _refuse_own_tensors(model, "")
    if not pieces:
        raise ValueError(f"{type(model).__name__} has no child modules to cut into pipeline stages.")
    return pieces


def _refuse_own_tensors(module: nn.Module, name: str) -> None:
    own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    if own:
        where = f"'{name}'" if name else "the model itself"
        raise ValueError(
            f"{[f'{name}.{n}' if name else n for n in own]} sit on {where}, not inside a child module: pipeline "
            "parallelism assigns whole child modules to stages. Move them into a submodule (for example the "
            "embedding or head that uses them)."
        )


def plan_stages(model: nn.Module, num_stages: int, split: Sequence[str] | None) -> list[list[str]]:
    """The pieces of each stage: cut before each name in ``split``, or balanced by parameter count."""
    pieces = pipeline_pieces(model)
    if len(pieces) < num_stages:
        raise ValueError(
            f"{type(model).__name__} has {len(pieces)} pieces ({pieces}) but {num_stages} pipeline stages were "
            "asked for; each stage needs at least one."
        )
    if split is None:
        sizes = [sum(p.numel() for p in model.get_submodule(name).parameters()) for name in pieces]
        cuts = _balanced_cuts(sizes, num_stages)
    else:
        unknown = [name for name in split if name not in pieces]
        if unknown:
            raise ValueError(
                f"pipeline_split names {unknown}, which are not pieces of {type(model).__name__}; a stage can "
                f"start at one of {pieces}."
            )
        cuts = [pieces.index(name) for name in split]
        if cuts != sorted(set(cuts)) or cuts[0] == 0:
            raise ValueError(
                f"pipeline_split={list(split)} must name pieces in forward order, without the first piece "
                f"'{pieces[0]}' (stage 0 starts there) and without repeats."
            )
    bounds = [0, *cuts, len(pieces)]
    stages = [pieces[a:b] for a, b in zip(bounds, bounds[1:])]
    _refuse_shared_parameters(model, stages)
    return stages


def _balanced_cuts(sizes: list[int], parts: int) -> list[int]:
    """Cut positions splitting ``sizes`` into ``parts`` consecutive runs with the smallest largest run (exact
    dynamic programme; ties broken towards earlier cuts, so the result is the same on every rank)."""
    n = len(sizes)
    prefix = [0, *accumulate(sizes)]
    inf = float("inf")
    # best[k][i]: the smallest largest run splitting the first i pieces into k runs; cut[k][i]: where the last starts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    cuts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        cuts.append(i)
    return sorted(cuts)[1:]


def _refuse_shared_parameters(model: nn.Module, stages: list[list[str]]) -> None:
    owner: dict[int, tuple[int, str]] = {}
    for index, names in enumerate(stages):
        for piece in names:
            for pname, param in model.get_submodule(piece).named_parameters(remove_duplicate=False):
                seen = owner.setdefault(id(param), (index, f"{piece}.{pname}"))
                if seen[0] != index:
                    raise ValueError(
                        f"'{seen[1]}' (stage {seen[0]}) and '{piece}.{pname}' (stage {index}) are one shared "
                        "parameter (tied weights); stages on different ranks cannot share a parameter. Untie it, or "
                        "cut so that both uses fall in one stage (pipeline_split)."
                    )


def keep_only(model: nn.Module, keep: Sequence[str]) -> None:
    """In place: every piece not in ``keep`` becomes an ``AbsentPiece`` (its memory is released)."""
    kept = set(keep)
    for name in pipeline_pieces(model):
        if name not in kept:
            model.set_submodule(name, AbsentPiece())


def stage_view(model: nn.Module, stage: Sequence[str]) -> nn.Module:
    """A shallow copy of ``model``'s tree that shares ``stage``'s pieces and has ``AbsentPiece`` elsewhere."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    # Hooks of its own: the model's (such as the guard against calling the split model directly) are not the view's.
    for name, value in vars(model).items():
        if "hooks" in name and isinstance(value, dict):
            setattr(view, name, type(value)())
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS):
            inner = copy.copy(child)
            inner._modules = dict(child._modules)
            view._modules[name] = inner
    keep_only(view, stage)  # replaces the view's entries only: the model and its containers were copied above
    return view


def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s module tree with every parameter and buffer on the meta device (no memory for the values)."""
    memo: dict[int, object] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)
