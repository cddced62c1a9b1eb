"""``lightning-fsdp export``: a full, sharded or local checkpoint's weights as a Hugging Face safetensors directory.

The checkpoints of the format tests come from one run of the engine on 2 gloo ranks (``fully_shard`` on ToyLM inside
a Lightning-style wrapper, one SGD step) saved in each of the three formats. The reference each export is compared
with is the checkpoint read by other code: ``torch.load`` for the full file, ``read_sharded_checkpoint_full`` /
``read_local_checkpoint_full`` (which read whole, without the export's streaming) for the directories, and the
full state the run itself gathered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from torch import nn

from benchmarks.ranks import ROOT
from lightning_fsdp.checkpoint.atomic_io import CheckpointLoadError
from lightning_fsdp.checkpoint.export import export_safetensors, parse_dtype, parse_size
from lightning_fsdp.checkpoint.local import read_local_checkpoint_full
from lightning_fsdp.checkpoint.sharded import read_sharded_checkpoint_full, save_sharded_from_full
from tests.toolbox.distributed import run_distributed
from tests.toolbox.launch import run_command
from tests.toolbox.models import Block, ToyLM, batch, loss_fn

FORMATS = ["full", "sharded", "local"]


class Wrapped(nn.Module):
    """What a LightningModule holding its model as ``self.model`` saves: keys ``model.<the model's key>``, plus an
    integer buffer (kept as it is by ``dtype``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ToyLM()
        self.register_buffer("seen", torch.arange(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


def _save_all_formats(rank: int, world_size: int, folder: str) -> dict:
    from lightning_fsdp.checkpoint.full import full_model_state_dict
    from lightning_fsdp.checkpoint.local import (
        local_model_state_dict,
        local_optimizer_state_dict,
        save_local_checkpoint,
    )
    from lightning_fsdp.checkpoint.sharded import (
        save_sharded_checkpoint,
        sharded_model_state_dict,
        sharded_optimizer_state_dict,
    )
    from lightning_fsdp.engine import fully_shard

    model = Wrapped()
    engine = fully_shard(model, auto_wrap_policy={Block})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(0, size=4)
    loss_fn(model(x[rank::world_size]), y[rank::world_size]).backward()
    optimizer.step()
    optimizer.zero_grad()
    full = full_model_state_dict(engine)  # rank 0 only
    if rank == 0:
        torch.save({"state_dict": full, "epoch": 0, "global_step": 1}, os.path.join(folder, "full.ckpt"))
    save_sharded_checkpoint(
        {
            "state_dict": sharded_model_state_dict(engine),
            "optimizer_states": [sharded_optimizer_state_dict(engine, optimizer)],
            "global_step": 1,
        },
        os.path.join(folder, "sharded"),
    )
    save_local_checkpoint(
        {
            "state_dict": local_model_state_dict(engine),
            "optimizer_states": [local_optimizer_state_dict(optimizer)],
            "global_step": 1,
        },
        os.path.join(folder, "local"),
        engine,
        [optimizer],
    )
    return {k: v.clone() for k, v in full.items()} if rank == 0 else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """({format: checkpoint path}, the full state dict the run gathered when it saved)."""
    folder = str(tmp_path_factory.mktemp("export_checkpoints"))
    results = run_distributed(_save_all_formats, 2, folder)
    paths = {"full": os.path.join(folder, "full.ckpt"), **{k: os.path.join(folder, k) for k in ("sharded", "local")}}
    return paths, results[0]


def _independent_read(kind: str, path: str) -> dict[str, torch.Tensor]:
    if kind == "full":
        return torch.load(path, weights_only=False)["state_dict"]
    reader = read_sharded_checkpoint_full if kind == "sharded" else read_local_checkpoint_full
    return reader(path, weights_only=False)["state_dict"]


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys in the index: {keys}"
    return dict(pairs)


def _read_export(out: str) -> tuple[dict[str, torch.Tensor], dict[str, str], dict | None]:
    """(every tensor of the export, name -> file it is in, the index or None), checking the files' metadata."""
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    tensors, where = {}, {}
    for file in files:
        with safe_open(os.path.join(out, file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}, file
            for name in f.keys():
                assert name not in tensors, f"{name!r} is in two files"
                tensors[name] = f.get_tensor(name)
                where[name] = file
    index_file = os.path.join(out, "model.safetensors.index.json")
    index = None
    if os.path.exists(index_file):
        with open(index_file) as f:
            index = json.load(f, object_pairs_hook=_no_duplicate_keys)
    return tensors, where, index


def _expected(reference: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in reference.items():
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[key.removeprefix(prefix)] = value
    return out


# ================================================================================= 1. every format, every option
@pytest.mark.parametrize("kind", FORMATS)
def test_export_equals_the_checkpoint_read_independently(kind, saved, tmp_path):
    paths, gathered = saved
    reference = _independent_read(kind, paths[kind])
    assert sorted(reference) == sorted(gathered)
    for key, value in gathered.items():  # the independent readers agree with what the run held
        assert torch.equal(reference[key], value), key
    expected = _expected(reference, "model.", torch.bfloat16)
    assert "emb.weight" in expected and "seen" in expected and expected["seen"].dtype == torch.int64

    # Split into several files, names stripped, floating tensors cast to bfloat16.
    max_bytes = 120
    out = str(tmp_path / "hf")
    written = export_safetensors(paths[kind], out, max_shard_size=max_bytes, dtype="bfloat16", prefix="model.")
    tensors, where, index = _read_export(out)
    assert sorted(os.listdir(out)) == sorted(os.path.basename(w) for w in written)
    assert sorted(tensors) == sorted(expected)
    compared = 0
    for name, value in expected.items():
        assert tensors[name].dtype == value.dtype, name
        assert torch.equal(tensors[name], value), name
        compared += 1
    assert compared == len(reference) == 16
    # The index: every name once, pointing at the file that holds it, every file listed, total_size the bytes.
    assert index is not None
    assert index["weight_map"] == where
    files = sorted(set(where.values()))
    assert len(files) > 3
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    total = sum(v.numel() * v.element_size() for v in expected.values())
    assert index["metadata"] == {"total_size": total}
    # No file above the limit unless it holds one tensor that alone is larger; names keep the checkpoint's order.
    for file in files:
        names = [n for n, f in where.items() if f == file]
        size = sum(expected[n].numel() * expected[n].element_size() for n in names)
        assert size <= max_bytes or len(names) == 1, (file, names, size)
    order = [k.removeprefix("model.") for k in reference]
    assert sorted(order, key=lambda n: where[n]) == order


@pytest.mark.parametrize("kind", FORMATS)
def test_export_without_options_is_one_exact_file(kind, saved, tmp_path):
    paths, _ = saved
    reference = _independent_read(kind, paths[kind])
    out = str(tmp_path / "hf")
    assert export_safetensors(paths[kind], out) == [os.path.join(out, "model.safetensors")]
    tensors, _, index = _read_export(out)
    assert index is None and os.listdir(out) == ["model.safetensors"]
    assert sorted(tensors) == sorted(reference)  # names as in the checkpoint
    for key, value in reference.items():
        assert tensors[key].dtype == value.dtype and torch.equal(tensors[key], value), key
    # The tied head: both names, equal, stored as separate tensors (a full file holds them as one storage).
    assert torch.equal(tensors["model.head.weight"], tensors["model.emb.weight"])


def test_rename_and_its_errors(saved, tmp_path):
    paths, gathered = saved
    out = str(tmp_path / "hf")
    export_safetensors(paths["sharded"], out, prefix="model.", rename=lambda n: "transformer." + n.replace(".", "_"))
    tensors, _, _ = _read_export(out)
    expected = {"transformer." + k.removeprefix("model.").replace(".", "_"): v for k, v in gathered.items()}
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name
    with pytest.raises(ValueError, match=r"'seen' and 'model\.tiny' both become 'w'"):
        export_safetensors(paths["full"], str(tmp_path / "dup"), rename=lambda n: "w")
    with pytest.raises(TypeError, match=r"rename\('seen'\) returned None"):
        export_safetensors(paths["full"], str(tmp_path / "none"), rename=lambda n: None)
    assert not os.path.exists(tmp_path / "dup") and not os.path.exists(tmp_path / "none")


def test_config_is_copied_from_a_file_a_directory_or_a_dict(saved, tmp_path):
    paths, _ = saved
    content = {"model_type": "toy", "hidden_size": 5, "tie_word_embeddings": True}
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(content))
    for i, config in enumerate([content, str(folder / "config.json"), str(folder)]):
        out = tmp_path / f"hf{i}"
        written = export_safetensors(paths["full"], out, config=config)
        assert str(out / "config.json") in written
        assert json.loads((out / "config.json").read_text()) == content
    with pytest.raises(FileNotFoundError, match=r"has no 'config.json'"):
        export_safetensors(paths["full"], tmp_path / "x", config=str(tmp_path))
    (folder / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad.json' holds a JSON list, not an object"):
        export_safetensors(paths["full"], tmp_path / "x", config=str(folder / "bad.json"))
    assert not os.path.exists(tmp_path / "x")


def test_output_is_replaced_only_with_overwrite_and_atomically(saved, tmp_path, monkeypatch):
    paths, _ = saved
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("previous export")
    with pytest.raises(FileExistsError, match=r"'.*hf' exists; pass overwrite=True \(--overwrite\)"):
        export_safetensors(paths["full"], out)
    assert os.listdir(out) == ["old.txt"]
    # A failure in the middle (the second file) leaves the previous directory as it was and no temporary behind.
    import lightning_fsdp.checkpoint.export as export_module

    real, calls = export_module._header, []

    def failing(items):  # the header of each file, written first: fail at the second file
        calls.append(items)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(items)

    monkeypatch.setattr(export_module, "_header", failing)
    with pytest.raises(OSError, match="disk full"):
        export_safetensors(paths["full"], out, overwrite=True, max_shard_size=100)
    assert len(calls) == 2
    assert os.listdir(out) == ["old.txt"]
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    monkeypatch.setattr(export_module, "_header", real)
    export_safetensors(paths["full"], out, overwrite=True)
    assert os.listdir(out) == ["model.safetensors"]


def test_non_tensor_entries_are_left_out_with_a_warning(tmp_path):
    path = str(tmp_path / "odd.ckpt")
    torch.save({"state_dict": {"w": torch.ones(2), "extra_state": {"calls": 3}}}, path)
    with pytest.warns(UserWarning, match=r"\['extra_state'\] are not tensors"):
        export_safetensors(path, tmp_path / "hf")
    tensors, _, _ = _read_export(str(tmp_path / "hf"))
    assert list(tensors) == ["w"] and torch.equal(tensors["w"], torch.ones(2))


@pytest.mark.parametrize(
    "kwargs, error, fragments",
    [
        ({"dtype": "int8"}, ValueError, ["'int8'", "'bfloat16'", "'float16'", "'float32'"]),
        ({"dtype": torch.int8}, ValueError, ["torch.int8", "'bfloat16'"]),
        ({"max_shard_size": "5XB"}, ValueError, ["'5XB'", "GB", "MiB"]),
        ({"max_shard_size": "lots"}, ValueError, ["'lots'", "GB"]),
        ({"max_shard_size": 0}, ValueError, ["0", "must be positive"]),
        ({"max_shard_size": 1.5}, TypeError, ["float", "1.5"]),
        ({"prefix": 3}, TypeError, ["prefix", "int"]),
        ({"rename": "model."}, TypeError, ["rename", "'model.'"]),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(saved, tmp_path, kwargs, error, fragments):
    paths, _ = saved
    with pytest.raises(error) as info:
        export_safetensors(paths["full"], tmp_path / "hf", **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert os.listdir(tmp_path) == []


def test_missing_or_foreign_checkpoint_is_named(tmp_path):
    missing = str(tmp_path / "nope.ckpt")
    with pytest.raises(FileNotFoundError, match=r"Checkpoint not found: '.*nope.ckpt'"):
        export_safetensors(missing, tmp_path / "hf")
    torch.save({"weights": torch.ones(1)}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointLoadError, match=r"no 'state_dict' entry .* \['weights'\]"):
        export_safetensors(tmp_path / "plain.pt", tmp_path / "hf")
    assert not os.path.exists(tmp_path / "hf")


def test_size_and_dtype_parsing():
    assert parse_size("5GB") == 5 * 10**9  # transformers' reading of "5GB"
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5kb") == 1500
    assert parse_size(123) == parse_size("123") == parse_size("123B") == 123
    assert parse_dtype("bf16") is parse_dtype("torch.bfloat16") is parse_dtype(torch.bfloat16) is torch.bfloat16
    assert parse_dtype(None) is None


# ================================================================================= 2. streaming: peak memory
_MEASURE = r"""
import json, sys
import torch
from lightning_fsdp.checkpoint.export import export_safetensors
from lightning_fsdp.checkpoint.sharded import read_sharded_checkpoint_full
import safetensors.torch

from benchmarks.memory import PeakGrowth

mode, src, out = sys.argv[1:]
meter = PeakGrowth()
meter.start()  # peak resident set size := current: the imports' own peak is not counted
if mode == "export":
    export_safetensors(src, out)  # the default 5GB limit: all ten tensors go to one file
else:  # the whole checkpoint in memory at once: what the measurement must see
    state = read_sharded_checkpoint_full(src)["state_dict"]
print(json.dumps({"increase_bytes": meter.stop()["rss"]}))
"""


def _peak_increase(mode: str, src: str, out: str) -> int:
    proc = run_command([sys.executable, "-c", _MEASURE, mode, src, out], cwd=ROOT, timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1])["increase_bytes"]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_exporting_a_sharded_checkpoint_streams(tmp_path):
    """Peak memory is the growth of the peak resident set size (``VmHWM``, which counts torch's CPU tensors, unlike
    tracemalloc) of a fresh process, reset just before the call. ``ru_maxrss`` would not do: a child starts with its
    parent's (pytest's) peak, which hides everything below it."""
    tensor_bytes = 8 * 2**20
    count = 10
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(1024, 2048, generator=g) for i in range(count)}
    assert all(v.numel() * v.element_size() == tensor_bytes for v in state.values())
    src = str(tmp_path / "sharded")
    save_sharded_from_full({"state_dict": state}, src)
    del state
    whole = _peak_increase("read_whole", src, "")
    exported = _peak_increase("export", src, str(tmp_path / "hf"))
    print(f"peak RSS increase: export {exported / 2**20:.1f} MiB, whole read {whole / 2**20:.1f} MiB")
    assert whole > 0.9 * count * tensor_bytes  # the method sees the tensors
    # One 80 MiB file, written tensor by tensor: the peak is about one tensor read (and DCP's copy of it), not the file.
    assert exported < 3 * tensor_bytes
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"]


# ================================================================================= 3. transformers
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_transformers_loads_the_export_with_the_same_logits(kind, tied, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    # Different from the initialisation from_pretrained would give a missing weight.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    checkpoint = {"state_dict": {"model." + k: v for k, v in model.state_dict().items()}, "epoch": 3}
    src = str(tmp_path / "ckpt")
    if kind == "full":
        torch.save(checkpoint, src)
    else:
        save_sharded_from_full(checkpoint, src)
    config_dir = tmp_path / "config"
    config.save_pretrained(config_dir)
    out = str(tmp_path / "hf")
    export_safetensors(src, out, prefix="model.", config=str(config_dir), max_shard_size="20KB")
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = model(ids).logits, loaded(ids).logits
    assert torch.equal(got, expected)
    compared, loaded_state = 0, loaded.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded_state[key], value), key
        compared += 1
    assert compared == len(model.state_dict()) >= 20


# ================================================================================= 4. the command
def _command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "lightning-fsdp")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "lightning_fsdp.cli"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_command([*_command(), "export", *args], cwd=ROOT, timeout=300, check=False)


def test_command_exports_end_to_end(saved, tmp_path):
    paths, gathered = saved
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy"}))
    out = str(tmp_path / "hf")
    proc = _run(
        paths["local"],
        out,
        "--strip-prefix",
        "model.",
        "--dtype",
        "float16",
        "--max-shard-size",
        "200B",
        "--config",
        str(tmp_path / "config.json"),
    )
    assert proc.returncode == 0, proc.stderr
    assert f"to {out}" in proc.stdout and "model.safetensors.index.json" in proc.stdout
    tensors, where, index = _read_export(out)
    assert index is not None and index["weight_map"] == where and len(set(where.values())) > 2
    expected = _expected(gathered, "model.", torch.float16)
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        assert tensors[name].dtype == value.dtype and torch.equal(tensors[name], value), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "toy"}
    # Again without --overwrite: refused, exit status 1, the export untouched.
    proc = _run(paths["local"], out)
    assert proc.returncode == 1
    assert "lightning-fsdp export: error:" in proc.stderr and "pass overwrite=True (--overwrite)" in proc.stderr
    assert _read_export(out)[1] == where


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--dtype", "int8"], ["dtype 'int8' is not valid", "'bfloat16'", "'float32'"]),
        (["--max-shard-size", "5XB"], ["max_shard_size '5XB' is not a size", "GB", "MiB"]),
    ],
)
def test_command_refuses_bad_values(saved, tmp_path, capsys, args, fragments):
    from lightning_fsdp import cli

    paths, _ = saved
    assert cli.main(["export", paths["full"], str(tmp_path / "hf"), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-fsdp export: error: ")
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert os.listdir(tmp_path) == []


def test_command_names_a_missing_checkpoint(tmp_path):
    proc = _run(str(tmp_path / "missing.ckpt"), str(tmp_path / "hf"))
    assert proc.returncode == 1
    assert "lightning-fsdp export: error: Checkpoint not found: " in proc.stderr and "missing.ckpt" in proc.stderr
    assert os.listdir(tmp_path) == []
