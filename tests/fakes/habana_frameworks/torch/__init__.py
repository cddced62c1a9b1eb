"""Test double of ``habana_frameworks.torch``; see the package docstring of ``habana_frameworks``.

The ``hccl`` backend is not registered here: like the real bridge, that needs an explicit
``import habana_frameworks.torch.distributed.hccl``. Importing this package registers the ``"hpu_backend"``
``torch.compile`` backend, as the real bridge does; the double's is torch's ``aot_eager`` (the graphs it gets run on
the CPU as traced), so it shows what reaches the backend, not what Gaudi's graph compiler does with it.
"""

from torch._dynamo import list_backends, lookup_backend, register_backend

from . import hpu  # noqa: F401  (the real package exposes `habana_frameworks.torch.hpu` as an attribute too)

if "hpu_backend" not in list_backends(exclude_tags=()):
    register_backend(lookup_backend("aot_eager"), name="hpu_backend")
