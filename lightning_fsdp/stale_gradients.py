"""The last optimizer step's gradients, freed before the next forward instead of after it.

[Note: Lightning's order keeps the last step's gradients through the forward]
Lightning's automatic optimization zeroes the gradients inside its closure, after ``training_step`` and before
``backward``, so that ``on_before_zero_grad`` can still see them. The gradients of the previous optimizer step are
therefore alive through the whole forward, beside its activations and its gathered units: at 0.84B parameters on 2
ranks that is 1.6 GiB per rank at the forward's peak (docs/benchmarks.md, "At scale"). torchtitan's loop zeroes before
the forward. Where nothing can tell the difference, the strategy makes the call Lightning would make,
``optimizer.zero_grad()``, at the start of ``training_step``; Lightning's own call then finds no gradients.

What could tell the difference keeps Lightning's order: an ``on_before_zero_grad`` of the module or of any callback
(it is called with the gradients still there), an overridden ``optimizer_zero_grad`` (the user decides what zeroing
means), manual optimization (the user zeroes), the batches that accumulate (Lightning zeroes only at the first batch
of each accumulation window) and a pipeline (its schedule runs the backward inside ``training_step``). What remains
visible is that code inside ``training_step`` reading ``.grad`` finds ``None`` where it found the previous step's
gradients: the same as in a loop that zeroes first.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.utilities.model_helpers import is_overridden


def release_stale_gradients(trainer: pl.Trainer | None, module: pl.LightningModule) -> bool:
    """``optimizer.zero_grad()`` now, where Lightning would call exactly that after this ``training_step`` and
    nothing observes the gradients in between. Returns whether it did."""
    if trainer is None or not trainer.training or not module.automatic_optimization or len(trainer.optimizers) != 1:
        return False
    if is_overridden("optimizer_zero_grad", module) or is_overridden("on_before_zero_grad", module):
        return False
    callbacks = getattr(trainer, "callbacks", [])  # set by Lightning's callback connector, not declared
    if any(is_overridden("on_before_zero_grad", callback, pl.Callback) for callback in callbacks):
        return False
    epoch_loop = trainer.fit_loop.epoch_loop
    if getattr(epoch_loop.automatic_optimization, "_skip_backward", False):
        return False
    accumulate = trainer.accumulate_grad_batches
    if accumulate > 1:
        if isinstance(getattr(trainer.fit_loop, "_data_fetcher", None), _DataLoaderIterDataFetcher):
            return False  # Lightning then takes the batch index from the fetcher, which the loop does not expose
        if epoch_loop.batch_idx % accumulate != 0:
            return False  # an accumulating batch: Lightning keeps the gradients
    trainer.optimizers[0].zero_grad()
    return True
