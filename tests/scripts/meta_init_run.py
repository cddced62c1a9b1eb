"""Meta-device initialisation of a pretrained Llama under fsdp_custom, several cases in one launch.

Run by tests/strategy/test_meta_init.py. Every case builds its model under ``trainer.init_module(empty_init=True)`` on
2 CPU ranks, with a fresh Trainer (the process group stays up between cases):

- ``walkthrough``: the code block of docs/pretrained.md's walk-through, run as written except for the pretrained
  path (``--pretrained-tied``) and ``max_steps`` (2), in the working directory the test gives the launch.
- ``no_init_fn`` / ``init_fn_ignores_buffers``: the walk-through's module, with no ``param_init_fn`` (tied model)
  or with one that zeroes each module's parameters and leaves its buffers alone (untied model). ``on_fit_start``
  records the tensors still uninitialised right after sharding, loads the pretrained files, records them again and
  the logits on ``fixed_batch()``; then one optimizer step.
- ``configure_model``: as ``no_init_fn`` (untied model), the Llama built in ``configure_model`` inside
  ``parameters_on_meta()`` (``configure_model`` alone builds real tensors).
- ``refused_at_step`` / ``refused_at_forward``: the same plus a parameter ``scale`` that nothing initialises (no
  ``param_init_fn``, the LightningModule has no ``reset_parameters``, the files do not hold it). The first is
  refused at the first optimizer step (Lightning steps before its closure runs the forward), the second at a
  forward of the LightningModule in ``on_fit_start``.

Each rank writes ``{case: {"ok": True, ...} | {"error": (type, message), ...}}`` to ``--out.rank{N}``, with
``seconds`` (from ``trainer.fit`` to its end or its error), ``global_step`` and ``training_steps`` (calls of
``training_step``).
"""

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from benchmarks.ranks import ROOT  # noqa: E402

WALKTHROUGH = os.path.join(ROOT, "docs", "pretrained.md")


def walkthrough_code(pretrained: str, max_steps: int) -> str:
    """The walk-through's code block from docs/pretrained.md, with ``PRETRAINED`` and ``max_steps`` replaced (each
    exactly once, so a changed walk-through fails here rather than running something else)."""
    with open(WALKTHROUGH) as f:
        text = f.read()
    section = text[text.index("## The walk-through") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    replacements = [
        ('PRETRAINED = "path/to/llama"', f"PRETRAINED = {pretrained!r}"),
        ("max_steps=100", f"max_steps={max_steps}"),
    ]
    for old, new in replacements:
        if code.count(old) != 1:
            raise AssertionError(f"docs/pretrained.md's walk-through holds {old!r} {code.count(old)} times, not once")
        code = code.replace(old, new)
    return code


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained-tied", required=True)
    parser.add_argument("--pretrained-untied", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_fsdp import FSDPStrategy, load_pretrained
    from lightning_fsdp.engine.meta_init import parameters_on_meta, uninitialised_names
    from tests.scripts.pretrained_run import VOCAB, fixed_batch
    from tests.toolbox.lightning_scripts import quiet_trainer, save_rank_results

    torch.set_num_threads(1)

    class FineTune(L.LightningModule):
        def __init__(self, config, pretrained: str, *, extra: bool, forward_at_start: bool, later: bool) -> None:
            super().__init__()
            self.config = config
            if not later:
                self.model = LlamaForCausalLM(config)
            if extra:  # nothing initialises it: no param_init_fn, no reset_parameters here, not in the files
                self.scale = torch.nn.Parameter(torch.ones(()))
            self.pretrained = pretrained
            self.forward_at_start = forward_at_start
            self.probes = {}
            self.training_steps = 0

        def configure_model(self) -> None:
            if not hasattr(self, "model"):  # configure_model builds real tensors: opt in to the meta device
                with parameters_on_meta():
                    self.model = LlamaForCausalLM(self.config)
                self.probes["params_on_meta"] = all(p.is_meta for p in self.parameters())
                self.probes["buffers_on_meta"] = [n for n, b in self.named_buffers() if b.is_meta]

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            logits = self.model(input_ids=ids).logits
            return logits * self.scale if hasattr(self, "scale") else logits

        def on_fit_start(self) -> None:
            self.probes["after_sharding"] = uninitialised_names(self)
            load_pretrained(self.model, self.pretrained)
            self.probes["after_load"] = uninitialised_names(self)
            if self.forward_at_start:
                with torch.no_grad():
                    self.probes["logits"] = self(fixed_batch()).cpu()

        def training_step(self, batch, _index):
            self.training_steps += 1
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            return loss * self.scale if hasattr(self, "scale") else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def zero_parameters(module: torch.nn.Module) -> None:
        # Initialises parameters (load_pretrained overwrites them) and leaves buffers as they are.
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                param.zero_()

    def trainer_for(param_init_fn) -> L.Trainer:
        return quiet_trainer(
            accelerator="cpu",
            devices=2,
            strategy=FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, param_init_fn=param_init_fn),
            max_steps=1,
        )

    cases = {
        # name: (pretrained, param_init_fn, extra parameter, forward in on_fit_start, model built in configure_model)
        "no_init_fn": (args.pretrained_tied, None, False, True, False),
        "init_fn_ignores_buffers": (args.pretrained_untied, zero_parameters, False, True, False),
        "configure_model": (args.pretrained_untied, None, False, True, True),
        "refused_at_step": (args.pretrained_tied, None, True, False, False),
        "refused_at_forward": (args.pretrained_tied, None, True, True, False),
    }
    results = {}
    rank = int(os.environ.get("LOCAL_RANK", 0))

    # The walk-through, as a user runs it (its __main__ block included).
    start = time.time()
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(walkthrough_code(args.pretrained_tied, 2), WALKTHROUGH, "exec"), namespace)
        trainer = namespace["trainer"]
        rank = trainer.global_rank
        results["walkthrough"] = {"ok": True, "global_step": trainer.global_step}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        results["walkthrough"] = {"error": (type(exc).__name__, str(exc))}
    results["walkthrough"]["seconds"] = time.time() - start

    data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(3))))
    for name, (pretrained, param_init_fn, extra, forward_at_start, later) in cases.items():
        trainer = trainer_for(param_init_fn)
        config = AutoConfig.from_pretrained(pretrained)
        with trainer.init_module(empty_init=True):
            module = FineTune(config, pretrained, extra=extra, forward_at_start=forward_at_start, later=later)
        built = {  # a model built in configure_model records these there
            "params_on_meta": all(p.is_meta for p in module.parameters()),
            "buffers_on_meta": [n for n, b in module.named_buffers() if b.is_meta],
        }
        start = time.time()
        try:
            trainer.fit(module, data)
            outcome = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            outcome = {"error": (type(exc).__name__, str(exc))}
        rank = trainer.global_rank
        results[name] = {
            **outcome,
            **built,
            **module.probes,
            "seconds": time.time() - start,
            "global_step": trainer.global_step,
            "training_steps": module.training_steps,
        }
    save_rank_results(results, args.out, rank)


if __name__ == "__main__":
    main()
