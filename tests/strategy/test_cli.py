"""Lightning CLI: YAML configs that select the strategy by name and by class_path, the ``lightning-fsdp`` command,
and ``--print_config`` output that parses back unchanged.

Training runs start the example script or the command exactly as a user would (Lightning's launcher re-runs it for
rank 1), both at once (a module fixture; each in a folder of its own); parsing and ``--print_config`` run in this
process.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from benchmarks.ranks import ROOT
from lightning_fsdp import cli as fsdp_cli
from lightning_fsdp.demo.gpt import Block, CausalSelfAttention, GPTConfig
from lightning_fsdp.demo.module import GPTLightningModule
from lightning_fsdp.engine.options import MixedPrecision
from lightning_fsdp.estimate import estimate_memory
from tests.toolbox.launch import in_background, run_command

EXAMPLES = ROOT / "examples" / "cli"
TRAIN = EXAMPLES / "train.py"
TRAINER = str(EXAMPLES / "trainer_cpu.yaml")
GPT_SCRIPT = str(EXAMPLES / "gpt_tiny.yaml")  # model/data for examples/cli/train.py
GPT_COMMAND = str(EXAMPLES / "gpt_tiny_command.yaml")  # the same by class_path, for lightning-fsdp
BY_NAME = str(EXAMPLES / "strategy_by_name.yaml")
BY_CLASS = str(EXAMPLES / "strategy_by_class.yaml")
ACTIVATION_CHECKPOINTING = str(EXAMPLES / "strategy_activation_checkpointing.yaml")
# A short run: three optimizer steps, then one validation over the 64 validation samples, every step logged.
SHORT = [
    "--trainer.max_steps",
    "3",
    "--trainer.val_check_interval",
    "3",
    "--trainer.log_every_n_steps",
    "1",
    "--trainer.enable_progress_bar",
    "false",
]


def _tiny_gpt() -> GPTLightningModule:
    with torch.device("meta"):  # shapes are all the estimate needs
        return GPTLightningModule(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32)


# ------------------------------------------------------------------------------------------- in-process parsing
def _load_train_script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("examples_cli_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _print_config(capsys, monkeypatch, runner: str, *args: str) -> str:
    """What ``<runner> <args> --print_config`` prints; runner is the example script or the command."""
    if runner == "script":
        monkeypatch.setattr(sys, "argv", [str(TRAIN), *args, "--print_config"])
        run = _load_train_script().main
    else:
        monkeypatch.setattr(sys, "argv", ["lightning-fsdp", *args, "--print_config"])
        run = fsdp_cli.main
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run()
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


ROUND_TRIPS = [
    ("script", "fit", GPT_SCRIPT, BY_NAME),
    ("script", "fit", GPT_SCRIPT, BY_CLASS),
    ("command", "fit", GPT_COMMAND, BY_CLASS),
    ("command", "validate", GPT_COMMAND, BY_NAME),
    ("command", "test", GPT_COMMAND, BY_CLASS),
    ("command", "predict", GPT_COMMAND, BY_NAME),
]


@pytest.mark.parametrize(
    "runner,subcommand,model,strategy", ROUND_TRIPS, ids=[f"{r}-{s}-{Path(st).stem}" for r, s, _, st in ROUND_TRIPS]
)
def test_print_config_feeds_back_unchanged(capsys, monkeypatch, tmp_path, runner, subcommand, model, strategy):
    first = _print_config(
        capsys, monkeypatch, runner, subcommand, "--config", TRAINER, "--config", model, "--config", strategy
    )
    saved = tmp_path / "config.yaml"
    saved.write_text(first)
    second = _print_config(capsys, monkeypatch, runner, subcommand, "--config", str(saved))
    assert second == first
    # The values the configs set are in the output, not just defaults.
    assert "n_embd: 32" in first and "max_steps: 200" in first
    if strategy == BY_CLASS:
        assert "class_path: lightning_fsdp.FSDPStrategy" in first
        assert "auto_wrap_policy:\n      - lightning_fsdp.demo.gpt.Block" in first
        assert "state_dict_type: full" in first
    else:
        assert "strategy: fsdp_custom\n" in first


def test_command_defaults_to_the_fsdp_strategy_and_names_its_version(capsys, monkeypatch):
    out = _print_config(capsys, monkeypatch, "command", "fit", "--config", GPT_COMMAND)
    assert "strategy: fsdp_custom\n" in out
    assert "# lightning_fsdp==" in out


def test_command_offers_convert_only_when_the_converter_exists(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-fsdp"])  # the arguments come from main(args) alone
    real = fsdp_cli._convert_entry()
    if real is None:
        # Not installed: LightningCLI rejects it like any unknown subcommand and lists the valid ones.
        with pytest.raises(SystemExit):
            fsdp_cli.main(["convert", "in.ckpt", "out"])
        assert "invalid choice: 'convert'" in capsys.readouterr().err
    # With a converter module present, the rest of the command line is handed to its main().
    calls = []
    fake = types.ModuleType(fsdp_cli._CONVERT_MODULE)
    fake.main = lambda argv: calls.append(argv) or 0
    monkeypatch.setitem(sys.modules, fsdp_cli._CONVERT_MODULE, fake)
    assert fsdp_cli.main(["convert", "in.ckpt", "out", "--to", "full"]) == 0
    assert calls == [["in.ckpt", "out", "--to", "full"]]


def test_activation_checkpointing_policy_from_yaml(capsys, monkeypatch, tmp_path):
    configs = ["--config", TRAINER, "--config", GPT_SCRIPT, "--config", ACTIVATION_CHECKPOINTING]
    first = _print_config(capsys, monkeypatch, "script", "fit", *configs)
    saved = tmp_path / "config.yaml"
    saved.write_text(first)
    assert _print_config(capsys, monkeypatch, "script", "fit", "--config", str(saved)) == first
    # Instantiating the trainer builds the strategy with the policy (nothing is launched without a subcommand).
    from lightning.pytorch.cli import LightningCLI

    from lightning_fsdp.demo.data import CharDataModule

    monkeypatch.setattr(sys, "argv", [str(TRAIN)])  # the arguments come from args= alone
    built = LightningCLI(
        GPTLightningModule,
        CharDataModule,
        run=False,
        args=[*configs, "--trainer.logger", "false"],
    )
    policy = built.trainer.strategy.activation_checkpointing_policy
    with torch.device("meta"):
        config = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32)
        block, attention = Block(config), CausalSelfAttention(config)
    assert policy(block) and not policy(attention)


# ---------------------------------------------------------------------------------------------- training runs
def _run(args: list[str], cwd: Path) -> None:
    run_command([sys.executable, *args], cwd=cwd, timeout=240)


def _metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(row[name]) for row in rows if row.get(name)]


def _check_full_checkpoint(path: Path) -> None:
    """One file in Lightning's layout with the unwrapped model's names and full shapes."""
    checkpoint = torch.load(path, weights_only=True)
    reference = GPTLightningModule(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32).state_dict()
    assert {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()} == {
        k: tuple(v.shape) for k, v in reference.items()
    }
    assert checkpoint["global_step"] == 3
    assert checkpoint["hyper_parameters"]["n_embd"] == 32


COMMAND = ["-m", "lightning_fsdp.cli"]  # what the lightning-fsdp console script runs


def _fit_by_name(folder: Path) -> Path:
    _run([str(TRAIN), "fit", "--config", TRAINER, "--config", GPT_SCRIPT, "--config", BY_NAME, *SHORT], folder)
    return folder


def _fit_by_class_then_test(folder: Path) -> Path:
    """The command's fit, then its test from the fit's checkpoint in one process (it starts faster)."""
    _run([*COMMAND, "fit", "--config", TRAINER, "--config", GPT_COMMAND, "--config", BY_CLASS, *SHORT], folder)
    checkpoint = next((folder / "logs" / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt"))
    _run(
        [
            *COMMAND,
            "test",
            "--config",
            TRAINER,
            "--config",
            GPT_COMMAND,
            "--config",
            BY_CLASS,
            *SHORT,
            "--trainer.devices",
            "1",
            "--ckpt_path",
            str(checkpoint),
        ],
        folder,
    )
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Both training runs at once: ``{name: Future of the run's folder}``."""
    jobs = {
        "by name": functools.partial(_fit_by_name, tmp_path_factory.mktemp("by_name")),
        "by class": functools.partial(_fit_by_class_then_test, tmp_path_factory.mktemp("by_class")),
    }
    return in_background(jobs)


def test_fit_from_yaml_with_the_strategy_by_name(runs):
    run_dir = runs["by name"].result() / "logs" / "lightning_logs" / "version_0"
    rows = _metrics(run_dir)
    losses = _column(rows, "train_loss")
    assert len(losses) == 3 and losses[-1] < losses[0]
    # Defaults of the named strategy: FULL_SHARD with the root module as the only unit, which stays gathered
    # through the step (one all-gather per step) and holds the whole model while gathered.
    expected = estimate_memory(_tiny_gpt(), 2, "FULL_SHARD")
    assert expected.num_units == 1
    for rank in (0, 1):
        assert _column(rows, f"fsdp/rank{rank}/gathered_peak_bytes") == [expected.gathered_params] * 3
        assert _column(rows, f"fsdp/rank{rank}/all_gather_bytes") == [expected.all_gather_bytes] * 3
    _check_full_checkpoint(next((run_dir / "checkpoints").glob("*.ckpt")))


def test_command_fit_by_class_then_test_from_the_checkpoint(runs):
    folder = runs["by class"].result()
    run_dir = folder / "logs" / "lightning_logs" / "version_0"
    rows = _metrics(run_dir)
    assert len(_column(rows, "train_loss")) == 3
    # init_args reached the strategy: every Block is a unit (3 units), FULL_SHARD re-gathers them for backward (from
    # the second step on all but the last, whose backward comes next), and they are gathered in bfloat16 (half the
    # bytes) while gradients are reduced in float32.
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for rank in (0, 1):
        expected = estimate_memory(
            _tiny_gpt(), 2, "FULL_SHARD", auto_wrap_policy={Block}, mixed_precision=bf16, rank=rank
        )
        fp32 = estimate_memory(_tiny_gpt(), 2, "FULL_SHARD", auto_wrap_policy={Block}, rank=rank)
        assert expected.num_units == 3 and expected.gathered_params * 2 == fp32.gathered_params
        assert _column(rows, f"fsdp/rank{rank}/gathered_peak_bytes") == [expected.gathered_params] * 3
        # The estimate is the steady state; the first step, which records the order, gathers the last Block again
        # too: one more pass of a Block, the (identical) second Block's regather that FULL_SHARD adds to one pass.
        once = estimate_memory(
            _tiny_gpt(), 2, "SHARD_GRAD_OP", auto_wrap_policy={Block}, mixed_precision=bf16, rank=rank
        ).all_gather_bytes
        block = expected.all_gather_bytes - once
        first = expected.all_gather_bytes + block
        assert _column(rows, f"fsdp/rank{rank}/all_gather_bytes") == [first] + [expected.all_gather_bytes] * 2
        assert _column(rows, f"fsdp/rank{rank}/param_bytes") == [expected.params] * 3
        assert _column(rows, f"fsdp/rank{rank}/reduce_scatter_bytes") == [expected.reduce_scatter_bytes] * 3
    checkpoint = next((run_dir / "checkpoints").glob("*.ckpt"))
    _check_full_checkpoint(checkpoint)
    val_loss = _column(rows, "val_loss")
    assert len(val_loss) == 1

    # The checkpoint restored under the strategy reproduces the validation loss on the same 64 samples: validation
    # saw 4 batches of 8 per rank, the test runs in one process (it starts faster) over 8 batches of 8. Equal batch
    # sizes make both the mean over all 64.
    test_rows = _metrics(folder / "logs" / "lightning_logs" / "version_1")
    assert _column(test_rows, "test_loss") == pytest.approx(val_loss, rel=1e-4)
