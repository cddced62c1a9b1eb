"""Checking that a model's forward is a chain over its pieces, so that cutting it computes what it computed whole.

[Note: what the check catches]
On a later stage the absent pieces pass the stage input through, which is right only if each piece gets the latest
chain value and the forward's own code does nothing else with chain values (the three ways to break that:
docs/pipeline.md, "The contract"). The check runs on the meta copy: the pieces' hooks track the latest chain value
and a ``TorchFunctionMode`` sees every operation of the forward's own code, i.e. where values go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_fsdp.pipeline.split import AbsentPiece


class BrokenChainError(ValueError):
    """The model's forward is not a chain over its pieces at a cut (see [Note: what the check catches])."""


def tensors_in(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _ChainTracker(TorchFunctionMode):
    """Follows one stage's forward on the meta copy (see [Note: what the check catches])."""

    def __init__(self, stage: int, model_name: str, stage_input: tuple[object, ...]) -> None:
        super().__init__()
        self.stage = stage
        self.model_name = model_name
        self.latest: object = stage_input[0] if stage_input else None
        # Stand-ins: the values that on this stage take the place of what earlier stages computed (the stage input,
        # and the pass-through of it by absent pieces). Stage 0's input is the real input, not a stand-in.
        self.standins: set[int] = {id(t) for t in tensors_in(stage_input)} if stage else set()
        self.chain: set[int] = {id(t) for t in tensors_in(stage_input)}
        self.depth = 0  # pieces running: their own computation is not checked
        self.ran = False  # one of this stage's pieces has run
        self.passing = 0  # absent pieces run since then: the stage's output is being passed through

    def _fail(self, what: str) -> None:
        raise BrokenChainError(
            f"{self.model_name}'s forward is not a chain over its pieces at stage {self.stage}: {what}. A cut model "
            "computes this stage with the pieces of other stages replaced by a pass-through, which would give a "
            "different result without any error. Put the pieces whose outputs are combined into one module (for "
            "example token and position embeddings in one embedding module), or cut elsewhere (pipeline_split)."
        )

    def _is_latest(self, value: object) -> bool:
        latest = self.latest
        return value is latest or (isinstance(latest, tuple) and bool(latest) and value is latest[0])

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> Any:  # whatever the torch function returns
        result = func(*args, **(kwargs or {}))
        if self.depth or not tensors_in(result):
            return result  # inside a piece, or a query of sizes / dtypes / devices
        used = [t for t in tensors_in((args, kwargs)) if id(t) in self.chain]
        what = getattr(func, "__name__", repr(func))
        if any(id(t) in self.standins for t in used) and (not self.ran or not all(self._is_latest(t) for t in used)):
            self._fail(f"the forward's own code computes {what} with the values the earlier stages sent")
        if used and self.passing:
            self._fail(f"after the stage's last piece the forward's own code computes {what} with its output")
        return result

    def before_piece(self, name: str, module: nn.Module, args: tuple[object, ...]) -> None:
        if self.depth == 0 and isinstance(module, AbsentPiece) and (not self.ran or self.passing):
            # Before the stage's first piece, and after the first absent piece that follows its last one, absent pieces
            # must pass the chain on: each is given the previous piece's output.
            if not args or not self._is_latest(args[0]):
                self._fail(
                    f"piece '{name}' (on another stage) is given something other than the previous piece's output"
                )
        self.depth += 1

    def after_piece(self, module: nn.Module, output: object) -> None:
        self.depth -= 1
        if self.depth:
            return
        if isinstance(module, AbsentPiece):
            if self.ran:
                self.passing += 1
            else:
                self.standins.update(id(t) for t in tensors_in(output))
        else:
            if self.passing:
                self._fail(f"{type(module).__name__} runs after pieces of a later stage")
            self.ran = True
        self.latest = output
        self.chain.update(id(t) for t in tensors_in(output))


@contextmanager
def chain_checked(view: nn.Module, pieces: list[str], stage: int, stage_input: tuple[object, ...]) -> Iterator[None]:
    """Run ``view``'s forward inside this to check the chain contract for ``stage`` (``pieces``: all of them)."""
    tracker = _ChainTracker(stage, type(view).__name__, stage_input)
    handles = []
    for name in pieces:
        module = view.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: tracker.before_piece(name, m, a)))
        handles.append(module.register_forward_hook(lambda m, a, out: tracker.after_piece(m, out)))
    try:
        with tracker:
            yield
    finally:
        for handle in handles:
            handle.remove()
