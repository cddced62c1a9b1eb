"""Registration of :class:`~accelerators.hpu.HPUAccelerator` under the name ``"hpu"`` in Lightning's registry."""

import logging

from lightning.fabric.accelerators.registry import _AcceleratorRegistry

from .hpu import HPUAccelerator

__all__ = ["register_hpu_accelerator"]

_log = logging.getLogger(__name__)


def register_hpu_accelerator(registry: _AcceleratorRegistry | None = None) -> bool:
    """Register :class:`HPUAccelerator` as ``"hpu"`` in ``registry`` (default: Lightning's) unless another package
    (``lightning-habana``) holds the name, which overriding would silently change for its users. Returns whether
    ``"hpu"`` now resolves to :class:`HPUAccelerator`."""
    if registry is None:
        from lightning.pytorch.accelerators import AcceleratorRegistry

        registry = AcceleratorRegistry
    name = HPUAccelerator.name()
    if name in registry:
        # Index the dict directly: the registry's `get` instantiates the accelerator instead of returning the entry.
        registered = registry[name]["accelerator"]
        if registered is HPUAccelerator:
            return True
        _log.debug("Leaving %r registered as %r in place; pass HPUAccelerator() explicitly.", registered, name)
        return False
    HPUAccelerator.register_accelerators(registry)
    return True
