"""Train the character GPT with Lightning's CLI and the fsdp_custom strategy, configured from YAML.

    python examples/cli/train.py fit --config examples/cli/trainer_cpu.yaml --config examples/cli/gpt_tiny.yaml \
        --config examples/cli/strategy_by_name.yaml
    python examples/cli/train.py fit ... --config examples/cli/strategy_by_class.yaml   # every option spelled out
    python examples/cli/train.py fit ... --print_config > run.yaml                      # the complete config
    python examples/cli/train.py test ... --ckpt_path path/to/checkpoint.ckpt

Configs compose: later files override earlier ones, and any value can be set on the command line
(``--trainer.max_steps 100``, ``--model.n_layer 4``). ``--help`` lists every option with its default.

The model and the data are fixed here (``--model.<arg>``, ``--data.<arg>``); the ``lightning-fsdp`` command takes any
LightningModule by ``class_path`` instead. Lightning's launcher re-runs this script once per extra rank, so it needs
lightning_fsdp importable (``pip install -e .``) and the ``__main__`` guard.
"""

import os

# One thread per process: the ranks share the machine's cores. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom" so that YAML can name it
from lightning_fsdp.demo.data import CharDataModule  # noqa: E402
from lightning_fsdp.demo.module import GPTLightningModule  # noqa: E402


def main() -> None:
    LightningCLI(GPTLightningModule, CharDataModule)


if __name__ == "__main__":
    main()
