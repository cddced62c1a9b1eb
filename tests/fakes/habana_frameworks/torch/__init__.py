"""Test double of ``habana_frameworks.torch``; see the package docstring of ``habana_frameworks``.

The ``hccl`` backend is not registered here: like the real bridge, that needs an explicit
``import habana_frameworks.torch.distributed.hccl``.
"""

from . import hpu  # noqa: F401  (the real package exposes `habana_frameworks.torch.hpu` as an attribute too)
