"""What the benchmark commands share: the GPT of a config, their command-line options, and what a report records
about the run (the command, the machine)."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

# An option that sets a config field: (field, parser of the value, help without the default). Each becomes
# --<field with dashes> and defaults to the field's default, so an option is declared once instead of three times
# (the flag, its default, the config argument).
ConfigOption = tuple[str, Callable[[str], Any], str]


def gpt_config(cfg: Any, **overrides: Any) -> Any:
    """The demo GPT of a benchmark config's ``layers``, ``width``, ``heads``, ``seq`` and ``vocab``, no dropout."""
    from lightning_fsdp.demo.gpt import GPTConfig

    return GPTConfig(
        vocab_size=cfg.vocab,
        block_size=cfg.seq,
        n_layer=cfg.layers,
        n_head=cfg.heads,
        n_embd=cfg.width,
        dropout=0.0,
        **overrides,
    )


def add_config_options(parser: argparse.ArgumentParser, defaults: Any, options: Sequence[ConfigOption]) -> None:
    for name, parse, text in options:
        default = getattr(defaults, name)
        # A list default is written the way the option takes it ("1,2,4"), not as Python prints it.
        shown = ",".join(map(str, default)) if isinstance(default, list) else "%(default)s"
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=parse, default=default, help=f"{text} (default {shown})"
        )


def config_fields(args: argparse.Namespace, options: Sequence[ConfigOption]) -> dict[str, Any]:
    """The config arguments that ``options`` parsed into ``args``."""
    return {name: getattr(args, name) for name, _, _ in options}


def command_line(module: str, argv: list[str] | None) -> str:
    """How the run was started, for its report: ``python -m module`` and the arguments."""
    args = sys.argv[1:] if argv is None else argv
    return (f"python -m {module} " + " ".join(shlex.quote(a) for a in args)).strip()


def machine() -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
