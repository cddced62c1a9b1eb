"""Peak host memory per rank: a pretrained ~100M-parameter Llama loaded the usual way or with load_pretrained; export.

    python examples/pretrained_memory.py --out /tmp/pretrained_memory

A ``transformers`` LlamaForCausalLM (hidden 768, 12 layers, MLP 2048, 12 heads, vocab 32000, tied embeddings:
about 110M parameters, fp32 random weights from a fixed seed, no download) is saved once with ``save_pretrained``
into ``--out/pretrained`` (and rounded to bfloat16 into ``--out/pretrained-bfloat16``). Then, each in fresh
processes, on 2 CPU gloo ranks under Lightning's Trainer with
``FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, param_init_fn=...)``:

  (a) the usual way: every rank builds the model with its weights (``LlamaForCausalLM.from_pretrained`` in the
      LightningModule's ``__init__``) and the strategy shards it at setup; measured at ``on_fit_start``;
  (b) ``load_pretrained``: the model is built under ``trainer.init_module(empty_init=True)`` (meta device), sharded,
      and ``load_pretrained(self.model, dir)`` in ``on_fit_start`` fills the shards; measured right after it.
      This run then takes one SGD step and saves a sharded checkpoint (``trainer.save_checkpoint`` with
      ``state_dict_type="sharded"``, in ``on_train_end``), measured around the save;
  (c) ``export_safetensors(checkpoint, out, prefix="model.")`` of that checkpoint, in one fresh process.

Peak memory is the growth of the peak resident set size: ``/proc/self/clear_refs`` (write "5") resets ``VmHWM`` to
the current RSS just before the measured part, and ``VmHWM`` minus that level is read at its end (``ru_maxrss``
cannot be reset, so it would report the largest peak since the process started). RSS counts the pages of a file
mapped into the process, which safetensors reads through (``mmap``): pages of the page cache, shared by the ranks
and reclaimable. So the table also gives the private memory (``RssAnon``; sampled, see ``PeakGrowth``), and the
same two loads of the weights rounded to bfloat16 into the float32 model: a cast, so ``from_pretrained`` must
build the whole model in private memory on every rank, where a float32 file it can leave mapped. Before printing
the table the
script checks that (a) and (b) hold the same model: the same checksums of every parameter (gathered in full on
rank 0) as the saved files, and the same logits on a fixed batch; and that the export holds the trained weights.

Two more measurements of the same Llama, built under ``trainer.init_module(empty_init=True)`` (no files), trained for
2 AdamW steps on 2 ranks, each choice in fresh processes:

    python examples/pretrained_memory.py --out /tmp/pretrained_memory --measure stage-end
    python examples/pretrained_memory.py --out /tmp/pretrained_memory --measure precision

  (d) ``stage-end``: the end of ``fit`` under each ``weights_after_stage``: peak RSS growth from ``on_train_end`` to
      the return of ``trainer.fit`` (the strategy's teardown is the work in between), and what the module holds;
  (e) ``precision``: ``bf16-mixed`` against ``bf16-true``: the bytes of the optimizer's parameters, their gradients
      and its state on each rank in ``on_train_end``, and the peak RSS growth from before the model is built to then.

The Trainer's launcher re-runs this script for rank 1 with the same arguments (``--role``), as any Lightning
script; the measured runs are started here as subprocesses in their own session, killed as a group on timeout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.memory import PeakGrowth  # noqa: E402

# ~110M parameters: embeddings 32000 x 768 (tied with the head) + 12 layers of 7.1M.
LLAMA = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
SEED = 0
SEQ = 16
ROLES = ("usual", "loader", "export", "stage-end", "precision")
VARIANTS = {"stage-end": ("full", "rank0", "sharded"), "precision": ("bf16-mixed", "bf16-true")}
# The fp32 file is the brief's case. Hub models mostly ship in bfloat16 and are often fine-tuned in float32: then
# from_pretrained must cast, so it cannot map the file's pages as the model's tensors.
FILE_DTYPES = ("float32", "bfloat16")
MiB = 2**20


# ------------------------------------------------------------------------------------------------ measuring
def checksums(state) -> dict[str, tuple]:
    """Per tensor: shape, float64 sum, float64 sum of squares and the first 4 values. Computed with one thread in
    every process, the same values give the same sums bit for bit, so equality is tested exactly."""
    import torch

    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        flat = value.detach().reshape(-1).double()
        out[key] = (tuple(value.shape), flat.sum().item(), flat.square().sum().item(), flat[:4].tolist())
    return out


def fixed_batch():
    import torch

    return torch.randint(0, LLAMA["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(7))


# ------------------------------------------------------------------------------------------------ (a), (b)
def run_lightning(args: argparse.Namespace) -> None:
    """One rank of run (a) ``usual`` or (b) ``loader`` of the ``--file-dtype`` file into a float32 model; writes
    ``results/<role>-<file dtype>-rank<r>.pt``. The float32 loader run also trains a step and saves the checkpoint."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_fsdp import FSDPStrategy
    from lightning_fsdp.checkpoint.full import full_model_state_dict
    from lightning_fsdp.pretrained import load_pretrained

    torch.set_num_threads(1)
    pretrained = pretrained_dir(args.out, args.file_dtype)
    save = args.role == "loader" and args.file_dtype == "float32"
    checkpoint_dir = os.path.join(args.out, "checkpoint")
    meter = PeakGrowth()
    usual = args.role == "usual"

    class FineTune(L.LightningModule):
        def __init__(self, config) -> None:
            super().__init__()
            if usual:  # every rank reads the whole model
                self.model = LlamaForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
            else:  # built under trainer.init_module(empty_init=True): on the meta device
                self.model = LlamaForCausalLM(config)
            self.result = {}

        def init_meta_module(self, module: torch.nn.Module) -> None:
            # As in tests/scripts/pretrained_run.py: parameters are overwritten by load_pretrained, so only zeroed
            # here; the rotary embedding's inv_freq is a buffer outside the state dict, computed again by building
            # that small module afresh.
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
            # The strategy has sharded the model by now.
            if not usual:
                load_pretrained(self.model, pretrained)
            self.result["load_peak"] = meter.stop()
            self.result["shard_bytes"] = sum(p.numel() * p.element_size() for p in self.parameters())
            # Not measured: what the model holds, to compare (a) with (b) and with the files.
            state = full_model_state_dict(self.trainer.strategy.engine)  # rank 0 only
            if self.trainer.is_global_zero:
                self.result["loaded"] = checksums({k.removeprefix("model."): v for k, v in state.items()})
            del state
            with torch.no_grad():
                self.result["logits"] = self(fixed_batch()).cpu()

        def training_step(self, batch, _index):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def on_train_end(self) -> None:
            if not save:
                return
            meter.start()
            self.trainer.save_checkpoint(checkpoint_dir)
            self.result["save_peak"] = meter.stop()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    config = AutoConfig.from_pretrained(pretrained_dir(args.out, "float32"))  # the float32 model
    module = None  # built below, after the Trainer whose strategy calls back into it
    strategy = FSDPStrategy(
        auto_wrap_policy={LlamaDecoderLayer},
        param_init_fn=lambda m: module.init_meta_module(m),
        state_dict_type="sharded",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    meter.start()  # the level before the model is built
    if usual:
        module = FineTune(config)
    else:
        with trainer.init_module(empty_init=True):
            module = FineTune(config)
        assert module.model.model.embed_tokens.weight.is_meta
    assert module.model.model.embed_tokens.weight.dtype == torch.float32
    data = TensorDataset(torch.randint(0, LLAMA["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(3)))
    trainer.fit(module, DataLoader(data, batch_size=1))
    # After fit the strategy hands back the whole trained model on every rank.
    if trainer.is_global_zero and save:
        module.result["trained"] = checksums(module.model.state_dict())
    name = f"{args.role}-{args.file_dtype}-rank{trainer.global_rank}.pt"
    torch.save(module.result, os.path.join(args.out, "results", name))


# ------------------------------------------------------------------------------------------------ (d), (e)
def run_trained(args: argparse.Namespace) -> None:
    """One rank of (d) (``--variant``: a ``weights_after_stage`` choice) or (e) (``--variant``: a precision flag);
    writes ``results/<role>-<variant>-rank<r>.pt``."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_fsdp import FSDPStrategy
    from lightning_fsdp.engine import get_engine

    torch.set_num_threads(1)
    stage_end = args.role == "stage-end"
    meter = PeakGrowth()

    def init_weights(module: torch.nn.Module) -> None:  # param_init_fn: values do not matter here, only sizes
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                param.normal_(0, 0.02) if param.dim() > 1 else param.fill_(1.0)

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)

    class Train(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(LlamaConfig(**LLAMA))
            self.result = {}

        def training_step(self, batch, _index):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def on_train_end(self) -> None:
            optimizer = self.trainer.optimizers[0]
            params = [p for group in optimizer.param_groups for p in group["params"]]
            states = [t for p in params for t in optimizer.state[p].values() if isinstance(t, torch.Tensor)]
            self.result["bytes"] = {
                "param": nbytes(params),
                "grad": nbytes(p.grad for p in params if p.grad is not None),
                "state": nbytes(states),
            }
            self.result["dtypes"] = sorted({str(t.dtype) for t in (*params, *states) if t.numel() > 1})
            if stage_end:
                meter.start()  # the level before the stage ends
            else:
                self.result["peak"] = meter.stop()

    options = {"weights_after_stage": args.variant} if stage_end else {}
    strategy = FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, param_init_fn=init_weights, **options)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        precision="32-true" if stage_end else args.variant,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if not stage_end:
        meter.start()  # the level before the model is built
    with trainer.init_module(empty_init=True):
        module = Train()
    data = TensorDataset(torch.randint(0, LLAMA["vocab_size"], (4, SEQ), generator=torch.Generator().manual_seed(3)))
    trainer.fit(module, DataLoader(data, batch_size=1))
    if stage_end:
        module.result["peak"] = meter.stop()
        module.result["holds"] = {
            "engine": get_engine(module) is not None,
            "devices": sorted({str(p.device) for p in module.parameters()}),
            "param_bytes": nbytes(module.parameters()),
        }
    name = f"{args.role}-{args.variant}-rank{trainer.global_rank}.pt"
    torch.save(module.result, os.path.join(args.out, "results", name))


def report_trained(out: str, measure: str) -> None:
    import torch

    runs = {
        v: [torch.load(os.path.join(out, "results", f"{measure}-{v}-rank{r}.pt"), weights_only=False) for r in (0, 1)]
        for v in VARIANTS[measure]
    }
    full = sum(rank["bytes"]["param"] for rank in runs[VARIANTS[measure][0]])  # fp32 shards, both ranks
    print()
    print(
        f"Llama 110M ({full / MiB:.0f} MiB of fp32 parameters), 2 CPU gloo ranks, FULL_SHARD with LlamaDecoderLayer "
        "units, built under "
        "trainer.init_module(empty_init=True), 2 AdamW steps. Peak RSS growth = VmHWM (reset by writing 5 to "
        "/proc/self/clear_refs) minus the RSS at the reset; private = RssAnon growth sampled every 1 ms; held = RSS "
        "at the end minus at the reset. Per rank."
    )
    print()
    if measure == "stage-end":
        print("Measured from on_train_end to the return of trainer.fit (the strategy's teardown in between).")
        print()
        print("| weights_after_stage | rank | peak RSS growth (MiB) | peak private growth (MiB) | held (MiB) | holds |")
        print("| --- | --- | --- | --- | --- | --- |")
        for variant, ranks in runs.items():
            for rank, result in enumerate(ranks):
                peak, holds = result["peak"], result["holds"]
                what = "engine (shards)" if holds["engine"] else ", ".join(holds["devices"]) + " parameters"
                what += f", {holds['param_bytes'] / MiB:.0f} MiB of parameter data"
                cells = " | ".join(f"{peak[k] / MiB:.0f}" for k in ("rss", "anon", "held"))
                print(f"| `{variant}` | {rank} | {cells} | {what} |")
    else:
        print("Bytes in on_train_end (after 2 steps); peak growth from before the model is built to then.")
        print()
        print(
            "| precision | rank | parameters (MiB) | gradients (MiB) | optimizer state (MiB) | total (MiB) "
            "| dtypes | peak RSS growth (MiB) | peak private growth (MiB) |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for variant, ranks in runs.items():
            for rank, result in enumerate(ranks):
                b, peak = result["bytes"], result["peak"]
                total = b["param"] + b["grad"] + b["state"]
                print(
                    f"| `{variant}` | {rank} | {b['param'] / MiB:.1f} | {b['grad'] / MiB:.1f} | {b['state'] / MiB:.1f} "
                    f"| {total / MiB:.1f} | {', '.join(result['dtypes'])} | {peak['rss'] / MiB:.0f} "
                    f"| {peak['anon'] / MiB:.0f} |"
                )


# ------------------------------------------------------------------------------------------------ (c)
def run_export(args: argparse.Namespace) -> None:
    import torch

    from lightning_fsdp.checkpoint.export import export_safetensors

    torch.set_num_threads(1)
    meter = PeakGrowth()
    meter.start()
    export_safetensors(
        os.path.join(args.out, "checkpoint"),
        os.path.join(args.out, "export"),
        prefix="model.",
        config=pretrained_dir(args.out, "float32"),
        overwrite=True,
    )
    torch.save({"export_peak": meter.stop()}, os.path.join(args.out, "results", "export.pt"))


# ------------------------------------------------------------------------------------------------ driver
def pretrained_dir(out: str, file_dtype: str) -> str:
    return os.path.join(out, "pretrained" if file_dtype == "float32" else f"pretrained-{file_dtype}")


def save_pretrained_models(out: str) -> None:
    """The float32 model in ``pretrained``, and the same weights rounded to bfloat16 in ``pretrained-bfloat16``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    with torch.no_grad():  # transformers' init leaves the norms at 1: make every tensor distinctive
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    model.save_pretrained(pretrained_dir(out, "float32"))
    model.to(torch.bfloat16).save_pretrained(pretrained_dir(out, "bfloat16"))


def read_safetensors_dir(folder: str):
    """(name -> checksums, total bytes) of every tensor in the directory's safetensors files, one tensor at a time."""
    from safetensors import safe_open

    sums, total = {}, 0
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                sums.update(checksums({name: tensor}))
                total += tensor.numel() * tensor.element_size()
    return sums, total


def spawn(role: str, file_dtype: str, out: str, timeout: int, variant: str | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--out", out, "--role", role, "--file-dtype", file_dtype]
    cmd += [] if variant is None else ["--variant", variant]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)  # rank 1 is rank 0's child
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SystemExit(f"run {role!r} ({file_dtype} file) timed out after {timeout} s") from None
    if proc.returncode != 0:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a rank left behind
        except OSError:
            pass
        raise SystemExit(f"run {role!r} ({file_dtype} file) failed with exit status {proc.returncode}")


def compare(what: str, got: dict, expected: dict) -> None:
    if sorted(got) != sorted(expected):
        raise SystemExit(f"{what}: names differ: {sorted(set(got) ^ set(expected))}")
    differ = [k for k in expected if got[k] != expected[k]]
    if differ:
        raise SystemExit(f"{what}: {len(differ)} tensors differ, e.g. {differ[:3]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="working directory (pretrained model, checkpoint, export)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds allowed to each measured run")
    parser.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)  # internal: one measured run
    parser.add_argument("--file-dtype", choices=FILE_DTYPES, default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: the choice a (d) or (e) run measures
    parser.add_argument(
        "--measure",
        choices=("load", "stage-end", "precision"),
        default="load",
        help="load: (a) to (c); stage-end: (d), the end of fit per weights_after_stage; precision: (e)",
    )
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    if args.role == "export":
        return run_export(args)
    if args.role in VARIANTS:
        return run_trained(args)
    if args.role is not None:
        return run_lightning(args)

    if not os.path.exists("/proc/self/clear_refs"):
        raise SystemExit("This measurement needs Linux's /proc/self/clear_refs.")
    if args.measure != "load":
        os.makedirs(os.path.join(args.out, "results"), exist_ok=True)
        for variant in VARIANTS[args.measure]:
            spawn(args.measure, "float32", args.out, args.timeout, variant)
        return report_trained(args.out, args.measure)
    import torch

    torch.set_num_threads(1)
    if not all(os.path.exists(os.path.join(pretrained_dir(args.out, d), "config.json")) for d in FILE_DTYPES):
        save_pretrained_models(args.out)
    for name in ("checkpoint", "export", "results"):
        shutil.rmtree(os.path.join(args.out, name), ignore_errors=True)
    os.makedirs(os.path.join(args.out, "results"))
    for file_dtype in FILE_DTYPES:
        for role in ("usual", "loader"):
            spawn(role, file_dtype, args.out, args.timeout)
    spawn("export", "float32", args.out, args.timeout)

    def result(name: str) -> dict:
        return torch.load(os.path.join(args.out, "results", name + ".pt"), weights_only=False)

    pairs = [(role, d) for d in FILE_DTYPES for role in ("usual", "loader")]
    runs = {(role, d): [result(f"{role}-{d}-rank{r}") for r in range(2)] for role, d in pairs}
    export = result("export")

    # Equal results: for each file, both runs hold exactly its tensors (as float32) and compute the same logits.
    for file_dtype in FILE_DTYPES:
        files, _ = read_safetensors_dir(pretrained_dir(args.out, file_dtype))
        files["lm_head.weight"] = files["model.embed_tokens.weight"]  # save_pretrained stores the tied head once
        usual, loader = runs["usual", file_dtype], runs["loader", file_dtype]
        compare(f"(a) from_pretrained vs the {file_dtype} files", usual[0]["loaded"], files)
        compare(f"(b) load_pretrained vs the {file_dtype} files", loader[0]["loaded"], files)
        for r in range(2):
            if not torch.equal(usual[r]["logits"], loader[r]["logits"]):
                raise SystemExit(f"rank {r}: the logits of (a) and (b) of the {file_dtype} file differ")
    exported, _ = read_safetensors_dir(os.path.join(args.out, "export"))
    compare("(c) export vs the trained model", exported, runs["loader", "float32"][0]["trained"])
    _, model_bytes = read_safetensors_dir(pretrained_dir(args.out, "float32"))

    def peaks(role: str, file_dtype: str, key: str = "load_peak") -> list[dict]:
        return [rank[key] for rank in runs[role, file_dtype]]

    rows = [
        ("(a) from_pretrained on every rank, sharded at setup", peaks("usual", "float32")),
        ("(b) meta-device model, sharded, then load_pretrained", peaks("loader", "float32")),
        ('then trainer.save_checkpoint, state_dict_type="sharded"', peaks("loader", "float32", "save_peak")),
        ("(c) export_safetensors of that checkpoint (1 process)", [export["export_peak"]]),
        ("(a) as above, bfloat16 file into the float32 model", peaks("usual", "bfloat16")),
        ("(b) as above, bfloat16 file into the float32 model", peaks("loader", "bfloat16")),
    ]
    shard_bytes = max(rank["shard_bytes"] for rank in runs["loader", "float32"])
    n_tensors = len(exported) - 1  # less the tied head
    size = f"{model_bytes / MiB:.0f}"
    print()
    print(
        f"Llama {LLAMA['num_hidden_layers']} layers x {LLAMA['hidden_size']}, vocab {LLAMA['vocab_size']}, tied "
        f"embeddings: {model_bytes / 4 / 1e6:.1f}M parameters, fp32; 2 CPU gloo ranks, fsdp_custom FULL_SHARD, "
        f"{shard_bytes / MiB:.0f} MiB of parameters per rank once sharded. For each file, (a) and (b) hold the same "
        f"parameters (checksums of all {n_tensors} tensors equal the file's) and give equal logits; the export "
        "holds the trained weights."
    )
    print(
        "Measured in each process from just before the model is built (a, b), the save or the export call (c) to "
        "right after it: peak RSS growth = VmHWM (reset to the current RSS by writing 5 to /proc/self/clear_refs) "
        "minus the RSS at the reset; it includes mmap'd file pages. Private = RssAnon growth, sampled every 1 ms. "
        "Held = RSS at the end minus the RSS at the reset. Max over the ranks."
    )
    print()
    print(
        "| method | peak RSS growth per rank (MiB, max of ranks) | peak private memory growth (MiB) "
        "| held at the end (MiB) | model size (MiB) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for label, peaks in rows:
        rss, anon, held = (max(p[k] for p in peaks) / MiB for k in ("rss", "anon", "held"))
        print(f"| {label} | {rss:.0f} | {anon:.0f} | {held:.0f} | {size} |")


if __name__ == "__main__":
    main()
