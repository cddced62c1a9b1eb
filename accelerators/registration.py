"""Registration of :class:`~accelerators.hpu.HPUAccelerator` under the name ``"hpu"`` in Lightning's registry."""

import logging

from lightning.fabric.accelerators.registry import _AcceleratorRegistry

from .hpu import HPUAccelerator

__all__ = ["register_hpu_accelerator"]

_log = logging.getLogger(__name__)


def register_hpu_accelerator(registry: _AcceleratorRegistry | None = None) -> bool:
    """Register :class:`HPUAccelerator` as ``"hpu"`` so that ``Trainer(accelerator="hpu")`` finds it, unless another
    package (e.g. ``lightning-habana``) holds the name: overriding it would silently change what its users get.

    Args:
        registry: the registry to fill; Lightning's global ``lightning.pytorch.accelerators.AcceleratorRegistry``
            by default.

    Returns:
        ``True`` if ``"hpu"`` now resolves to :class:`HPUAccelerator`, ``False`` if another class holds the name.
    """
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
