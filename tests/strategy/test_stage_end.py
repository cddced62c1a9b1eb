"""``weights_after_stage``: what the module holds when a Trainer stage ends (issue 27, item 1).

The choices are checked at construction here; their end states on 2 CPU ranks come from one launch of
tests/scripts/stage_end_run.py (every case trains the same model, so the weights each case holds must be equal).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.ranks import clean_env
from lightning_fsdp import FSDPStrategy
from lightning_fsdp.stage_end import FREE_MEMORY_VARIABLE, free_host_memory
from tests.toolbox.launch import rank_outputs, run_script
from tests.toolbox.one_device import toy_lm_on_samples

# ToyLM's named parameters (the tied head once).
PARAMETERS = 14


@pytest.mark.parametrize("value", ["none", "Full", "", None, True, 0])
def test_bad_value_names_the_choices(value):
    with pytest.raises(ValueError, match=r"weights_after_stage=.*'auto', 'full', 'rank0', 'sharded'") as info:
        FSDPStrategy(weights_after_stage=value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", ["auto", "full", "rank0", "sharded"])
def test_valid_values(value):
    assert FSDPStrategy(weights_after_stage=value)._stage_end.choice == value


def test_rank0_refused_with_pipelining():
    # Rank 0 holds only its own stages: the other stages' weights would be kept nowhere.
    with pytest.raises(ValueError, match=r"weights_after_stage='rank0'.*pipeline_parallel_size=2.*'full' or 'sharded'"):
        FSDPStrategy(weights_after_stage="rank0", pipeline_parallel_size=2)
    assert FSDPStrategy(weights_after_stage="full", pipeline_parallel_size=2)._stage_end.choice == "full"


def test_default_is_auto():
    assert FSDPStrategy()._stage_end.choice == "auto"


def test_free_host_memory(monkeypatch):
    monkeypatch.delenv(FREE_MEMORY_VARIABLE, raising=False)
    measured = free_host_memory()
    assert measured is not None and measured > 2**20  # this machine reports its free memory
    monkeypatch.setenv(FREE_MEMORY_VARIABLE, "12345")
    assert free_host_memory() == 12345


# ------------------------------------------------------------------------------------------------ 2 ranks
_launch: dict = {}


def stage_end_run(tmp_path_factory) -> dict:
    """{case: [rank 0's result, rank 1's]} of one launch of the script (once per pytest process)."""
    if not _launch:
        folder = tmp_path_factory.mktemp("stage_end")
        out = folder / "out.pt"
        env = clean_env()
        env.pop(FREE_MEMORY_VARIABLE, None)
        run_script("stage_end_run.py", "--out", out, env=env, cwd=folder, timeout=400)
        ranks = rank_outputs(out, 2)
        _launch.update({case: [ranks[0][case], ranks[1][case]] for case in ranks[0]})
    return _launch


def assert_weights_equal(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected) and len(expected) == PARAMETERS
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_full_every_rank_holds_the_weights_on_the_host(tmp_path_factory):
    run = stage_end_run(tmp_path_factory)
    for rank, result in enumerate(run["full"]):
        assert not result["engine"], rank
        assert result["param_devices"] == ["cpu"] and result["buffer"][0] == "cpu"
        assert_weights_equal(result["values"], run["full"][0]["values"])
        assert all(torch.isfinite(v).all() for v in result["values"].values())


def test_rank0_only_rank0_holds_the_weights(tmp_path_factory):
    run = stage_end_run(tmp_path_factory)
    zero, one = run["rank0"]
    assert not zero["engine"] and zero["param_devices"] == ["cpu"]
    assert_weights_equal(zero["values"], run["full"][0]["values"])
    # The other ranks: no engine, meta-device parameters of the full shapes (no storage), buffers on the host.
    assert not one["engine"]
    assert one["param_devices"] == ["meta"] and one["values"] == {}
    assert one["shapes"] == zero["shapes"] and len(one["shapes"]) == PARAMETERS
    device, buffer = one["buffer"]
    assert device == "cpu" and torch.equal(buffer, torch.full((5,), 0.5))
    for result in (zero, one):  # a later stage is refused alike on every rank, naming the cause
        assert "weights_after_stage='rank0'" in result["validate_error"]


def test_sharded_keeps_the_engine_and_later_stages_work(tmp_path_factory):
    run = stage_end_run(tmp_path_factory)
    sharded, full = run["sharded"], run["full"]
    full_numel = sum(v.numel() for v in full[0]["values"].values())
    for rank, result in enumerate(sharded):
        assert result["engine"], rank
        assert result["local_numel"] < full_numel
    assert sum(r["local_numel"] for r in sharded) == full_numel  # the shards, once each
    gathered = {k: v for k, v in sharded[0]["gathered"].items() if k in full[0]["values"]}
    assert_weights_equal(gathered, full[0]["values"])
    # trainer.validate on the sharded module and a second fit (new Trainer) give what the re-sharded module gives.
    for rank in range(2):
        assert sharded[rank]["val_loss"] == full[rank]["val_loss"]
        assert_weights_equal(sharded[rank]["second_fit"]["values"], full[rank]["second_fit"]["values"])
        assert not sharded[rank]["second_fit"]["engine"]
    assert not torch.equal(full[0]["second_fit"]["values"]["model.tiny"], full[0]["values"]["model.tiny"])


def one_device_weights_and_momentum() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, momentum buffers) of the script's training on one device: the same seed and model, 3 steps of SGD
    with momentum on the global batch (the 2 ranks' DistributedSampler shares of samples 6s .. 6s+5 at step s), the
    module's buffer (0.5 five times) summed into the output."""
    run = toy_lm_on_samples(3, 6, 24, forward=lambda model, x: model(x) + torch.full((5,), 0.5).sum())
    names = {id(p): f"model.{n}" for n, p in run.model.named_parameters()}
    weights = {names[id(p)]: p.detach().clone() for p in run.model.parameters()}
    return weights, {names[id(p)]: state["momentum_buffer"] for p, state in run.optimizer.state.items()}


def test_checkpoints_load_back_after_the_stage_ended(tmp_path_factory):
    # Saved after fit with weights_after_stage="full", then loaded into overwritten weights: each format gives back
    # the weights the module held after fit, which are one device's, and one device's full-size momentum.
    run = stage_end_run(tmp_path_factory)
    weights, momentum_one_device = one_device_weights_and_momentum()
    compared = 0
    for rank, result in enumerate(run["full"]):
        shapes = result["shapes"]
        trainable = sorted(n for n in shapes if not n.startswith("model.frozen."))  # SGD keeps no state for frozen
        momenta = [loaded["momentum"] for loaded in result["reloaded"].values()]
        assert len(momenta) == 3, rank
        for kind, loaded in result["reloaded"].items():
            assert_weights_equal(loaded["values"], result["values"])
            assert sorted(loaded["values"]) == sorted(weights), kind
            for name, value in loaded["values"].items():
                torch.testing.assert_close(value, weights[name], rtol=1e-5, atol=1e-6, msg=f"{kind} {name}")
                compared += 1
            assert loaded["buffer"][0] == "cpu" and torch.equal(loaded["buffer"][1], torch.full((5,), 0.5)), kind
            assert sorted(loaded["momentum"]) == trainable, kind
            for name, momentum in loaded["momentum"].items():
                assert tuple(momentum.shape) == shapes[name], (kind, name)
                assert torch.equal(momentum, momenta[0][name]), (kind, name)
                assert (momentum != -1).any(), (kind, name)
                torch.testing.assert_close(momentum, momentum_one_device[name], rtol=1e-5, atol=1e-6)
                compared += 1
    assert compared == 2 * 3 * (PARAMETERS + PARAMETERS - 2)


def test_auto_keeps_the_model_sharded_when_memory_is_short(tmp_path_factory):
    run = stage_end_run(tmp_path_factory)
    zero, one = run["auto_short"]
    assert zero["engine"] and one["engine"]
    assert zero["param_devices"] == one["param_devices"] == ["cpu"]
    assert len(zero["warnings"]) == 1 and one["warnings"] == []  # rank 0 warns, once
    message = zero["warnings"][0]
    for hint in ("state_dict_type='sharded'", "lightning-fsdp export", "weights_after_stage='rank0'"):
        assert hint in message, hint


def test_auto_gathers_when_memory_is_ample(tmp_path_factory):
    run = stage_end_run(tmp_path_factory)
    for rank, result in enumerate(run["auto_ample"]):
        assert not result["engine"] and result["warnings"] == [], rank
        assert_weights_equal(result["values"], run["full"][0]["values"])


def test_failed_stage_stays_sharded_for_a_retry(tmp_path_factory):
    run = stage_end_run(tmp_path_factory)
    full_numel = sum(v.numel() for v in run["full"][0]["values"].values())
    for rank, result in enumerate(run["failed"]):
        assert result["error"] == "planned failure", rank
        assert result["engine"] and result["local_numel"] < full_numel  # weights_after_stage="full" not applied
        retried = result["second_fit"]
        assert not retried["engine"] and retried["param_devices"] == ["cpu"]
        assert len(retried["values"]) == PARAMETERS
