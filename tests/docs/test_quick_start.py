"""The Hugging Face quick start of README.md and docs/index.md runs as written on CPU, from the installed extras: the
commands the pages show are the same on both, their flags are the script's, the install line they follow installs
every package the script imports, and the CPU command itself (a tiny Llama, 2 processes) trains for ``--max-steps``
steps past the end of an epoch and exports weights that differ from the ones it started from."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import shlex
import sys
from pathlib import Path

from packaging.requirements import Requirement

from benchmarks.ranks import ROOT

EXAMPLE = ROOT / "examples" / "finetune_hf.py"
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md"]
COMMAND = "python examples/finetune_hf.py"


def _bash_lines(page: Path) -> list[str]:
    """The commands of the page's bash blocks, continuation lines joined and comments removed."""
    lines: list[str] = []
    for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), re.M | re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            command = line.split("  #", 1)[0].split(" # ", 1)[0].strip()
            if command:
                lines.append(" ".join(command.split()))
    return lines


def _quick_start(page: Path) -> tuple[list[str], list[str]]:
    """(pip install lines, finetune_hf.py commands) of the page, in order."""
    lines = _bash_lines(page)
    return [line for line in lines if line.startswith("pip install")], [
        line for line in lines if line.startswith(COMMAND)
    ]


def _example_module():
    spec = importlib.util.spec_from_file_location("finetune_hf_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the __main__ guard keeps it from training
    return module


def test_pages_show_the_same_quick_start_with_the_scripts_flags():
    commands = {page.name: _quick_start(page)[1] for page in PAGES}
    assert len(commands["README.md"]) == 2, commands  # the CPU command and the GPU one
    assert commands["README.md"] == commands["index.md"], commands
    example = _example_module()
    cpu, gpu = commands["README.md"]
    assert cpu == COMMAND
    defaults = example.parse_args([])
    # What the pages say the bare command does: 2 CPU processes, 20 steps, the tiny Llama, AdamW at 1e-5.
    assert (defaults.accelerator, defaults.devices, defaults.max_steps) == ("cpu", 2, 20)
    assert defaults.pretrained is None and defaults.lr == 1e-5 == example.LEARNING_RATE
    for page in PAGES:
        text = " ".join(page.read_text().split())
        assert "2 CPU processes" in text and "20 steps" in text and "--lr 1e-5" in text, page.name
    parsed = example.parse_args(shlex.split(gpu)[2:])  # every flag of the GPU command is one the script takes
    assert (parsed.accelerator, parsed.devices, parsed.precision) == ("gpu", 8, "bf16-mixed")
    assert parsed.activation_checkpointing and parsed.max_steps == 200 and parsed.pretrained == "path/to/llama"


def _distribution_of(module: str) -> str:
    names = importlib.metadata.packages_distributions().get(module)
    assert names, f"{module} is imported by {EXAMPLE.name} but installed by no distribution"
    return Requirement(names[0]).name.lower().replace("_", "-")


def test_the_install_line_installs_what_the_example_imports():
    """Each page installs the package with the hf extra before running the script, and the package's requirements
    (core, or the hf extra) name every third-party distribution the script imports."""
    for page in PAGES:
        installs, commands = _quick_start(page)
        assert commands and any(line == 'pip install -e ".[hf]"' for line in installs), (page.name, installs)
    provided: set[str] = set()
    for text in importlib.metadata.requires("lightning-fsdp") or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": "hf"}):
            provided.add(requirement.name.lower())
    assert {"torch", "lightning", "transformers", "safetensors"} <= provided, provided
    tree = ast.parse(EXAMPLE.read_text())
    top_level = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    top_level |= {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    }
    third_party = sorted(top_level - set(sys.stdlib_module_names) - {"__future__", "lightning_fsdp"})
    assert third_party == ["lightning", "torch", "transformers"], third_party
    for module in third_party:
        assert _distribution_of(module) in provided, module


def test_cpu_quick_start_runs_past_an_epoch_and_exports_trained_weights(tmp_path):
    """The pages' CPU command as written (2 CPU processes, the tiny Llama), with ``--max-steps 5`` on a text of
    2 steps per epoch: it trains 5 steps and ends with a from_pretrained directory whose every tensor moved."""
    import torch
    from safetensors.torch import load_file

    from benchmarks.ranks import clean_env, free_port
    from tests.toolbox.launch import run_command

    cpu_command = _quick_start(PAGES[0])[1][0]
    # 17 windows of 64 bytes: 9 per rank under Lightning's sampler, 2 batches of 4 per rank and epoch.
    text = tmp_path / "text.txt"
    text.write_text("0123456789abcdef" * 4 * 17 + "\n")
    out = tmp_path / "out"
    argv = [sys.executable, *shlex.split(cpu_command)[1:], "--max-steps", "5", "--text", str(text), "--out", str(out)]
    proc = run_command(argv, cwd=ROOT, env=clean_env(MASTER_PORT=str(free_port())), timeout=300)
    assert "after 5 steps (2 per epoch)" in proc.stdout, proc.stdout[-2000:]
    exported = load_file(out / "hf" / "model.safetensors")
    initial = load_file(out / "tiny-llama" / "model.safetensors")
    assert sorted(exported) == sorted(initial) and len(initial) > 10
    assert (out / "hf" / "config.json").is_file()
    changed = [name for name in initial if not torch.equal(exported[name], initial[name])]
    assert len(changed) == len(initial), sorted(set(initial) - set(changed))  # AdamW moved every tensor
