"""The strategy's Lightning precision plugin: Lightning's precision behaviour plus sharding-aware clipping."""

from __future__ import annotations

from typing import Any, Union

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

SUPPORTED_PRECISION = ("32-true",)


class FSDPPrecision(Precision):
    """Full precision (fp32) training with gradient clipping by the global norm across shards.

    ``torch.nn.utils.clip_grad_norm_`` on a rank's shards would see only that rank's part of the gradient and
    clip every rank by a different factor; this plugin asks the sharding engine for the norm an unsharded run
    computes and scales every shard by the same factor.
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"precision={precision!r} is not supported by the fsdp_custom strategy yet; valid choices: "
                f"{', '.join(map(repr, SUPPORTED_PRECISION))}."
            )
        self.precision = precision
        self.engine: Any = None  # set by the strategy once the model is sharded

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self.engine is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.engine.clip_grad_norm_(self.main_params(optimizer), clip_val)


def to_fsdp_precision(plugin: Precision | None) -> FSDPPrecision:
    """Map the plugin Lightning picked from ``Trainer(precision=...)`` onto ours, or refuse it clearly."""
    if plugin is None or isinstance(plugin, FSDPPrecision):
        return plugin or FSDPPrecision()
    flag = getattr(plugin, "precision", None)
    if type(plugin) is Precision or flag in ("32-true", "32", 32):
        return FSDPPrecision("32-true")
    return FSDPPrecision(str(flag if flag is not None else type(plugin).__name__))
