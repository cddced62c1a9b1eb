"""A checkpoint from elsewhere never runs code: a malicious pickle planted in each file of each format, read by every
reader, is refused naming the file and the object, on every rank, and nothing it holds runs.

The matrix: every planted case of tests/scripts/untrusted_run.py (``PLANTED``: the full file; a sharded checkpoint's
``.metadata``, its ``meta.pt``, a model tensor and an optimizer hyper-parameter in a ``.distcp`` data file, and a
``.metadata`` whose storage path leads out of the directory; a local checkpoint's ``meta.pt``, ``rank-0.pt`` and
``rank-1.pt``) is read by the four readers: resume on 2 ranks (``trainer.fit(ckpt_path=..., weights_only=True)``, plus
``weights_only`` unset for the two DCP reads this package makes itself), ``lightning-fsdp convert``, ``lightning-fsdp
export`` and ``load_as_full``. The payload (``os.system("touch DIR/ran-CASE")``) leaves a marker if it runs; no marker
may exist after any case. The same checkpoints intact load with every reader. Controls show that each planted payload
is live (it runs when unpickled without restriction, and ``--trust-pickled-code`` / ``trust_pickled_code=True``
runs it) and that the escaping path would be followed without the check, so a refusal here is the protection's doing.

The 2-rank cases run in one launch of the script (about 30 s); the others in this process (a few seconds).
"""

from __future__ import annotations

import fractions
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from lightning_fsdp import cli
from lightning_fsdp.checkpoint.atomic_io import CheckpointLoadError, UntrustedCheckpointError
from lightning_fsdp.checkpoint.convert import load_as_full
from lightning_fsdp.checkpoint.safe_load import read_dcp_metadata
from tests.scripts.untrusted_run import (
    GOOD,
    INTACT,
    PLANTED,
    RESUMES,
    checkpoint_name,
    marker,
    markers,
    plant,
)
from tests.toolbox.launch import ranks_like_torchrun

READERS = ["resume", "convert", "export", "load_as_full"]
# Files export does not read: it takes the model's tensors alone, so neither meta.pt nor the optimizer's entries. It
# succeeds there, and nothing runs.
NOT_READ = {("sharded_meta", "export"), ("sharded_distcp_bytes", "export")}
# The case without a payload: its refusal names the stray path instead of an object.
ESCAPE = "sharded_metadata_escape"

# (case, reader) for every planted file and reader, the resumes with weights_only unset, and every intact checkpoint.
MATRIX = (
    [(case, reader) for case in PLANTED for reader in READERS]
    + [(name, "resume") for name in RESUMES if name.endswith("_unset")]
    + [(case, reader) for case in INTACT for reader in READERS]
)


def test_the_matrix_counts():
    assert len(PLANTED) == 9 and len(INTACT) == 3
    assert len(MATRIX) == len(set(MATRIX)) == 9 * 4 + 2 + 3 * 4 == 50
    refused = [c for c in MATRIX if c[0] not in INTACT and (c[0].removesuffix("_unset"), c[1]) not in NOT_READ]
    assert len(refused) == 36


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[Path, dict[str, str], list[dict]]:
    """Run tests/scripts/untrusted_run.py on 2 ranks once: (its work directory, case -> planted file, each rank's
    results)."""
    work = tmp_path_factory.mktemp("untrusted")
    # A rank left waiting would time out (60 s) before the 240 s.
    with ranks_like_torchrun("untrusted_run.py", "--work", work, world=2, work=work, timeout=240):
        pass
    planted = {case: _planted_file(work, case) for case in PLANTED}
    return work, planted, [json.loads((work / f"result.rank{r}.json").read_text()) for r in range(2)]


def _planted_file(work: Path, case: str) -> str:
    kind, inside = PLANTED[case]
    path = work / checkpoint_name(case)
    if inside == "":
        return str(path)
    if inside == "distcp":  # the .distcp file holding the planted entry
        with open(path / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # written by the test itself
        flat = "model.model.emb.weight" if case == "sharded_distcp_tensor" else "optimizer_0.param_groups.0.lr"
        info = next(s for i, s in metadata.storage_data.items() if i.fqn == flat)
        return str(path / info.relative_path)
    return str(path / inside)


def _assert_refusal(message: str, case: str, file: str, opt_in: str) -> None:
    assert file in message, (file, message)
    if case == ESCAPE:
        assert "../sharded_metadata_escape-outside.distcp" in message and "not a file inside" in message, message
    else:
        assert "refused an object in it (posix.system)" in message, message
        assert "Nothing in the file was run" in message and opt_in in message, message


# ===================================================================================================== resume
RESUME_REFUSED = [name for name, (_, wo) in RESUMES.items() if not name.startswith("intact_")]


@pytest.mark.parametrize("name", RESUME_REFUSED)
def test_resume_refuses_on_every_rank(launch, name):
    work, planted, results = launch
    case = name.removesuffix("_unset")
    for rank, result in enumerate(results):
        assert "error" in result[name], (rank, name, result[name])
        error, message = result[name]["error"]
        assert error == ("CheckpointLoadError" if case == ESCAPE else "UntrustedCheckpointError"), (rank, error)
        _assert_refusal(message, case, planted[case], "weights_only=False")
        assert result[name]["ran"] == [], (rank, name, result[name]["ran"])


@pytest.mark.parametrize("case", list(INTACT))
def test_resume_loads_intact_checkpoints(launch, case):
    for rank, result in enumerate(launch[2]):
        ok = result[case].get("ok")
        assert ok is not None, (rank, result[case])
        # Loaded: the saved step is restored (no step trained: max_steps=1 reached), the parameters are the saved ones.
        assert ok["global_step"] == 1 and ok["steps_run"] == 0, ok
        assert ok["sum"] == result["saved_sum"], (ok, result["saved_sum"])


# ===================================================================================================== offline
def _read(reader: str, src: str, out: Path, capsys) -> tuple[int, str]:
    """(exit status, error text) of one offline reader on ``src``."""
    if reader == "load_as_full":
        try:
            load_as_full(src)
        except CheckpointLoadError as exc:
            return 1, f"{type(exc).__name__}: {exc}"
        return 0, ""
    capsys.readouterr()
    status = cli.main([reader, src, str(out / "out")])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("case", list(PLANTED))
@pytest.mark.parametrize("reader", ["convert", "export", "load_as_full"])
def test_offline_readers_refuse(launch, case, reader, tmp_path, capsys):
    """Each case on a plant of its own (the launch's plants are the 2-rank cases'), so a payload that runs is this
    reader's doing."""
    plants, out = tmp_path / "plants", tmp_path / "out"
    plants.mkdir()
    out.mkdir()
    file = plant(str(launch[0]), case, into=str(plants))
    status, text = _read(reader, str(plants / checkpoint_name(case)), out, capsys)
    assert not os.path.exists(marker(str(plants), case)), f"the payload of {case} ran in {reader}"
    if (case, reader) in NOT_READ:
        assert status == 0, text
        return
    assert status == 1, (reader, case)
    if reader == "load_as_full":
        expected = "CheckpointLoadError" if case == ESCAPE else "UntrustedCheckpointError"
        assert text.startswith(expected + ":"), text
    opt_in = "trust_pickled_code=True" if reader == "load_as_full" else "--trust-pickled-code"
    _assert_refusal(text, case, file, opt_in)
    assert os.listdir(out) == [], os.listdir(out)  # nothing written, nothing left behind


@pytest.mark.parametrize("kind", list(GOOD))
def test_offline_readers_load_intact_checkpoints(launch, kind, tmp_path, capsys):
    work = launch[0]
    src = str(work / GOOD[kind])
    for reader in ("convert", "export"):
        status, text = _read(reader, src, tmp_path / reader, capsys)
        assert status == 0, (reader, text)
    full = load_as_full(src)
    reference = load_as_full(str(work / GOOD["full"]))
    assert full["global_step"] == 1
    assert list(full["state_dict"]) == list(reference["state_dict"])
    for key, value in reference["state_dict"].items():
        assert torch.equal(full["state_dict"][key], value), key


def test_no_payload_ran(launch):
    """After every case above (this test runs last): no marker anywhere in the work directory."""
    assert markers(str(launch[0])) == []


# ===================================================================================================== controls
@pytest.fixture(scope="module")
def control(launch, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The same plants, made by the same code in a directory of their own (their markers there too)."""
    folder = tmp_path_factory.mktemp("control")
    return folder, {case: plant(str(launch[0]), case, into=str(folder)) for case in PLANTED}


def _slice(folder: Path, flat: str) -> bytes:
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written by the test itself
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == flat)
    with open(folder / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


@pytest.mark.parametrize("case", [c for c in PLANTED if c != ESCAPE])
def test_control_the_payload_runs_when_trusted(control, case):
    """Each plant is live: trusted by name, the readers run it (torch reads a .distcp tensor weights-only whatever
    the caller says, so that one is shown by unpickling its bytes unrestricted)."""
    folder, _ = control
    src = str(folder / checkpoint_name(case))
    assert not os.path.exists(marker(str(folder), case))
    if case == "sharded_distcp_tensor":
        with pytest.raises(UntrustedCheckpointError):
            load_as_full(src, trust_pickled_code=True)
        torch.load(io.BytesIO(_slice(Path(src), "model.model.emb.weight")), weights_only=False)
    else:
        load_as_full(src, trust_pickled_code=True)
    assert os.path.exists(marker(str(folder), case))


@pytest.mark.parametrize("command", ["convert", "export"])
def test_control_the_commands_run_it_with_the_flag(launch, command, tmp_path, capsys):
    folder = tmp_path / "plants"
    folder.mkdir()
    src = plant(str(launch[0]), "local_rank1", into=str(folder))  # read by both commands
    assert cli.main([command, os.path.dirname(src), str(tmp_path / "out"), "--trust-pickled-code"]) == 0
    assert os.path.exists(marker(str(folder), "local_rank1"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no process group, on purpose
def test_control_the_escaping_path_is_followed_without_the_check(control):
    """torch's own reader follows the stray path and loads the file outside the directory."""
    folder, _ = control
    target = {"model.model.emb.weight": torch.empty(7, 5)}
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.load(target, checkpoint_id=str(folder / ESCAPE), planner=planner, no_dist=True)
    assert target["model.model.emb.weight"].abs().sum() > 0


def test_metadata_unpickler_allows_what_the_user_allowed(launch, tmp_path):
    """A class in .metadata that DCP's metadata is not made of is refused by name; allowed as torch.load's allowlist
    is (torch.serialization.safe_globals / add_safe_globals), it loads."""
    folder = tmp_path / "sharded"
    shutil.copytree(launch[0] / GOOD["sharded"], folder)
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written by the test itself
    metadata.planner_data["extra"] = fractions.Fraction(1, 3)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UntrustedCheckpointError, match=r"refused an object in it \(fractions\.Fraction\)"):
        read_dcp_metadata(str(folder))
    with torch.serialization.safe_globals([fractions.Fraction]):
        assert read_dcp_metadata(str(folder)).planner_data["extra"] == fractions.Fraction(1, 3)
    with pytest.raises(UntrustedCheckpointError):  # the allowance ended with the block
        read_dcp_metadata(str(folder))
