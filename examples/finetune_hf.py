"""Fine-tune a Hugging Face causal language model with fsdp_custom, from safetensors to safetensors.

    pip install -e ".[hf]"                             # transformers; once, so every rank can import it
    python examples/finetune_hf.py                     # CPU, 2 processes, a tiny Llama written on the spot, 20 steps
    python examples/finetune_hf.py --pretrained path/to/llama --accelerator gpu --devices 8 --precision bf16-mixed \
        --activation-checkpointing --max-steps 200

The model is built without weights (its parameters on the meta device), sharded one decoder layer per unit, filled
from the safetensors files with each rank reading only its rows, trained for ``--max-steps`` optimizer steps (the
data is reshuffled and repeated as often as that takes), saved as a sharded checkpoint, and exported by rank 0 as a
directory that ``from_pretrained`` loads. No rank ever holds the whole model. Each choice is explained in
docs/choosing-options.md.

``--pretrained`` is a ``save_pretrained`` directory (config.json, safetensors files, and a tokenizer for real text);
``--text`` a text file to train on instead of the bundled tiny-shakespeare excerpt.
Without it the script writes a 2-layer byte-level Llama to ``OUT/tiny-llama`` first, so the same file runs anywhere.
Lightning's launcher starts the other ranks by re-running this script, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # on CPU the ranks share the cores; set before torch is imported

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lightning_fsdp import FSDPStrategy, export_safetensors, load_pretrained  # noqa: E402
from lightning_fsdp.demo.data import default_text_path  # noqa: E402

# A usual rate for fine-tuning a pretrained Llama with AdamW; the tiny stand-in model learns little at it in 20 steps.
LEARNING_RATE = 1e-5
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrained", default=None, help="a save_pretrained directory (default: a tiny Llama)")
    parser.add_argument("--text", default=None, help="a UTF-8 text file to train on (default: tiny-shakespeare)")
    parser.add_argument("--out", default="finetune_hf_out", help="checkpoint, export and logs go here")
    parser.add_argument("--accelerator", default="cpu", help="cpu (default), gpu, hpu or auto")
    parser.add_argument("--devices", default="2", help="processes per node, or 'auto'")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, bf16-true, ...")
    parser.add_argument("--max-steps", type=int, default=20, help="optimizer steps, over as many epochs as needed")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE, help="AdamW learning rate (default %(default)s)")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute each decoder layer")
    args = parser.parse_args(argv)
    args.devices = args.devices if args.devices == "auto" else int(args.devices)
    return args


def write_tiny_llama(folder: Path) -> Path:
    """A 2-layer Llama over bytes (vocabulary 256) saved with ``save_pretrained``: the stand-in pretrained model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    if int(os.environ.get("LOCAL_RANK", 0)) != 0 or int(os.environ.get("NODE_RANK", 0)) != 0:
        # Under torchrun or SLURM every rank starts at once: wait for rank 0's rename instead of racing it.
        for _ in range(600):
            if (folder / "config.json").is_file():
                return folder
            time.sleep(0.1)
        raise TimeoutError(f"{folder} was not written by rank 0 within 60 s")
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    LlamaForCausalLM(config).save_pretrained(tmp)
    tmp.rename(folder)  # whole or absent: a rank that sees config.json sees the weights
    return folder


class TokenWindows(Dataset):
    """Consecutive windows of ``seq_len`` tokens of one long token sequence."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.seq_len : (i + 1) * self.seq_len]


def tokenise(pretrained: Path, text: str) -> torch.Tensor:
    """The text as token ids: with the model's tokenizer when the directory has one, else as bytes."""
    if (pretrained / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return torch.tensor(AutoTokenizer.from_pretrained(pretrained)(text)["input_ids"])
    return torch.tensor(list(text.encode()))


class CausalLMFineTune(L.LightningModule):
    def __init__(self, pretrained: Path, lr: float) -> None:
        super().__init__()
        self.pretrained, self.lr = pretrained, lr
        # Under trainer.init_module(empty_init=True) the parameters go to the meta device: nothing is allocated yet.
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pretrained))

    def on_fit_start(self) -> None:
        # Every rank, once the strategy has sharded the model: each reads only its rows of every tensor.
        load_pretrained(self.model, self.pretrained)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Built over the shards: AdamW's state is sharded as well.
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def decoder_layer_classes(pretrained: Path) -> set[type]:
    """The classes transformers itself keeps whole when it splits a model (``_no_split_modules``): its decoder
    layers, which are the natural FSDP units. Found on a meta-device copy, so nothing is allocated."""
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pretrained))
    names = set(probe._no_split_modules or ())
    classes = {type(m) for m in probe.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(probe).__name__} names no decoder layer class; pass auto_wrap_policy yourself")
    return classes


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    pretrained = Path(args.pretrained).resolve() if args.pretrained else write_tiny_llama(out / "tiny-llama")
    layers = decoder_layer_classes(pretrained)

    strategy = FSDPStrategy(
        auto_wrap_policy=layers,  # one unit per decoder layer: at most ~2 layers' full weights gathered at a time
        activation_checkpointing_policy=layers if args.activation_checkpointing else None,
        state_dict_type="sharded",  # each rank writes its own shards; loads at any world size
        weights_after_stage="sharded",  # keep the shards after fit for the save below: no rank gathers the model
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_epochs=-1,  # no epoch limit: max_steps alone ends training, however many epochs the data takes
        max_steps=args.max_steps,
        log_every_n_steps=5,
        default_root_dir=out,
        enable_checkpointing=False,  # saved once, below
        logger=False,
    )
    with trainer.init_module(empty_init=True):  # parameters on the meta device: no rank builds the full model
        module = CausalLMFineTune(pretrained, args.lr)

    text = Path(args.text) if args.text else default_text_path()
    data = TokenWindows(tokenise(pretrained, text.read_text(encoding="utf-8")), args.seq_len)
    trainer.fit(module, DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True))

    checkpoint = out / "checkpoint"
    trainer.save_checkpoint(checkpoint)  # a directory: every rank writes its shards (state_dict_type="sharded")
    if trainer.is_global_zero:
        # Reads the checkpoint one tensor at a time; the same as `lightning-fsdp export ... --strip-prefix model.`
        export_safetensors(checkpoint, out / "hf", prefix="model.", config=pretrained, overwrite=True)
        for name in TOKENIZER_FILES:  # so that the export is a complete from_pretrained directory
            if (pretrained / name).is_file():
                shutil.copy2(pretrained / name, out / "hf" / name)
        loss = trainer.callback_metrics.get("train_loss")
        print(
            f"final train_loss {float(loss):.4f} after {trainer.global_step} steps ({trainer.num_training_batches} "
            f"per epoch); from_pretrained directory: {out / 'hf'}"
        )


if __name__ == "__main__":
    main()
