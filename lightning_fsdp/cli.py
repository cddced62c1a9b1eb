"""The ``lightning-fsdp`` command (docs/cli.md); Lightning's launcher re-runs it once per extra rank."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_fsdp

__all__ = ["FSDPLightningCLI", "main"]

DEFAULT_STRATEGY = "fsdp_custom"
_CONVERT_MODULE = "lightning_fsdp.checkpoint.convert"
_EXPORT_MODULE = "lightning_fsdp.checkpoint.export"


class FSDPLightningCLI(LightningCLI):
    """``LightningCLI`` defaulting to ``strategy="fsdp_custom"``; a saved config's header names this version too."""

    def __init__(self, *args: Any, trainer_defaults: dict[str, Any] | None = None, **kwargs: Any) -> None:
        kwargs["trainer_defaults"] = {"strategy": DEFAULT_STRATEGY, **(trainer_defaults or {})}
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault(
            "dump_header", [f"lightning.pytorch=={pl.__version__}", f"lightning_fsdp=={lightning_fsdp.__version__}"]
        )
        return super().init_parser(**kwargs)

    def instantiate_classes(self) -> None:
        """Build the configured objects; a value their constructors refuse is reported like a bad argument (exit
        status 2, no traceback through jsonargparse unless ``LIGHTNING_FSDP_DEBUG=1`` or ``JSONARGPARSE_DEBUG=1``)."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, MisconfigurationException) as err:
            if _debug():
                raise
            print(
                f"{_PROG}: error: the configuration could not be instantiated: {_config_error_text(err)}\n"
                f"(set LIGHTNING_FSDP_DEBUG=1 to see the traceback)",
                file=sys.stderr,
            )
            sys.exit(2)


_PROG = "lightning-fsdp"


def _debug() -> bool:
    return any(
        os.environ.get(name, "").lower() not in ("", "0", "false", "no")
        for name in ("LIGHTNING_FSDP_DEBUG", "JSONARGPARSE_DEBUG")
    )


def _config_error_text(err: BaseException) -> str:
    """The error's message; for jsonargparse's "Does not validate against any of the Union subtypes" (a class given by
    class_path whose constructor refused a value) only the constructor's own message, without the namespace dump."""
    text = str(err)
    if "Union subtypes" not in text or "\nErrors:\n" not in text:
        return text
    body = text.split("\nErrors:\n", 1)[1].split("\nGiven value type:", 1)[0]
    reasons = [line.strip()[2:] for line in body.splitlines() if line.strip().startswith("- ")]
    reasons = [r for r in reasons if not r.startswith("Expected a <class")]
    return "; ".join(reasons) if reasons else text


def _entry(module_name: str) -> Callable[[list[str]], int | None] | None:
    """``module_name.main`` if that module exists; imported only when asked for."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:  # the module exists but one of its own imports failed: say so
            raise
        return None
    return getattr(module, "main", None)


def _convert_entry() -> Callable[[list[str]], int | None] | None:
    return _entry(_CONVERT_MODULE)


def main(args: Sequence[str] | None = None) -> int | None:
    """Run the command with ``args`` (default: ``sys.argv[1:]``); returns the exit status for ``sys.exit(main())``:
    ``convert``'s or ``export``'s, or ``None`` after a Lightning subcommand."""
    argv = list(sys.argv[1:] if args is None else args)
    subcommand = {"convert": _CONVERT_MODULE, "export": _EXPORT_MODULE}.get(argv[0]) if argv else None
    entry = _entry(subcommand) if subcommand is not None else None
    if entry is not None:
        # A subcommand's contract: main(argv: list[str]) -> int | None, parsing argv itself. One not installed falls
        # through, and LightningCLI reports it as an invalid choice with the valid ones.
        return entry(argv[1:])
    description = "Lightning's CLI with the fsdp_custom strategy (lightning-fsdp)."
    if _convert_entry() is not None:
        description += " Also: 'lightning-fsdp convert --help' converts checkpoints between formats."
    if _entry(_EXPORT_MODULE) is not None:
        description += " 'lightning-fsdp export --help' exports a checkpoint as a Hugging Face safetensors directory."
    FSDPLightningCLI(
        model_class=None,  # any LightningModule, by class_path
        datamodule_class=None,  # any LightningDataModule, by class_path (optional)
        # None lets LightningCLI read sys.argv itself (it warns when given both).
        args=None if args is None else argv,
        parser_kwargs={"description": description},
    )
    return None


if __name__ == "__main__":
    sys.exit(main())
