"""The strategy's Lightning precision plugin: Trainer(precision=...) flags mapped onto the engine's mixed precision.
The table of flags is in docs/options.md. "-true" flags convert the module before it is sharded, as Lightning's
FSDPPrecision and HalfPrecision do, so shards, gradients and optimizer state are half precision."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import (
    ShardedGradScaler,  # also lightning_fsdp.precision.ShardedGradScaler
)
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.checkpoint import StateDict
from lightning_fsdp.engine import MixedPrecision, ShardingEngine

if TYPE_CHECKING:
    import lightning.pytorch as pl

_Flag = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]
_LOW_DTYPE: dict[str, torch.dtype] = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
}
SUPPORTED_PRECISION = ("32-true", *_LOW_DTYPE)


def _supported(precision: str) -> TypeGuard[_Flag]:
    return precision in SUPPORTED_PRECISION


def _grad_scaler(device_type: str) -> ShardedGradScaler:
    """torch's FSDP gradient scaler: every rank's inf/NaN verdict is all-reduced, so all skip the same steps (else
    shards diverge). ``process_group=None`` means the default group *at each step*: the scaler predates the group."""
    return ShardedGradScaler(device_type, process_group=None)


class FSDPPrecision(Precision):
    """Precision for fsdp_custom: clipping by the global norm across shards (docs/how-it-works.md)."""

    def __init__(self, precision: str = "32-true") -> None:
        if not _supported(precision):
            raise ValueError(
                f"precision={precision!r} is not supported by the fsdp_custom strategy; valid choices: "
                f"{', '.join(map(repr, SUPPORTED_PRECISION))}."
            )
        self.precision = precision
        self.engine: ShardingEngine | None = None  # set by the strategy once the model is sharded
        self.stage_group: dist.ProcessGroup | None = (
            None  # the pipeline group, with pipeline parallelism: clipping sees every stage
        )
        self.device_type = "cpu"  # set by the strategy from its root device
        self.scaler = _grad_scaler("cpu") if precision == "16-mixed" else None

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:
        dtype = _LOW_DTYPE.get(self.precision)
        if dtype is None:
            return None
        return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)

    def attach(self, engine: ShardingEngine, stage_group: dist.ProcessGroup | None, device_type: str) -> None:
        """The sharded model's engine, the pipeline group (or None) and the root device's type, set at setup."""
        self.engine = engine
        self.stage_group = stage_group
        self.device_type = device_type
        if self.scaler is not None:
            self.scaler = _grad_scaler(device_type)

    @property
    def _true_dtype(self) -> torch.dtype | None:
        """The dtype of every floating-point tensor under a "-true" flag; None otherwise."""
        return _LOW_DTYPE.get(self.precision) if self.precision.endswith("-true") else None

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        # Before sharding, so the shards (and so gradients and optimizer state) are half precision; meta tensors too.
        return module if self._true_dtype is None else module.to(dtype=self._true_dtype)

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._true_dtype is None else _DtypeContextManager(self._true_dtype)

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.precision.endswith("-mixed"):
            return torch.autocast(self.device_type, dtype=_LOW_DTYPE[self.precision])
        return self.tensor_init_context()  # tensors a "-true" forward creates are half precision too

    @override
    def convert_input(self, data: Any) -> Any:  # the user's batch
        if self._true_dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self._true_dtype)

    @override
    # As Lightning's own Precision.pre_backward, whose module is a LightningModule where fabric's base takes any module.
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    # As Lightning's own Precision.optimizer_step, which adds the model and the closure to fabric's base signature.
    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        # Unscale before clipping, so the global norm is taken of the true gradients.
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if not model.automatic_optimization or closure_result is not None:
            step_output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return step_output
        return closure_result

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.engine is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.engine.clip_grad_norm_(self.main_params(optimizer), clip_val, stage_group=self.stage_group)

    @override
    def state_dict(self) -> StateDict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: StateDict) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def to_fsdp_precision(plugin: Precision | None, mixed_precision: MixedPrecision | None = None) -> FSDPPrecision:
    """Our plugin for Lightning's ``Trainer(precision=...)`` choice, or a clear refusal (also of a double setting)."""
    if plugin is None or isinstance(plugin, FSDPPrecision):
        ours = plugin or FSDPPrecision()
    else:
        flag = getattr(plugin, "precision", None)
        if type(plugin) is Precision or flag in ("32-true", "32", 32):
            ours = FSDPPrecision("32-true")
        else:
            ours = FSDPPrecision(str(flag if flag is not None else type(plugin).__name__))
    if mixed_precision is not None and ours.precision != "32-true":
        raise ValueError(
            f"Trainer(precision={ours.precision!r}) and FSDPStrategy(mixed_precision=...) both set the "
            "precision; pass only one of them (precision='32-true' with an explicit MixedPrecision)."
        )
    return ours
