"""``load_pretrained``: a safetensors model loaded into fsdp_custom's shards, each rank reading only its rows.

Engine-level cases run in 2 gloo processes (tests/toolbox/distributed.py): a tiny model (ToyLM: an embedding of 7 rows,
uneven over 2 ranks, tied to the head; a 1-row parameter rank 1 holds none of; a frozen layer) plus a 0-dim
parameter and a buffer, saved with ``safetensors.torch.save_file`` as one file or as two files with an index, and
loaded into fully_shard'ed copies initialised with other values. The expected values are the files as read here by
``safetensors.torch.load_file``. The Hugging Face case runs tests/scripts/pretrained_run.py as a user's Lightning
script and compares with ``LlamaForCausalLM.from_pretrained`` in this process.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_fsdp.checkpoint.common import CheckpointMismatchError
from lightning_fsdp.pretrained import load_pretrained
from tests.toolbox.distributed import run_distributed
from tests.toolbox.launch import in_background, run_script
from tests.toolbox.models import Block, ToyLM


class ToyLMWithExtras(nn.Module):
    """ToyLM as ``lm`` plus a 0-dim parameter and a (persistent) buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = ToyLM()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("counts", torch.arange(4.0))


class Outer(nn.Module):
    """``ToyLMWithExtras`` one level down, so the keys carry a prefix (as a LightningModule's ``self.model`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ToyLMWithExtras()


def pretrained_values() -> dict[str, torch.Tensor]:
    """The pretrained values, by ``ToyLMWithExtras`` key, without the tied duplicate (``lm.head.weight`` is
    ``lm.emb.weight``)."""
    torch.manual_seed(0)
    state = ToyLMWithExtras().state_dict()
    state.pop("lm.head.weight")
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def write_files(folder: str) -> dict[str, str]:
    """The pretrained model in the layouts the cases load; returns case -> path."""
    ref = pretrained_values()
    paths = {}
    # 1. one file, ToyLMWithExtras's own names; the tie stored under its first name.
    paths["single"] = os.path.join(folder, "single.safetensors")
    save_file(ref, paths["single"])
    # 2. two files with an index (a directory as save_pretrained writes it); the tie stored under its second name.
    split = os.path.join(folder, "split")
    os.makedirs(split)
    state = {("lm.head.weight" if k == "lm.emb.weight" else k): v for k, v in ref.items()}
    names = sorted(state)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in parts.items():
        save_file({k: state[k] for k in part}, os.path.join(split, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(split, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    paths["split"] = split
    # 3. other names: "body." for "lm.", loaded with a rename (and a prefix into Outer).
    paths["renamed"] = os.path.join(folder, "renamed.safetensors")
    save_file({k.replace("lm.", "body.", 1): v for k, v in ref.items()}, paths["renamed"])
    return paths


def _sharded(cls: type[nn.Module], seed: int) -> tuple[nn.Module, object]:
    """A fully_shard'ed ``cls`` whose values differ from the files' (and from the other rank's before sharding)."""
    from lightning_fsdp.engine import fully_shard

    torch.manual_seed(seed)
    model = cls()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # away from any seed's values
    return model, fully_shard(model, auto_wrap_policy={Block})


class _RecordingOpen:
    """``safetensors.safe_open`` that records what is read: (name, rows) for slices, (name, "whole") else."""

    def __init__(self, original, log: list) -> None:
        self.original, self.log = original, log

    def __call__(self, *args, **kwargs):
        return _RecordingFile(self.original(*args, **kwargs), self.log)


class _RecordingFile:
    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def __enter__(self):
        self.handle = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        self.log.append((name, "whole"))
        return self.handle.get_tensor(name)

    def get_slice(self, name):
        return _RecordingSlice(self.handle.get_slice(name), name, self.log)


class _RecordingSlice:
    def __init__(self, inner, name: str, log: list) -> None:
        self.inner, self.name, self.log = inner, name, log

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        self.log.append((self.name, (index.start, index.stop)))
        return self.inner[index]


def _load_cases(rank: int, world_size: int, paths: dict[str, str]) -> dict:
    import safetensors

    from lightning_fsdp.checkpoint.full import full_model_state_dict

    out = {}
    cases = {
        "single": (ToyLMWithExtras, lambda m: m, {}),
        "split": (ToyLMWithExtras, lambda m: m, {}),
        # The sharded root with a prefix and a rename function.
        "renamed": (Outer, lambda m: m, {"prefix": "net.", "rename": lambda n: n.replace("body.", "lm.", 1)}),
        # A submodule of the sharded root (its engine found through the root), with a rename dict.
        "renamed_dict": (
            Outer,
            lambda m: m.net,
            {"rename": {k.replace("lm.", "body.", 1): k for k in pretrained_values()}},
        ),
    }
    for case, (cls, pick, kwargs) in cases.items():
        model, engine = _sharded(cls, seed=100 + rank)
        path = paths["renamed" if case == "renamed_dict" else case]
        log: list = []
        original = safetensors.safe_open
        safetensors.safe_open = _RecordingOpen(original, log)
        try:
            result = load_pretrained(pick(model), path, **kwargs)
        finally:
            safetensors.safe_open = original
        net = model if cls is ToyLMWithExtras else model.net
        full = full_model_state_dict(engine, rank0_only=False)
        rows = {}
        for slot in (s for u in engine.units for s in u.slots):
            rows[slot.fqn] = slot.layout.rows_of(rank) if len(slot.layout.shape) else "whole"
        out[case] = {
            "result": result,
            "full": full,
            "tied": net.lm.head.weight is net.lm.emb.weight,
            "reads": log,
            "rows": rows,
        }
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> tuple[list[dict], dict[str, str]]:
    paths = write_files(str(tmp_path_factory.mktemp("pretrained")))
    return run_distributed(_load_cases, 2, paths), paths


def _expected(paths: dict[str, str], case: str) -> dict[str, torch.Tensor]:
    """The file's tensors read independently, keyed as in ``ToyLMWithExtras``."""
    if case == "split":
        folder = paths["split"]
        state = {}
        for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
            state.update(load_file(os.path.join(folder, file)))
        return {("lm.emb.weight" if k == "lm.head.weight" else k): v for k, v in state.items()}
    state = load_file(paths["renamed" if case.startswith("renamed") else case])
    return {k.replace("body.", "lm.", 1): v for k, v in state.items()}


@pytest.mark.parametrize("case", ["single", "split", "renamed", "renamed_dict"])
def test_every_tensor_equals_the_file(loaded, case):
    per_rank, paths = loaded
    expected = _expected(paths, case)
    # ToyLMWithExtras has 17 state-dict tensors but one tied pair: 16 distinct tensors in the files.
    assert len(expected) == 16
    key_prefix = "net." if case.startswith("renamed") else ""
    for rank, out in enumerate(per_rank):
        assert out[case]["result"] == ([], [], []), (rank, out[case]["result"])
        full = out[case]["full"]
        compared = 0
        for key, value in expected.items():
            torch.testing.assert_close(full[key_prefix + key], value, rtol=0, atol=0, msg=f"rank {rank} {key}")
            compared += 1
        # The tie: one Parameter under both names, so the head holds the embedding's values.
        assert out[case]["tied"], rank
        torch.testing.assert_close(full[key_prefix + "lm.head.weight"], expected["lm.emb.weight"], rtol=0, atol=0)
        assert compared == 16


@pytest.mark.parametrize("case", ["single", "split", "renamed", "renamed_dict"])
def test_each_rank_reads_only_its_rows(loaded, case):
    """Sharded parameters are read as this rank's rows of dim 0; only the buffer and the 0-dim parameter whole."""
    per_rank, _paths = loaded
    for rank, out in enumerate(per_rank):
        reads = out[case]["reads"]
        names_read = [name for name, _ in reads]
        assert len(names_read) == len(set(names_read)) == 16, (rank, reads)  # each tensor once, the tie included
        whole = sorted(name for name, what in reads if what == "whole")
        assert [n.rsplit(".", 1)[-1] for n in whole] == ["counts", "scale"], (rank, whole)
        sliced = {name: what for name, what in reads if what != "whole"}
        rows = out[case]["rows"]
        checked = 0
        for name, span in sliced.items():
            key = name.replace("body.", "lm.", 1)
            key = "lm.emb.weight" if key == "lm.head.weight" else key
            fqn = ("net." if case.startswith("renamed") else "") + key
            assert span == rows[fqn], (rank, name, span, rows[fqn])
            checked += 1
        assert checked == 14
        # Rank 1 holds rows 4..7 of the 7-row embedding and nothing of the 1-row parameter.
        emb = next(v for k, v in sliced.items() if k.endswith("emb.weight") or k.endswith("head.weight"))
        assert emb == ((0, 4) if rank == 0 else (4, 7))
        assert next(v for k, v in sliced.items() if k.endswith("tiny")) == ((0, 1) if rank == 0 else (1, 1))


# ------------------------------------------------------------------------------------------------ errors
def _error_cases(rank: int, world_size: int, folder: str) -> dict:
    from lightning_fsdp.checkpoint.full import full_model_state_dict

    ref = pretrained_values()
    files = {
        "missing": {k: v for k, v in ref.items() if k != "lm.block1.fc1.weight"},
        "unexpected": {**ref, "lm.extra.weight": torch.ones(2, 3)},
        "shape": {**ref, "lm.block2.fc2.bias": torch.zeros(6)},
    }
    out = {}
    for case, state in files.items():
        path = os.path.join(folder, f"{case}.safetensors")
        if rank == 0:
            save_file(state, path)
        torch.distributed.barrier()
        model, engine = _sharded(ToyLMWithExtras, seed=100 + rank)
        before = full_model_state_dict(engine, rank0_only=False)
        try:
            load_pretrained(model, path)
            error = None
        except CheckpointMismatchError as exc:
            error = str(exc)
        untouched = full_model_state_dict(engine, rank0_only=False)
        result = load_pretrained(model, path, strict=False)
        out[case] = {
            "error": error,
            "changed_by_failed_load": [k for k in before if not torch.equal(before[k], untouched[k])],
            "result": result,
            "before": before,
            "after": full_model_state_dict(engine, rank0_only=False),
        }
    # One rank cannot read its file (no shared file system, say): both ranks raise, neither waits, and the rank
    # whose file was good copies nothing either.
    good = os.path.join(folder, "good.safetensors")
    if rank == 0:
        save_file(ref, good)
    torch.distributed.barrier()
    model, engine = _sharded(ToyLMWithExtras, seed=100 + rank)
    before = full_model_state_dict(engine, rank0_only=False)
    try:
        load_pretrained(model, good if rank == 0 else os.path.join(folder, "nowhere.safetensors"))
        out["one_rank"] = None
    except FileNotFoundError as exc:
        out["one_rank"] = (type(exc).__name__, str(exc))
    after = full_model_state_dict(engine, rank0_only=False)
    out["one_rank_changed"] = [k for k in before if not torch.equal(before[k], after[k])]
    return out


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> list[dict]:
    return run_distributed(_error_cases, 2, str(tmp_path_factory.mktemp("pretrained_errors")))


ERRORS = {
    # case: (tensor the error names, what it says, the LoadResult of strict=False)
    "missing": ("lm.block1.fc1.weight", "missing", (["lm.block1.fc1.weight"], [], [])),
    "unexpected": ("lm.extra.weight", "unexpected", ([], ["lm.extra.weight"], [])),
    "shape": ("lm.block2.fc2.bias", "wrong shape", ([], [], [("lm.block2.fc2.bias", (6,), (5,))])),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_strict_errors_on_every_rank_before_copying(errors, case):
    name, kind, _result = ERRORS[case]
    for rank, out in enumerate(errors):
        error = out[case]["error"]
        assert error is not None, f"rank {rank} did not raise"
        assert repr(name) in error and kind in error, (rank, error)
        assert out[case]["changed_by_failed_load"] == [], rank
    if case == "shape":
        assert "file (6,), model (5,)" in errors[0][case]["error"]


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_non_strict_lists_them_and_loads_the_rest(errors, case):
    name, _kind, result = ERRORS[case]
    ref = pretrained_values()
    for rank, out in enumerate(errors):
        assert tuple(out[case]["result"]) == result, rank
        after, before = out[case]["after"], out[case]["before"]
        loaded = 0
        for key, value in ref.items():
            if key == name:  # not loaded: left as it was
                torch.testing.assert_close(after[key], before[key], rtol=0, atol=0)
                assert not torch.equal(after[key], value)
            else:
                torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=f"rank {rank} {key}")
                loaded += 1
        assert loaded == (15 if name in ref else 16)


def test_a_problem_on_one_rank_raises_on_both(errors):
    for rank, out in enumerate(errors):
        assert out["one_rank"] is not None, f"rank {rank} did not raise"
        kind, message = out["one_rank"]
        assert kind == "CheckpointNotFoundError" and "nowhere.safetensors" in message and "does not exist" in message
        assert out["one_rank_changed"] == [], rank
    assert "[raised on rank 1]" in errors[0]["one_rank"][1]  # rank 0's own file was fine


# ------------------------------------------------------------------------------------------------ unsharded
def test_unsharded_module_loads_whole_and_materialises_meta(tmp_path):
    """No engine (one device, DDP): the same call loads the module whole; a meta-device module gets real memory."""
    paths = write_files(str(tmp_path))
    with torch.device("meta"):
        outer = Outer()
    head = outer.net.lm.head.weight
    result = load_pretrained(outer, paths["renamed"], prefix="net.", rename=lambda n: n.replace("body.", "lm.", 1))
    assert result == ([], [], [])
    assert outer.net.lm.head.weight is head is outer.net.lm.emb.weight  # same objects, still tied
    state = outer.state_dict()
    expected = _expected(paths, "renamed")
    for key, value in expected.items():
        torch.testing.assert_close(state["net." + key], value, rtol=0, atol=0)
    assert len(expected) == 16 and not any(t.is_meta for t in state.values())


def test_dtype_cast_and_skipped_tensors(tmp_path):
    """A bfloat16 file loads into a float32 model (values cast); a rename returning None skips a tensor."""
    ref = pretrained_values()
    path = str(tmp_path / "bf16.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in ref.items()}, path)
    torch.manual_seed(1)
    net = ToyLMWithExtras()
    result = load_pretrained(net, path, rename=lambda n: None if n == "counts" else n, strict=False)
    assert result == (["counts"], [], [])  # skipped: missing in the model, not unexpected
    state = net.state_dict()
    compared = 0
    for key, value in ref.items():
        if key == "counts":
            continue
        assert state[key].dtype == torch.float32
        torch.testing.assert_close(state[key], value.to(torch.bfloat16).float(), rtol=0, atol=0)
        compared += 1
    assert compared == 15 and not torch.equal(state["lm.emb.weight"], ref["lm.emb.weight"])  # bf16-rounded


def test_bad_arguments_name_the_value():
    with pytest.raises(TypeError, match=r"rename=3.*expected None, a function"):
        load_pretrained(nn.Linear(2, 2), "x.safetensors", rename=3)
    with pytest.raises(TypeError, match=r"target='model'"):
        load_pretrained("model", "x.safetensors")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(nn.Linear(2, 2), "/nonexistent/x.safetensors")


# ------------------------------------------------------------------------------------------------ transformers
_llama_runs: dict = {}


def llama_run(tmp_path_factory, tie: bool) -> dict:
    """A tiny Llama saved with save_pretrained, loaded into fsdp_custom on 2 ranks and trained 3 steps (once per
    ``tie``). Returns the script's results plus ``pretrained`` (the directory) and ``checkpoint`` (the trained full
    checkpoint, for an export round trip). The first call saves both models here, then starts both runs at once."""
    if not _llama_runs:
        from tests.scripts.pretrained_run import tiny_llama

        launches = {}
        for t in (True, False):
            folder = tmp_path_factory.mktemp(f"llama_tie{int(t)}")
            tiny_llama(t).save_pretrained(folder / "pretrained")
            launches[t] = partial(_llama_launch, folder)
        _llama_runs.update(in_background(launches))
    return _llama_runs[tie].result()


def _llama_launch(folder: Path) -> dict:
    pretrained = folder / "pretrained"
    checkpoint, out = folder / "trained.ckpt", folder / "out.pt"
    run_script("pretrained_run.py", "--pretrained", pretrained, "--save", checkpoint, "--out", out, timeout=400)
    return {**torch.load(out, weights_only=False), "pretrained": pretrained, "checkpoint": checkpoint}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_llama_loaded_into_shards_gives_transformers_logits(tmp_path_factory, tie):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    from tests.scripts.pretrained_run import fixed_batch

    run = llama_run(tmp_path_factory, tie)
    assert run["world_size"] == 2 and run["tied"] == tie
    assert tuple(run["load_result"]) == ([], [], [])
    reference = LlamaForCausalLM.from_pretrained(run["pretrained"]).eval()
    with torch.no_grad():
        expected = reference(input_ids=fixed_batch()).logits
    assert expected.shape == (2, 8, 128)
    torch.testing.assert_close(run["loaded_logits"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_llama_trained_checkpoint_reproduces_the_trained_logits(tmp_path_factory, tie):
    """The fine-tuning path's end: the trained model's full checkpoint, exported to a safetensors directory and
    loaded with transformers' ``from_pretrained`` in one process, gives the logits of the trained sharded model."""
    pytest.importorskip("transformers")
    run = llama_run(tmp_path_factory, tie)
    check_trained_checkpoint(run, tmp_path_factory.mktemp("export") / "hf")


def check_trained_checkpoint(run: dict, export_dir) -> None:
    """The round trip of the issue: the trained checkpoint exported with ``export_safetensors`` (names without the
    LightningModule's ``model.`` prefix, the pretrained ``config.json``) loads with ``from_pretrained`` and gives the
    logits the trained sharded model computed."""
    from transformers import LlamaForCausalLM

    from lightning_fsdp.checkpoint.export import export_safetensors
    from tests.scripts.pretrained_run import fixed_batch

    losses = run["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses  # it trained
    assert not torch.allclose(run["trained_logits"], run["loaded_logits"], atol=1e-3)
    written = export_safetensors(run["checkpoint"], export_dir, prefix="model.", config=run["pretrained"])
    assert [os.path.basename(f) for f in written if f.endswith(".safetensors")] == ["model.safetensors"], written
    assert os.path.isfile(os.path.join(export_dir, "config.json"))
    model = LlamaForCausalLM.from_pretrained(export_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=fixed_batch()).logits
    torch.testing.assert_close(logits, run["trained_logits"], rtol=1e-5, atol=1e-5)
