"""The shared test toolbox: what more than one test file needs, defined once.

- ``models``: the small models (ToyLM, ChainLM, Block) and the global batches they train on.
- ``training``: the training loop of the engine tests, for a rank's share of each batch or the whole batch.
- ``one_device``: the one-device references the sharded runs are compared with.
- ``distributed``: a function run in N gloo processes, each rank's result returned.
- ``launch``: test scripts and commands started in sessions of their own, and nothing left behind.
- ``fault_jobs``: jobs whose ranks report fault events (the fault and mpirun tests).
- ``lightning_scripts``: what the Lightning scripts in tests/scripts/ share (a quiet Trainer, ToyLM's module).
- ``s3``: a real S3-compatible server (moto) on 127.0.0.1 for the object-storage tests.
- ``compare``: named tensors and optimizer states compared, with a count of what was compared.
- ``safetensors_reads``: what a loader materialised from safetensors files, tensor by tensor (name and shape).
- ``tp_models``: tiny transformers and litgpt models for the tensor-parallel tests, and a model's tensors gathered
  in full (DTensors with ``full_tensor()``).

The process harness under ``launch`` and ``distributed`` is the benchmarks' own (benchmarks/ranks.py), imported from
there.
"""
