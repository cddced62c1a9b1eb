"""The demo workload, not library API: a small character GPT (``gpt``), its LightningModule (``module``) and its data
(``data``), used by the examples, the CLI configs, the benchmarks and the tests. It lives in the package so that every
launched rank can import it (docs/decisions.md); nothing is re-exported, so each class has one import path.
"""
