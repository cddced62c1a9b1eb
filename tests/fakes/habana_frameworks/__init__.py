"""CPU test double of Intel Gaudi's ``habana_frameworks`` package, for machines without Gaudi software.

Put ``tests/fakes`` on ``sys.path`` (or ``PYTHONPATH``) and ``import habana_frameworks`` finds this package instead
of the real one. It provides the small surface that ``accelerators/`` and the FSDP strategy use:

- ``habana_frameworks.torch.hpu``: ``device_count()`` (from the environment variable ``FAKE_HPU_DEVICES``,
  default 2), ``is_available()``, ``memory_stats()``, ``set_device()``, ``current_device()``,
  ``get_device_name()``.
- ``habana_frameworks.torch.distributed.hccl``: importing it registers an ``"hccl"`` process-group backend that is
  gloo underneath, exactly as importing the real module registers the real HCCL backend.

A CPU build of torch cannot allocate tensors on an ``hpu`` device. So while this double is active
(``IS_TEST_DOUBLE`` below; ``accelerators.hpu_runtime.is_test_double()`` reads it) the strategy maps the compute of
``torch.device("hpu", i)`` onto CPU tensors, while device parsing, the eager-mode check and the ``"hccl"``
collectives go through the same code paths as on Gaudi.
"""

IS_TEST_DOUBLE = True
