"""The manual's reference parts say what the code does: every option of docs/options.md (and the pipeline options of
docs/pipeline.md) exists on ``FSDPStrategy`` with the documented default, every public name and every exception a
user can catch is in docs/api.md, every flag of ``lightning-fsdp convert`` and ``export`` is in docs/cli.md, and the
code blocks marked ``<!-- docs-test: run -->`` run as written. In-process; tests/docs/test_docs_build.py builds the
site."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from datetime import timedelta

import pytest

import lightning_fsdp
from benchmarks.ranks import ROOT
from lightning_fsdp.strategy import FSDPStrategy

DOCS = ROOT / "docs"
RUN_MARK = "<!-- docs-test: run -->"

# Arguments the Trainer fills in; options.md names them in prose, not in the table.
TRAINER_FILLED = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")

# Defaults written as prose, each with the value the signature must hold. Anything else must be a Python literal in
# backticks. A prose default whose meaning is derived at run time is checked for that meaning below.
PROSE_DEFAULTS = {
    "Lightning's default (30 minutes)": timedelta(minutes=30),
    "from the accelerator": None,
    "stages": None,  # pipeline_microbatches: as many as stages
    "1, or 2 interleaved": None,  # pipeline_stages_per_rank
    "balanced": None,  # pipeline_split
}


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the first Markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def _documented_default(cell: str) -> object:
    if cell in PROSE_DEFAULTS:
        return PROSE_DEFAULTS[cell]
    match = re.match(r"`([^`]+)`", cell)
    assert match, f"default {cell!r} is neither a literal in backticks nor a known prose default"
    return ast.literal_eval(match.group(1))


def _documented_options() -> dict[str, object]:
    """option -> documented default, from options.md's table; its one row naming several pipeline options defers to
    pipeline.md's table, whose defaults are then used."""
    options_rows = _table_rows((DOCS / "options.md").read_text(), "| option | default | meaning |")
    pipeline_rows = _table_rows((DOCS / "pipeline.md").read_text(), "| option | default | meaning |")
    pipeline = {re.match(r"`(\w+)`", row[0]).group(1): row[1] for row in pipeline_rows}
    documented: dict[str, object] = {}
    for row in options_rows:
        names = re.findall(r"`(\w+)`", row[0])
        assert names, row
        if len(names) > 1:
            assert all(name in pipeline for name in names), f"{names}: a shared row must defer to pipeline.md's table"
            cells = [pipeline[name] for name in names]
        else:
            cells = [row[1]]
        for name, cell in zip(names, cells, strict=True):
            assert name not in documented, f"{name} is documented twice"
            documented[name] = _documented_default(cell)
    return documented


def test_every_documented_option_has_its_documented_default():
    documented = _documented_options()
    signature = inspect.signature(FSDPStrategy.__init__).parameters
    compared = 0
    for name, default in documented.items():
        assert name in signature, f"docs/options.md documents {name!r}, which FSDPStrategy does not take"
        assert signature[name].default == default, (name, signature[name].default, default)
        compared += 1
    assert compared == len(documented)
    # The table and the prose below it cover the whole signature: nothing undocumented.
    undocumented = set(signature) - {"self"} - set(documented) - set(TRAINER_FILLED)
    assert not undocumented, f"options missing from docs/options.md: {sorted(undocumented)}"
    prose = (DOCS / "options.md").read_text().split("\n\n")
    trainer_paragraph = next(p for p in prose if "filled in by the" in p)
    assert all(f"`{name}`" in trainer_paragraph for name in TRAINER_FILLED)
    assert compared >= 30  # the table is parsed, not skipped


def _documented_meanings() -> dict[str, tuple[str, str]]:
    """option -> (default cell, meaning cell) from options.md's table, the shared pipeline row taken from
    pipeline.md's table."""
    meanings = {}
    for page in ("options.md", "pipeline.md"):
        for row in _table_rows((DOCS / page).read_text(), "| option | default | meaning |"):
            names = re.findall(r"`(\w+)`", row[0])
            if len(names) == 1:
                meanings[names[0]] = (row[1], row[2])
    return meanings


def _docstring_arguments(obj: object) -> dict[str, str]:
    """name -> description of the Args section of ``obj``'s docstring, parsed as the API reference parses it
    (griffe, Google style)."""
    import griffe

    sections = griffe.Docstring(inspect.cleandoc(obj.__doc__ or ""), lineno=1).parse("google")
    found = [section for section in sections if section.kind.value == "parameters"]
    assert len(found) == 1, f"{obj!r}: one Args section expected"
    return {parameter.name: parameter.description for parameter in found[0].value}


def _plain(markdown: str) -> str:
    """Markdown as its words: links reduced to their text, whitespace collapsed, no final full stop."""
    return " ".join(re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", markdown).split()).rstrip(".")


def test_every_keyword_argument_is_documented_alike_in_the_docstring_and_options_page():
    """Each FSDPStrategy argument has an entry in the class docstring (what help(), IDEs and the API reference
    show); for an option of the table it says what the table says, meaning and default; for one the Trainer fills
    in, that the Trainer fills it in, as options.md's paragraph does."""
    signature = [name for name in inspect.signature(FSDPStrategy.__init__).parameters if name != "self"]
    docstring = _docstring_arguments(FSDPStrategy)
    assert list(docstring) == signature, "docstring arguments differ from the signature (or its order)"
    meanings = _documented_meanings()
    compared = 0
    for name in signature:
        if name in TRAINER_FILLED:
            assert docstring[name].startswith("filled in by the Trainer"), name
        else:
            default, meaning = meanings[name]
            assert _plain(docstring[name]) == f"{_plain(meaning)}. Default: {_plain(default)}", name
        compared += 1
    assert compared == len(signature) >= 35


@pytest.mark.parametrize(
    "function",
    [
        "engine.sharding.fully_shard",
        "pretrained.load_pretrained",
        "estimate.estimate_memory",
        "engine.sharding_engine.ShardingEngine.clip_grad_norm_",
    ],
)
def test_reference_functions_document_every_argument(function):
    """The functions the API reference documents argument by argument have an Args entry for each parameter, in
    the signature's order, none empty."""
    module, _, name = f"lightning_fsdp.{function}".partition(".ShardingEngine.")
    obj = getattr(_resolve(module + ".ShardingEngine"), name) if name else _resolve(module)
    signature = [parameter for parameter in inspect.signature(obj).parameters if parameter != "self"]
    documented = _docstring_arguments(obj)
    assert list(documented) == signature
    assert all(len(text.split()) >= 3 for text in documented.values()), documented


def test_prose_defaults_mean_what_they_say():
    import torch
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

    from lightning_fsdp.options import PipelineOptions

    assert default_pg_timeout == timedelta(minutes=30)  # "Lightning's default (30 minutes)"
    # "1, or 2 interleaved"; microbatches "stages"; split "balanced" (None: chosen by the balancing programme)
    assert PipelineOptions.parse(2, "1F1B").stages_per_rank == 1
    interleaved = PipelineOptions.parse(2, "Interleaved1F1B")
    assert interleaved.stages_per_rank == 2
    assert interleaved.num_microbatches == interleaved.num_stages == 4
    # "from the accelerator": the CPU accelerator's backend, gloo
    from lightning.pytorch.accelerators import CPUAccelerator

    strategy = FSDPStrategy(accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")] * 2)
    assert strategy.process_group_backend is None  # not fixed when built ...
    assert strategy._get_process_group_backend() == "gloo"  # ... but chosen from the device at setup


def test_mixed_precision_fields_are_documented():
    from dataclasses import fields

    from lightning_fsdp import MixedPrecision

    text = (DOCS / "options.md").read_text()
    documented = re.search(r"`MixedPrecision\(([^`]*)\)`", text).group(1)
    names = [name.strip() for name in documented.replace("\n", " ").split(",")]
    assert names == [f.name for f in fields(MixedPrecision)]


def _api_directives() -> list[str]:
    return re.findall(r"^::: ([\w.]+)", (DOCS / "api.md").read_text(), re.M)


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_public_name_is_in_the_api_reference():
    documented = [_resolve(d) for d in _api_directives()]
    public = lightning_fsdp.__all__
    missing = [name for name in public if not any(getattr(lightning_fsdp, name) is d for d in documented)]
    assert not missing, f"lightning_fsdp.__all__ names missing from docs/api.md: {missing}"
    assert len(public) >= 17  # the names were walked


def _package_exceptions() -> dict[str, type]:
    """Every exception class defined in the package (its modules imported), by qualified name."""
    found = {}
    for info in pkgutil.walk_packages(lightning_fsdp.__path__, "lightning_fsdp."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_exception_users_can_catch_is_in_the_api_reference():
    exceptions = _package_exceptions()
    documented = {_resolve(d) for d in _api_directives()}
    missing = sorted(name for name, cls in exceptions.items() if cls not in documented)
    assert not missing, f"exception classes missing from docs/api.md: {missing}"
    # The ones users meet in the troubleshooting and checkpoint pages, so the walk found the package's classes.
    names = {cls.__name__ for cls in exceptions.values()}
    for expected in ("UntrustedCheckpointError", "UninitialisedTensorError", "CheckpointMismatchError"):
        assert expected in names


@pytest.mark.parametrize("command", ["convert", "export"])
def test_every_cli_argument_is_in_the_cli_page(command):
    """docs/cli.md's section for the command has a table row for each argument of its parser, and no other; a row of
    an argument with choices names each choice."""
    parser = importlib.import_module(f"lightning_fsdp.checkpoint.{command}")._parser()
    text = (DOCS / "cli.md").read_text()
    heading = f"### `lightning-fsdp {command}`"
    assert heading in text, heading
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = {}
    for row in _table_rows(section, "| argument |"):
        rows[re.match(r"`([^`]+)`", row[0]).group(1)] = row[1]
    arguments = {}
    for action in parser._actions:
        if "--help" in action.option_strings:
            continue
        name = action.option_strings[-1] if action.option_strings else action.metavar
        arguments[name] = action
    assert set(rows) == set(arguments), (sorted(rows), sorted(arguments))
    compared = 0
    for name, action in arguments.items():
        for choice in action.choices or ():
            assert f"`{choice}`" in rows[name], (name, choice)
        compared += 1
    assert compared == len(rows) >= 5


def _marked_blocks() -> list[tuple[str, int, str]]:
    """(page, line, code) of every fenced python block right after a RUN_MARK line, in the docs and the README."""
    blocks = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != RUN_MARK:
                continue
            assert lines[i + 1].startswith("```python"), f"{page.name}:{i + 1}: {RUN_MARK} must precede a python block"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            blocks.append((page.relative_to(ROOT).as_posix(), i + 2, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


MARKED = _marked_blocks()


def test_the_marked_blocks_are_found():
    pages = {page for page, _, _ in MARKED}
    assert {"docs/choosing-options.md", "docs/migration.md"} <= pages, pages


@pytest.mark.parametrize("page,line,code", MARKED, ids=[f"{p}:{n}" for p, n, _ in MARKED])
def test_marked_block_runs(page, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # As a script would run it, guard included: a marked block must be complete and launch no processes.
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "__main__"})
