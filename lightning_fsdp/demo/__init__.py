"""The demo workload: a small character GPT, its LightningModule and its data. Not part of the library's API.

The library (``lightning_fsdp``: the strategy, the engine, the checkpoint formats) shards any model. To show and
measure that it needs one concrete model to train, and this package is it:

- ``lightning_fsdp.demo.gpt``: ``GPT`` / ``GPTConfig`` / ``Block``, a GPT-2-style model in plain PyTorch whose
  ``Block`` is the natural FSDP unit (``auto_wrap_policy=[lightning_fsdp.demo.gpt.Block]``).
- ``lightning_fsdp.demo.module``: ``GPTLightningModule``, that model as a LightningModule with plain-typed
  arguments, so a Lightning CLI config can build it.
- ``lightning_fsdp.demo.data``: ``CharDataModule``, random character blocks from a text file, by default the
  tiny-shakespeare excerpt in ``assets/`` (package data).

Its users are ``examples/demo.py`` and the other scripts under ``examples/`` (the CLI configs in ``examples/cli/``,
the Slurm job), the benchmarks (``python -m benchmarks`` in a checkout) and the tests. It lives inside the package,
rather than under ``examples/``, so that every rank a launcher starts, and every benchmark worker, can import it once
the package is installed.

Nothing is re-exported here: each class has one import path, the one YAML configs name.
"""
