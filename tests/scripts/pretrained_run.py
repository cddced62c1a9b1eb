"""Fine-tune a pretrained Hugging Face Llama with fsdp_custom, as a user's script would
(tests/checkpoint/test_pretrained_load.py).

The LightningModule wraps ``LlamaForCausalLM(config)`` built under ``trainer.init_module(empty_init=True)`` (meta
device: no rank ever holds the full model); ``on_fit_start`` loads ``--pretrained`` (a ``save_pretrained``
directory) into the shards with ``load_pretrained``, and records the logits on ``fixed_batch()``. Then 3 steps of
SGD with momentum on 2 CPU ranks; after fit (the strategy hands back the full model) rank 0 records the trained
logits and saves ``--save`` with ``trainer.save_checkpoint`` (full format). Rank 0 writes the results to ``--out``.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

VOCAB, SEQ = 128, 8


def tiny_llama(tie: bool):
    """The pretrained model: a 2-layer Llama (hidden 32, 4 heads) with fixed random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # transformers' init leaves the norms at 1: make every tensor distinctive
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def fixed_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--save", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_fsdp import FSDPStrategy
    from lightning_fsdp.pretrained import load_pretrained
    from tests.toolbox.lightning_scripts import quiet_trainer

    torch.set_num_threads(1)

    class FineTune(L.LightningModule):
        def __init__(self, config) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)
            self.losses = []
            self.loaded_logits = None
            self.load_result = None

        def init_meta_module(self, module: torch.nn.Module) -> None:
            # fully_shard materialises meta modules one unit at a time with this (param_init_fn). Parameters are
            # overwritten by load_pretrained, so they are only zeroed here; the rotary embedding's inv_freq is a
            # buffer outside the state dict, so nothing loads it: it is computed again, by building that small
            # module afresh on the host (transformers >= 4.45 builds it from the config).
            with torch.no_grad():
                for param in module.parameters(recurse=False):
                    param.zero_()
                if module._buffers.get("inv_freq") is not None:
                    twin = type(module)(config=self.model.config)
                    for name, buffer in twin.named_buffers(recurse=False):
                        module._buffers[name].copy_(buffer)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).logits

        def on_fit_start(self) -> None:
            # The strategy has sharded the model (and built the optimizer over the shards) by now.
            self.load_result = load_pretrained(self.model, args.pretrained)
            with torch.no_grad():
                self.loaded_logits = self(fixed_batch()).cpu()  # through the LightningModule: the root unit's hooks

        def training_step(self, batch, _index):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(self.all_gather(loss.detach()).mean().item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    config = AutoConfig.from_pretrained(args.pretrained)
    module = None  # built below, after the Trainer whose strategy calls back into it

    strategy = FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, param_init_fn=lambda m: module.init_meta_module(m))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        use_distributed_sampler=False,
    )
    with trainer.init_module(empty_init=True):
        module = FineTune(config)
    assert module.model.model.embed_tokens.weight.is_meta
    g = torch.Generator().manual_seed(3)
    # The same global batch of 4 sequences at every step, so that 3 steps visibly lower its loss.
    data = TensorDataset(torch.randint(0, VOCAB, (4, SEQ), generator=g).repeat(args.steps, 1))
    sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    trainer.fit(module, DataLoader(data, batch_size=2, sampler=sampler))
    trainer.save_checkpoint(args.save)
    # After fit the strategy hands back the whole trained model on every rank.
    module.eval()
    with torch.no_grad():
        trained_logits = module(fixed_batch())
    if trainer.is_global_zero:
        torch.save(
            {
                "world_size": trainer.world_size,
                "tied": module.model.lm_head.weight is module.model.model.embed_tokens.weight,
                "load_result": tuple(module.load_result),
                "loaded_logits": module.loaded_logits,
                "trained_logits": trained_logits,
                "losses": module.losses,
            },
            args.out,
        )


if __name__ == "__main__":
    main()
