"""Choosing the units (torch FSDP's recursive auto-wrap) and the unit that owns each parameter: the innermost one
enclosing every module using it, so a tied weight is unsharded once, around all its uses."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from torch import nn

from lightning_fsdp.engine.options import WrapPolicy


class ParamUse(NamedTuple):
    """One place a module holds a parameter: ``module._parameters[attr]`` (several for tied weights)."""

    module: nn.Module
    attr: str


class ParamOwner(NamedTuple):
    """The unit module that owns a parameter, every place it is used, and its fully qualified name."""

    unit_module: nn.Module
    uses: list[ParamUse]
    fqn: str


def _named_by_policy(policy: WrapPolicy, module: nn.Module, nonwrapped_numel: int) -> bool:
    """Selected by class or by the policy function (as opposed to by size alone)."""
    return bool(policy.classes and isinstance(module, policy.classes)) or bool(
        policy.fn is not None and policy.fn(module, False, nonwrapped_numel)
    )


def _wants_wrap(policy: WrapPolicy, module: nn.Module, nonwrapped_numel: int) -> bool:
    return _named_by_policy(policy, module, nonwrapped_numel) or (
        policy.min_num_params is not None and nonwrapped_numel >= policy.min_num_params
    )


def _has_forward(module: nn.Module) -> bool:
    """False for containers such as ``nn.ModuleList`` / ``nn.ModuleDict`` that are never called themselves."""
    return type(module).forward is not nn.Module.forward


def select_unit_modules(root: nn.Module, policy: WrapPolicy, ignored: Iterable[nn.Module] = ()) -> list[nn.Module]:
    """Modules that become units, root first, then in module (pre-)order. As torch FSDP's recursive wrapping, children
    are decided first and a parent's ``nonwrapped_numel`` counts only parameters no wrapped descendant took."""
    ignored_ids = {id(m) for m in ignored}
    wrapped: set[int] = set()
    seen_params: set[int] = set()

    def visit(module: nn.Module) -> int:
        if id(module) in ignored_ids:
            return 0
        own = 0
        for p in module.parameters(recurse=False):
            if id(p) not in seen_params:
                seen_params.add(id(p))
                own += p.numel()
        total = own + sum(p.numel() for c in module.children() for p in c.parameters())
        remainder = own
        if policy.fn is None or policy.fn(module, True, total):  # recurse=True: whether to look inside
            for child in module.children():
                remainder += visit(child)
        else:
            remainder = total
        if module is not root and _wants_wrap(policy, module, remainder):
            if not _has_forward(module):
                if policy.min_num_params is not None and not _named_by_policy(policy, module, remainder):
                    return remainder  # a size rule skips containers, as torch's does; the parent takes them
                raise ValueError(
                    f"The wrap policy selects a {type(module).__name__}, which has no forward of its own: a unit's "
                    "hooks run around its forward, so it cannot be a unit. Wrap the modules inside it instead."
                )
            wrapped.add(id(module))
            return 0
        return remainder

    visit(root)
    return [root] + [m for m in root.modules() if id(m) in wrapped and m is not root]


def ignored_module_set(root: nn.Module, ignored: Iterable[nn.Module]) -> set[int]:
    """Ids of the ignored modules and everything below them."""
    ids: set[int] = set()
    for module in ignored:
        ids.update(id(m) for m in module.modules())
    return ids


def enclosing_units(
    root: nn.Module, unit_modules: list[nn.Module], ignored_ids: set[int] | frozenset[int] = frozenset()
) -> dict[int, list[nn.Module]]:
    """For every module below ``root`` that is not ignored (by id): the units enclosing it, outermost first (the
    root, which is always a unit, first; the module itself last if it is a unit). A module reached twice (shared
    by two parents) keeps the chain of its first place in module order, as ``root.modules()`` lists it once."""
    unit_ids = {id(m) for m in unit_modules}
    chains: dict[int, list[nn.Module]] = {}

    def walk(module: nn.Module, chain: list[nn.Module]) -> None:
        if id(module) in ignored_ids or id(module) in chains:
            return
        if id(module) in unit_ids:
            chain = chain + [module]
        chains[id(module)] = chain
        for child in module.children():
            walk(child, chain)

    walk(root, [])
    return chains


def assign_owners(
    root: nn.Module,
    unit_modules: list[nn.Module],
    ignored_ids: set[int],
    ignored_param_ids: frozenset[int] = frozenset(),
) -> dict[int, ParamOwner]:
    """Map each managed parameter (by id) to its owning unit module, its uses and its fully qualified name."""
    chains = enclosing_units(root, unit_modules, ignored_ids)
    names = {id(p): name for name, p in root.named_parameters()}
    uses: dict[int, list[ParamUse]] = {}
    owners: dict[int, list[nn.Module]] = {}
    for module in root.modules():
        if id(module) not in chains:
            continue
        for attr, param in module._parameters.items():
            if param is None or id(param) not in names or id(param) in ignored_param_ids:
                continue
            uses.setdefault(id(param), []).append(ParamUse(module, attr))
            chain = chains[id(module)]
            common = owners.get(id(param))
            if common is None:
                owners[id(param)] = chain
            else:
                k = 0
                while k < min(len(common), len(chain)) and common[k] is chain[k]:
                    k += 1
                owners[id(param)] = common[:k]
    return {pid: ParamOwner(owners[pid][-1], uses[pid], names[pid]) for pid in uses}
