"""Bad input across the public API raises a clear error that names the value (and the valid choices), on every rank,
before any collective: one table per area, each an explicit list so the cases can be counted (``CASE_COUNTS``).

Areas: FSDPStrategy's constructor, MixedPrecision, ``fully_shard``, other helpers (wrap and checkpointing policies,
``estimate_memory``, ``ShardingMonitor``, ``HPUAccelerator.parse_devices``, Trainer registrations), checkpoint loaders
on 2 ranks (``trainer.fit(ckpt_path=...)`` with every format damaged in a different way) and in one process (the
offline readers), the ``lightning-fsdp convert`` command and ``lightning-fsdp fit`` with bad YAML values.

Already covered elsewhere, not repeated here: a missing / truncated sharded shard file, a corrupt sharded ``meta.pt``,
a FIFO, a directory with other files, another model's sharded and local checkpoints, another shard layout for a local
checkpoint, strict key mismatches of directories (tests/checkpoint/test_checkpoint_sharded.py,
test_checkpoint_local.py); a local
checkpoint at another world size (test_checkpoint_local.py); AtomicCheckpointIO on missing, truncated, empty and text
files (test_checkpoint_full.py); ``convert`` on a missing source, an existing destination, an empty directory,
``--to local`` and the same path twice (test_checkpoint_convert.py); 13 invalid and 3 out-of-range HPU ``devices``
values (test_hpu_accelerator.py); 6 ``estimate_memory`` and 3 ``ShardingMonitor`` cases (test_monitor.py).

The 2-rank cases run in one launch of tests/scripts/bad_input_run.py; its two processes are started the way torchrun
starts them (a process per rank with LOCAL_RANK and a rendezvous address), so a case that fails on one rank cannot
stop the other, and the process-group timeout is short, so a rank left waiting shows up as an error, not a hang.
"""

from __future__ import annotations

import fractions
import functools
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import tomllib
import torch
from torch import nn

import lightning_fsdp  # noqa: F401  (registers "fsdp_custom")
from benchmarks.ranks import ROOT, clean_env
from lightning_fsdp import FSDPStrategy, MixedPrecision
from lightning_fsdp.engine.options import parse_mixed_precision, parse_module_classes
from tests.scripts.bad_input_run import LOADS, MISUSE
from tests.toolbox.launch import ranks_like_torchrun

EXAMPLES = ROOT / "examples" / "cli"
CLI_BASE = ["--config", str(EXAMPLES / "trainer_cpu.yaml"), "--config", str(EXAMPLES / "gpt_tiny_command.yaml")]
CHOICES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


class Stub(nn.Module):
    pass


# ======================================================================================== 1. FSDPStrategy(...)
# (kwargs, exception type, fragments the message must contain)
CONSTRUCTOR_CASES = [
    # sharding_strategy
    ({"sharding_strategy": "FULL"}, ValueError, ["'FULL'", *CHOICES]),
    ({"sharding_strategy": 3}, ValueError, ["sharding_strategy=3", "FULL_SHARD"]),
    ({"sharding_strategy": None}, ValueError, ["sharding_strategy=None", "FULL_SHARD"]),
    ({"sharding_strategy": ["FULL_SHARD"]}, ValueError, ["['FULL_SHARD']", "SHARD_GRAD_OP"]),
    # auto_wrap_policy
    ({"auto_wrap_policy": "Block"}, TypeError, ["'Block'", "set of nn.Module classes", "callable"]),
    ({"auto_wrap_policy": {int}}, TypeError, ["<class 'int'>", "not an nn.Module subclass"]),
    ({"auto_wrap_policy": 0}, ValueError, ["auto_wrap_policy=0", "positive int"]),
    ({"auto_wrap_policy": -3}, ValueError, ["auto_wrap_policy=-3", "positive int"]),
    ({"auto_wrap_policy": True}, TypeError, ["auto_wrap_policy=True"]),
    ({"auto_wrap_policy": 1.5}, TypeError, ["auto_wrap_policy=1.5", "positive int"]),
    ({"auto_wrap_policy": {"a": 1}}, TypeError, ["{'a': 1}", "callable"]),
    ({"auto_wrap_policy": {"no.such.Module"}}, ValueError, ["'no.such.Module'", "cannot be imported"]),
    ({"auto_wrap_policy": {"torch.nn"}}, TypeError, ["'torch.nn'", "not an nn.Module subclass"]),
    ({"auto_wrap_policy": {"torch.nn.NoSuchLayer"}}, ValueError, ["'torch.nn.NoSuchLayer'", "cannot be imported"]),
    (
        {"auto_wrap_policy": lambda module: True},
        TypeError,
        ["auto_wrap_policy=", "(module, recurse, nonwrapped_numel)"],
    ),
    # activation_checkpointing_policy
    ({"activation_checkpointing_policy": "Block"}, TypeError, ["'Block'", "set of nn.Module classes"]),
    ({"activation_checkpointing_policy": 3}, TypeError, ["activation_checkpointing_policy=3"]),
    ({"activation_checkpointing_policy": {int}}, TypeError, ["<class 'int'>", "not an nn.Module subclass"]),
    ({"activation_checkpointing_policy": {"no.such.Block"}}, ValueError, ["'no.such.Block'", "cannot be imported"]),
    (
        {"activation_checkpointing_policy": lambda module, recurse: True},
        TypeError,
        ["activation_checkpointing_policy=", "activation_checkpointing_policy(module)"],
    ),
    # state_dict_type
    ({"state_dict_type": "zip"}, ValueError, ["'zip'", "'full'", "'sharded'", "'local'"]),
    ({"state_dict_type": None}, ValueError, ["state_dict_type=None", "'full'"]),
    ({"state_dict_type": 1}, ValueError, ["state_dict_type=1", "'sharded'"]),
    # backward_prefetch
    ({"backward_prefetch": "EARLY"}, ValueError, ["'EARLY'", "BACKWARD_PRE", "BACKWARD_POST", "None"]),
    ({"backward_prefetch": False}, ValueError, ["backward_prefetch=False", "BACKWARD_PRE", "or None"]),
    ({"backward_prefetch": 1}, ValueError, ["backward_prefetch=1", "BACKWARD_POST"]),
    # mixed_precision (the option; MixedPrecision's own fields are in the next table)
    ({"mixed_precision": "bf16"}, TypeError, ["mixed_precision='bf16'", "MixedPrecision"]),
    ({"mixed_precision": torch.bfloat16}, TypeError, ["mixed_precision=torch.bfloat16", "MixedPrecision"]),
    # the boolean options
    ({"forward_prefetch": "yes"}, TypeError, ["forward_prefetch='yes'", "True or False"]),
    ({"limit_all_gathers": 1}, TypeError, ["limit_all_gathers=1", "True or False"]),
    ({"sync_module_states": "true"}, TypeError, ["sync_module_states='true'", "True or False"]),
    ({"cpu_offload": "yes"}, TypeError, ["cpu_offload='yes'", "True or False"]),
    ({"cpu_offload": object()}, TypeError, ["cpu_offload=<object", "True or False"]),
    ({"use_orig_params": False}, ValueError, ["use_orig_params=False"]),
    ({"use_orig_params": "no"}, TypeError, ["use_orig_params='no'"]),
    # ignored_modules / ignored_states
    ({"ignored_modules": 3}, TypeError, ["ignored_modules contains 3", "Module or str"]),
    ({"ignored_modules": [1.5]}, TypeError, ["ignored_modules contains 1.5"]),
    ({"ignored_modules": {"a": 1}}, TypeError, ["ignored_modules contains {'a': 1}"]),
    ({"ignored_states": [3]}, TypeError, ["ignored_states contains 3", "Parameter"]),
    # param_init_fn
    ({"param_init_fn": 3}, TypeError, ["param_init_fn=3", "not callable"]),
    ({"param_init_fn": lambda: None}, TypeError, ["param_init_fn=", "param_init_fn(module)"]),
    # device_id
    ({"device_id": -1}, TypeError, ["device_id=-1", "non-negative int or a torch.device"]),
    ({"device_id": True}, TypeError, ["device_id=True"]),
    ({"device_id": "cuda:0"}, TypeError, ["device_id='cuda:0'", "torch.device"]),
    ({"device_id": 1.0}, TypeError, ["device_id=1.0"]),
    # process_group / device_mesh
    ({"process_group": 5}, TypeError, ["process_group=5", "ProcessGroup or a callable"]),
    ({"process_group": "world"}, TypeError, ["process_group='world'"]),
    (
        {"sharding_strategy": "HYBRID_SHARD", "process_group": 5},
        TypeError,
        ["process_group=5", "HYBRID_SHARD", "(shard_group, replicate_group) pair"],
    ),
    ({"device_mesh": object()}, ValueError, ["device_mesh is only used by HYBRID_SHARD", "'FULL_SHARD'"]),
    (
        {"sharding_strategy": "HYBRID_SHARD_ZERO2", "device_mesh": "mesh"},
        ValueError,
        ["device_mesh='mesh'", "2-D DeviceMesh"],
    ),
    (
        {"sharding_strategy": "HYBRID_SHARD", "device_mesh": object(), "process_group": lambda: None},
        ValueError,
        ["either device_mesh or process_group"],
    ),
    # the process options
    ({"start_method": "thread"}, ValueError, ["'thread'", "popen", "spawn", "fork", "forkserver"]),
    ({"start_method": None}, ValueError, ["start_method=None", "popen"]),
    ({"timeout": 5}, TypeError, ["timeout=5", "datetime.timedelta"]),
    ({"timeout": "30m"}, TypeError, ["timeout='30m'", "datetime.timedelta"]),
    ({"timeout": timedelta(seconds=0)}, ValueError, ["timeout=datetime.timedelta(0)", "positive"]),
    ({"process_group_backend": 3}, TypeError, ["process_group_backend=3", "'gloo'"]),
    ({"process_group_backend": ""}, TypeError, ["process_group_backend=''", "'nccl'"]),
    # what the Trainer normally fills in
    ({"accelerator": "cpu"}, TypeError, ["accelerator='cpu'", "Accelerator instance"]),
    ({"parallel_devices": "cpu"}, TypeError, ["parallel_devices='cpu'", "list of torch.device"]),
    ({"parallel_devices": [0, 1]}, TypeError, ["parallel_devices=[0, 1]", "list of torch.device"]),
    ({"cluster_environment": "slurm"}, TypeError, ["cluster_environment='slurm'", "ClusterEnvironment"]),
    ({"checkpoint_io": "torch"}, TypeError, ["checkpoint_io='torch'", "CheckpointIO"]),
    ({"precision_plugin": "bf16-mixed"}, TypeError, ["precision_plugin='bf16-mixed'", "Precision plugin"]),
]


@pytest.mark.parametrize("kwargs,error,fragments", CONSTRUCTOR_CASES, ids=lambda v: None)
def test_constructor_rejects_bad_options(kwargs, error, fragments):
    with pytest.raises(error) as info:
        FSDPStrategy(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_precision_plugin_and_mixed_precision_conflict():
    from lightning_fsdp.precision import FSDPPrecision

    with pytest.raises(ValueError, match=r"precision='bf16-mixed'.*both set the precision"):
        FSDPStrategy(precision_plugin=FSDPPrecision("bf16-mixed"), mixed_precision={"param_dtype": "bfloat16"})


def test_good_values_are_accepted():
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    strategy = FSDPStrategy(
        auto_wrap_policy={"torch.nn.Linear"},
        backward_prefetch=None,
        timeout=None,
        activation_checkpointing_policy=lambda module: False,
        param_init_fn=lambda m: None,
    )
    assert strategy.auto_wrap_policy.classes == (torch.nn.Linear,)
    FSDPStrategy(auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=10))
    assert FSDPStrategy(ignored_modules=nn.Linear(2, 2)).ignored_modules[0].in_features == 2


@pytest.mark.parametrize(
    "device,override,expected",
    # ("mpi" as an override: tests/engine/test_backend_capabilities.py, refused or taken as torch has MPI or not)
    [("cpu", None, "gloo"), ("cuda:0", None, "nccl"), ("hpu:0", None, "hccl"), ("cuda:0", "gloo", "gloo")],
)
def test_backend_follows_the_accelerator_unless_overridden(device, override, expected):
    strategy = FSDPStrategy(parallel_devices=[torch.device(device)], process_group_backend=override)
    assert strategy._get_process_group_backend() == expected


# ======================================================================================== 2. MixedPrecision
# (constructor: MixedPrecision(**kwargs) or the dict form through mixed_precision=, exception, fragments)
MIXED_PRECISION_CASES = [
    ("class", {"param_dtype": "bfloat16"}, TypeError, ["param_dtype='bfloat16'", "floating torch.dtype"]),
    ("class", {"param_dtype": torch.int32}, TypeError, ["param_dtype=torch.int32", "floating torch.dtype"]),
    ("class", {"reduce_dtype": torch.bool}, TypeError, ["reduce_dtype=torch.bool"]),
    ("class", {"buffer_dtype": 16}, TypeError, ["buffer_dtype=16"]),
    ("class", {"keep_low_precision_grads": True}, ValueError, ["keep_low_precision_grads=True", "not supported"]),
    ("class", {"keep_low_precision_grads": "no"}, TypeError, ["keep_low_precision_grads='no'", "True or False"]),
    ("class", {"cast_forward_inputs": 1}, TypeError, ["cast_forward_inputs=1", "True or False"]),
    ("class", {"cast_root_forward_inputs": None}, TypeError, ["cast_root_forward_inputs=None"]),
    ("class", {"param_type": torch.bfloat16}, TypeError, ["param_type"]),
    (
        "dict",
        {"param_type": "bfloat16"},
        ValueError,
        ["'param_type'", "param_dtype", "reduce_dtype", "buffer_dtype", "cast_root_forward_inputs"],
    ),
    ("dict", {"param_dtype": "bfloat17"}, ValueError, ["param_dtype='bfloat17'", "not a torch dtype", "'bfloat16'"]),
    ("dict", {"reduce_dtype": "torch.int8"}, TypeError, ["reduce_dtype=torch.int8", "floating torch.dtype"]),
    ("dict", {"buffer_dtype": "Tensor"}, ValueError, ["buffer_dtype='Tensor'", "not a torch dtype"]),
    ("dict", {"cast_forward_inputs": "yes"}, TypeError, ["cast_forward_inputs='yes'", "True or False"]),
]


@pytest.mark.parametrize("form,kwargs,error,fragments", MIXED_PRECISION_CASES, ids=lambda v: None)
def test_mixed_precision_rejects_bad_fields(form, kwargs, error, fragments):
    with pytest.raises(error) as info:
        if form == "class":
            MixedPrecision(**kwargs)
        else:
            parse_mixed_precision(kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


# ======================================================================================== 3. fully_shard(...)
def _toy() -> nn.Module:
    from tests.toolbox.models import ToyLM

    torch.manual_seed(0)
    return ToyLM()


# (positional module or None for a fresh ToyLM, kwargs, exception, fragments)
FULLY_SHARD_CASES = [
    (3, {}, TypeError, ["module=3", "nn.Module"]),
    ("not a module", {}, TypeError, ["module='not a module'"]),
    (None, {"sharding_strategy": "ZERO3"}, ValueError, ["'ZERO3'", *CHOICES]),
    (None, {"sharding_strategy": "HYBRID_SHARD"}, ValueError, ["'HYBRID_SHARD'", "replicate_group"]),
    (None, {"process_group": 5}, TypeError, ["process_group=5", "ProcessGroup"]),
    (
        None,
        {"sharding_strategy": "HYBRID_SHARD", "replicate_group": "group"},
        TypeError,
        ["replicate_group='group'", "ProcessGroup"],
    ),
    (None, {"auto_wrap_policy": "Block"}, TypeError, ["auto_wrap_policy='Block'"]),
    (None, {"auto_wrap_policy": lambda module, recurse: True}, TypeError, ["(module, recurse, nonwrapped_numel)"]),
    (None, {"mixed_precision": "bf16"}, TypeError, ["mixed_precision='bf16'"]),
    (None, {"backward_prefetch": "EARLY"}, ValueError, ["'EARLY'", "BACKWARD_PRE"]),
    (None, {"cpu_offload": "yes"}, TypeError, ["cpu_offload='yes'", "True or False"]),
    (None, {"sync_module_states": 1}, TypeError, ["sync_module_states=1", "True or False"]),
    (None, {"forward_prefetch": "yes"}, TypeError, ["forward_prefetch='yes'"]),
    (None, {"limit_all_gathers": None}, TypeError, ["limit_all_gathers=None"]),
    (None, {"param_init_fn": 3}, TypeError, ["param_init_fn=3", "not callable"]),
    (None, {"param_init_fn": lambda a, b: None}, TypeError, ["param_init_fn(module)"]),
    (None, {"device": "bogus"}, ValueError, ["device='bogus'", "'cpu'"]),
    (None, {"device": 3.5}, ValueError, ["device=3.5", "torch.device"]),
    (None, {"ignored_modules": [3]}, TypeError, ["ignored_modules contains 3", "nn.Module"]),
    (None, {"ignored_modules": "model.block1"}, TypeError, ["ignored_modules='model.block1'", "iterable"]),
    (None, {"ignored_modules": [nn.Linear(2, 2)]}, ValueError, ["Linear", "not a submodule of ToyLM"]),
    (None, {"ignored_states": ["tiny"]}, TypeError, ["ignored_states contains 'tiny'", "nn.Parameter"]),
    (None, {"ignored_states": [nn.Parameter(torch.zeros(2))]}, ValueError, ["shape (2,)", "not a parameter of ToyLM"]),
]


@pytest.mark.parametrize("module,kwargs,error,fragments", FULLY_SHARD_CASES, ids=lambda v: None)
def test_fully_shard_rejects_bad_arguments(module, kwargs, error, fragments):
    from lightning_fsdp import fully_shard
    from lightning_fsdp.engine import get_engine

    # No process group: the checks come before the first collective, so they need none.
    target = _toy() if module is None else module
    with pytest.raises(error) as info:
        fully_shard(target, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    if isinstance(target, nn.Module):
        assert get_engine(target) is None  # nothing was half-done


def test_fully_shard_twice_is_refused():
    from lightning_fsdp import fully_shard

    model = _toy()
    fully_shard(model, ignored_modules=model.block2)  # a lone module is accepted, like the strategy's option
    with pytest.raises(ValueError, match="ToyLM is already sharded"):
        fully_shard(model)


# ======================================================================================== 4. other helpers
def _hpu_parse(devices):
    from accelerators.hpu import HPUAccelerator

    return HPUAccelerator.parse_devices(devices)


def _estimate(**kwargs):
    from lightning_fsdp.estimate import estimate_memory

    return estimate_memory(**{"model": nn.Linear(2, 2), "world_size": 2, **kwargs})


def _monitor(**kwargs):
    from lightning_fsdp.monitor import ShardingMonitor

    return ShardingMonitor(**kwargs)


def _checkpointing_policy(value):
    from lightning_fsdp.activation_checkpointing import parse_checkpointing_policy

    return parse_checkpointing_policy(value)


def _trainer(**kwargs):
    import lightning as L

    return L.Trainer(**{"accelerator": "cpu", "devices": 2, "logger": False, **kwargs})


# (label, call, exception, fragments)
OTHER_CASES = [
    (
        "parse_module_classes: a string",
        lambda: parse_module_classes("torch.nn.Linear", "policy"),
        TypeError,
        ["policy='torch.nn.Linear'", "set of nn.Module subclasses"],
    ),
    (
        "parse_module_classes: a class",
        lambda: parse_module_classes(nn.Linear, "policy"),
        TypeError,
        ["policy=<class", "set of nn.Module subclasses"],
    ),
    (
        "parse_module_classes: empty path",
        lambda: parse_module_classes([""], "policy"),
        ValueError,
        ["policy names ''", "cannot be imported"],
    ),
    (
        "parse_module_classes: a function",
        lambda: parse_module_classes(["torch.nn.functional.relu"], "policy"),
        TypeError,
        ["'torch.nn.functional.relu'", "not an nn.Module subclass"],
    ),
    (
        "checkpointing policy: a float",
        lambda: _checkpointing_policy(0.5),
        TypeError,
        ["activation_checkpointing_policy=0.5", "callable (module) -> bool"],
    ),
    ("estimate_memory: model", lambda: _estimate(model=3), TypeError, ["model=3", "nn.Module"]),
    (
        "estimate_memory: world_size str",
        lambda: _estimate(world_size="2"),
        ValueError,
        ["world_size='2'", "positive int"],
    ),
    ("estimate_memory: world_size bool", lambda: _estimate(world_size=True), ValueError, ["world_size=True"]),
    ("estimate_memory: rank -1", lambda: _estimate(rank=-1), ValueError, ["rank=-1", "[0, 1]"]),
    (
        "estimate_memory: auto_wrap_policy",
        lambda: _estimate(auto_wrap_policy="Linear"),
        TypeError,
        ["auto_wrap_policy='Linear'"],
    ),
    (
        "estimate_memory: precision flag",
        lambda: _estimate(mixed_precision="64-true"),
        ValueError,
        ["mixed_precision='64-true'", "'bf16-mixed'", "'32-true'"],
    ),
    (
        "estimate_memory: dict field",
        lambda: _estimate(mixed_precision={"dtype": "bfloat16"}),
        ValueError,
        ["'dtype'", "param_dtype"],
    ),
    (
        "ShardingMonitor: log_every str",
        lambda: _monitor(log_every_n_steps="5"),
        ValueError,
        ["log_every_n_steps='5'", "positive int or None"],
    ),
    ("ShardingMonitor: log_every -1", lambda: _monitor(log_every_n_steps=-1), ValueError, ["log_every_n_steps=-1"]),
    ("ShardingMonitor: prefix int", lambda: _monitor(prefix=3), ValueError, ["prefix=3", "non-empty string"]),
    ("HPU devices: a dict", lambda: _hpu_parse({0: 1}), ValueError, ["devices={0: 1}", "-1 or 'auto'"]),
    ("HPU devices: '1.5'", lambda: _hpu_parse("1.5"), ValueError, ["devices='1.5'"]),
    ("HPU devices: [0.5]", lambda: _hpu_parse([0.5]), ValueError, ["devices=[0.5]"]),
    ("HPU devices: (True,)", lambda: _hpu_parse((True,)), ValueError, ["devices=(True,)"]),
    ("HPU devices: bytes", lambda: _hpu_parse(b"1"), ValueError, ["devices=b'1'"]),
    (
        "Trainer: unknown strategy name",
        lambda: _trainer(strategy="fsdp_custom_bogus"),
        ValueError,
        ["strategy='fsdp_custom_bogus'", "choices"],
    ),
    (
        "Trainer: precision fsdp_custom refuses",
        lambda: _trainer(strategy="fsdp_custom", precision="64-true"),
        ValueError,
        ["precision='64-true'", "'32-true'", "'bf16-mixed'"],
    ),
    (
        "Trainer: flag and MixedPrecision",
        lambda: _trainer(
            strategy=FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)), precision="bf16-mixed"
        ),
        ValueError,
        ["precision='bf16-mixed'", "mixed_precision", "only one"],
    ),
]


@pytest.mark.parametrize("label,call,error,fragments", OTHER_CASES, ids=[c[0] for c in OTHER_CASES])
def test_helpers_reject_bad_input(label, call, error, fragments):
    with pytest.raises(error) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


# ======================================================================================== 5. loaders on 2 ranks


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[Path, list[dict], list[tuple]]:
    """Run tests/scripts/bad_input_run.py on 2 ranks once, and the real commands of ``REAL_COMMANDS`` beside it (to
    save time): (the script's work directory, each rank's results, each command's (argv, status, stdout, stderr))."""
    work = tmp_path_factory.mktemp("bad_input")
    commands_dir = tmp_path_factory.mktemp("commands")
    with ranks_like_torchrun("bad_input_run.py", "--work", work, world=2, work=work, timeout=240):
        commands = [
            (
                argv,
                subprocess.Popen(
                    argv, cwd=commands_dir, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                ),
            )
            for argv in _real_commands(commands_dir)
        ]
        try:
            finished = [(argv, *_communicate(proc)) for argv, proc in commands]
        finally:
            for _, proc in commands:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return work, [json.loads((work / f"result.rank{r}.json").read_text()) for r in range(2)], finished


def _communicate(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out, err


# name -> (exception type raised on both ranks, fragments in both messages); the work directory replaces {work}.
LOADER_CASES = {
    "frozen_fit": ("ValueError", ["has no trainable parameters", "validate, test and predict work"]),
    "foreign_optimizer": ("ValueError", ["does not manage", "(3,)", "configure_optimizers"]),
    "full_missing": ("CheckpointNotFoundError", ["{work}/no_such_dir/missing.ckpt", "does not exist either"]),
    "full_random_bytes": ("CheckpointLoadError", ["{work}/random.ckpt", "is not a PyTorch checkpoint"]),
    "full_not_a_dict": ("CheckpointLoadError", ["{work}/tensor.ckpt", "holds a Tensor, not a checkpoint dict"]),
    "full_no_state_dict": ("CheckpointMismatchError", ["no 'state_dict' entry", "'global_step'"]),
    "full_state_not_tensor": ("CheckpointMismatchError", ["'model.tiny' is a str, not a tensor", "(1, 5)"]),
    "full_other_model": ("CheckpointMismatchError", ["'model.tiny' has shape (1, 5)", "(1, 6)", "another model"]),
    "full_extra_param_strict": ("CheckpointMismatchError", ["missing keys ['extra']", "strict=False"]),
    "full_other_optimizer": ("CheckpointMismatchError", ["sizes [6, 6]", "[12]", "same optimizer configuration"]),
    "full_two_optimizers": ("CheckpointMismatchError", ["state of 2 optimizer(s)", "configured 1"]),
    "full_bad_optimizer_state": ("CheckpointMismatchError", ["not a torch.optim state dict", "'momentum_buffer'"]),
    "sharded_no_meta": ("CheckpointLoadError", ["{work}/sharded_no_meta", "'meta.pt'", "is missing"]),
    "sharded_corrupt_metadata": (
        "CheckpointLoadError",
        ["{work}/sharded_corrupt_metadata", "'.metadata'", "truncated or corrupt"],
    ),
    "sharded_corrupt_shard": (
        "CheckpointLoadError",
        ["{work}/sharded_corrupt_shard", "shard data is corrupt", "rank 0"],
    ),
    "sharded_other_optimizer": ("CheckpointMismatchError", ["{work}/good_sharded", "sizes [6, 6]", "[12]"]),
    "local_rank0_random": (
        "CheckpointLoadError",
        ["{work}/local_rank0_random/rank-0.pt", "is not a PyTorch checkpoint"],
    ),
    "local_rank1_empty": ("CheckpointLoadError", ["{work}/local_rank1_empty", "'rank-1.pt' is empty"]),
    "local_rank_files_swapped": (
        "CheckpointLoadError",
        ["rank-1.pt' holds the shards of rank 0 of 2", "assembled from different saves"],
    ),
    "local_meta_truncated": ("CheckpointLoadError", ["{work}/local_meta_truncated/meta.pt", "truncated or corrupt"]),
    "local_meta_foreign": (
        "CheckpointLoadError",
        ["{work}/local_meta_foreign/meta.pt", "does not describe a local checkpoint"],
    ),
    "local_other_optimizer": ("CheckpointMismatchError", ["{work}/good_local", "sizes [6, 6]", "[12]"]),
    "dir_only_meta": ("CheckpointLoadError", ["{work}/dir_only_meta", "shard files are missing"]),
    "dir_rank_files_no_meta": (
        "CheckpointIsDirectoryError",
        ["{work}/dir_rank_files_no_meta", "is a directory but not a checkpoint", "'rank-0.pt'"],
    ),
}


def test_loader_table_matches_the_script():
    assert set(LOADER_CASES) == (set(MISUSE) | set(LOADS)) - {"frozen_eval"}


@pytest.mark.parametrize("name", list(LOADER_CASES))
def test_bad_checkpoint_or_misuse_fails_on_every_rank(launch, name):
    work, results, _ = launch
    kind, fragments = LOADER_CASES[name]
    for rank, result in enumerate(results):
        assert "error" in result[name], (rank, result[name])
        error, message = result[name]["error"]
        assert error == kind, (rank, error, message)
        for fragment in fragments:
            assert fragment.format(work=work) in message, (rank, fragment, message)


def test_frozen_model_validates_tests_and_predicts(launch):
    for result in launch[1]:
        assert result["frozen_eval"] == {"ok": "1 predictions"}


# ======================================================================================== 6. offline readers
def _read_sharded(path):
    from lightning_fsdp.checkpoint.sharded import read_sharded_checkpoint_full

    return read_sharded_checkpoint_full(path, weights_only=False)


def _read_local(path):
    from lightning_fsdp.checkpoint.local import read_local_checkpoint_full

    return read_local_checkpoint_full(path, weights_only=False)


def _load_as_full(path):
    from lightning_fsdp.checkpoint.convert import load_as_full

    return load_as_full(path)


def _atomic_io(path, weights_only=None):
    from lightning_fsdp.checkpoint.atomic_io import AtomicCheckpointIO

    return AtomicCheckpointIO().load_checkpoint(path, weights_only=weights_only)


# (reader, source under the work directory, exception type name, fragments)
READER_CASES = [
    (_read_sharded, "sharded_corrupt_shard", "CheckpointLoadError", ["shard data is corrupt"]),
    (_read_sharded, "sharded_corrupt_metadata", "CheckpointLoadError", ["'.metadata'", "truncated or corrupt"]),
    (_read_sharded, "sharded_no_meta", "CheckpointNotFoundError", ["meta.pt", "not found"]),
    (_read_local, "local_rank0_random", "CheckpointLoadError", ["rank-0.pt", "not a PyTorch checkpoint"]),
    (_read_local, "local_rank1_empty", "CheckpointLoadError", ["'rank-1.pt' is empty"]),
    (_read_local, "local_rank_files_swapped", "CheckpointLoadError", ["holds the shards of rank 0 of 2"]),
    (_read_local, "local_meta_foreign", "CheckpointLoadError", ["does not describe a local checkpoint"]),
    (_read_local, "good_sharded", "CheckpointLoadError", ["does not describe a local checkpoint"]),
    (_load_as_full, "no_state_dict.ckpt", "CheckpointLoadError", ["is not a Lightning checkpoint", "'state_dict'"]),
    (_load_as_full, "bad_optimizer_state.ckpt", "CheckpointMismatchError", ["not a torch.optim state dict"]),
    (_load_as_full, "dir_only_meta", "CheckpointLoadError", ["shard files are missing"]),
    (_atomic_io, "random.ckpt", "CheckpointLoadError", ["(4096 bytes) is not a PyTorch checkpoint"]),
    (_atomic_io, "good_local/rank-0.pt", None, []),  # control: an intact file loads
]


@pytest.mark.parametrize("reader,source,error,fragments", READER_CASES, ids=[c[1] for c in READER_CASES])
def test_offline_readers_name_the_problem(launch, reader, source, error, fragments):
    path = str(launch[0] / source)
    if error is None:
        assert isinstance(reader(path), dict)
        return
    with pytest.raises(Exception) as info:
        reader(path)
    assert type(info.value).__name__ == error, info.value
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_weights_only_refusal_of_an_intact_file_says_so(tmp_path):
    from lightning_fsdp.checkpoint.atomic_io import CheckpointLoadError

    path = tmp_path / "object.ckpt"
    torch.save({"state_dict": {}, "odd": fractions.Fraction(1, 3)}, path)
    with pytest.raises(CheckpointLoadError, match="weights_only=True. refused an object"):
        _atomic_io(str(path), weights_only=True)


# ======================================================================================== 7. lightning-fsdp convert
# (arguments with {work} for the work directory and {out} for a fresh output folder, exit status, fragments)
CONVERT_CASES = [
    (["{work}/random.ckpt", "{out}/x"], 1, ["{work}/random.ckpt", "not a PyTorch checkpoint"]),
    (["{work}/tensor.ckpt", "{out}/x"], 1, ["holds a Tensor"]),
    (["{work}/no_state_dict.ckpt", "{out}/x"], 1, ["is not a Lightning checkpoint", "'state_dict'"]),
    (["{work}/bad_optimizer_state.ckpt", "{out}/x"], 1, ["not a torch.optim state dict"]),
    (["{work}/sharded_corrupt_shard", "{out}/x.ckpt"], 1, ["sharded_corrupt_shard", "shard data is corrupt"]),
    (["{work}/sharded_corrupt_metadata", "{out}/x.ckpt"], 1, ["'.metadata'", "truncated or corrupt"]),
    (["{work}/sharded_no_meta", "{out}/x.ckpt"], 1, ["is incomplete", "'meta.pt'"]),
    (["{work}/local_rank1_empty", "{out}/x.ckpt"], 1, ["'rank-1.pt' is empty"]),
    (["{work}/local_rank_files_swapped", "{out}/x.ckpt"], 1, ["holds the shards of rank 0 of 2"]),
    (["{work}/local_meta_truncated", "{out}/x.ckpt"], 1, ["meta.pt", "truncated or corrupt"]),
    (["{work}/local_meta_foreign", "{out}/x.ckpt"], 1, ["does not describe a local checkpoint"]),
    (["{work}/dir_rank_files_no_meta", "{out}/x.ckpt"], 1, ["is a directory but not a checkpoint"]),
    (["{work}/good_local", "{work}/good.ckpt"], 1, ["{work}/good.ckpt", "exists; pass --overwrite"]),
    (["{work}/good_sharded", "{work}/random.ckpt/x.ckpt"], 1, ["random.ckpt"]),  # the destination's folder is a file
    (["{work}/good.ckpt", "{out}/x", "--to", "zip"], 2, ["invalid choice: 'zip'", "'full'", "'sharded'"]),
    (["{work}/good.ckpt"], 2, ["the following arguments are required: DST"]),
]


@pytest.mark.parametrize("args,status,fragments", CONVERT_CASES, ids=lambda v: None)
def test_convert_command_errors(launch, tmp_path, capsys, args, status, fragments):
    from lightning_fsdp.cli import main

    work = launch[0]
    argv = [a.format(work=work, out=tmp_path) for a in args]
    try:
        code = main(["convert", *argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == status, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment.format(work=work) in err, (fragment, err)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "a temporary file was left behind"


# ======================================================================================== 8. lightning-fsdp fit
# (YAML for trainer.strategy, fragments the error must contain); each is run through the command's main() in this
# process, as the console script runs it.
STRATEGY_BY_CLASS = "trainer:\n  strategy:\n    class_path: lightning_fsdp.FSDPStrategy\n    init_args:\n"
CLI_CASES = [
    (STRATEGY_BY_CLASS + "      sharding_strategy: BOGUS\n", ["sharding_strategy='BOGUS'", *CHOICES]),
    (STRATEGY_BY_CLASS + "      state_dict_type: zip\n", ["state_dict_type='zip'", "'full'", "'sharded'", "'local'"]),
    (
        STRATEGY_BY_CLASS + "      auto_wrap_policy: [lightning_fsdp.demo.gpt.NoSuchBlock]\n",
        ["'lightning_fsdp.demo.gpt.NoSuchBlock'", "cannot be imported"],
    ),
    (
        STRATEGY_BY_CLASS + "      activation_checkpointing_policy: [no_such_package.Block]\n",
        ["'no_such_package.Block'", "cannot be imported"],
    ),
    (STRATEGY_BY_CLASS + "      backward_prefetch: EARLY\n", ["backward_prefetch='EARLY'", "BACKWARD_POST"]),
    # jsonargparse checks MixedPrecision's fields itself, while parsing (no traceback either):
    (
        STRATEGY_BY_CLASS + "      mixed_precision: {param_dtype: torch.bfloat17}\n",
        ['Parser key "param_dtype"', "torch.bfloat17"],
    ),
    (
        STRATEGY_BY_CLASS + "      mixed_precision: {param_type: torch.bfloat16}\n",
        ["Option 'param_type' is not accepted"],
    ),
    (STRATEGY_BY_CLASS + "      mixed_precision: {param_dtype: torch.int8}\n", ["param_dtype=torch.int8", "floating"]),
    (STRATEGY_BY_CLASS + "      start_method: thread\n", ['Parser key "start_method"', "thread", "popen"]),
    (STRATEGY_BY_CLASS + "      forward_prefetch: maybe\n", ["forward_prefetch", "maybe"]),
    ("trainer:\n  strategy: fsdp_custom_bogus\n", ["strategy='fsdp_custom_bogus'"]),
    ("trainer:\n  precision: 64-true\n", ["precision='64-true'", "'bf16-mixed'"]),
]


@pytest.mark.parametrize("yaml,fragments", CLI_CASES, ids=lambda v: None)
def test_fit_command_reports_bad_yaml_values(tmp_path, capsys, monkeypatch, yaml, fragments):
    from lightning_fsdp.cli import main

    config = tmp_path / "bad.yaml"
    config.write_text(yaml)
    monkeypatch.setattr(sys, "argv", ["lightning-fsdp"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["fit", *CLI_BASE, "--config", str(config)])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


# ======================================================================================== 9. the real commands
def _console_script() -> list[str]:
    """``lightning-fsdp`` as installed, else what its generated script does (the entry point in pyproject.toml)."""
    installed = Path(sys.executable).with_name("lightning-fsdp")
    if installed.exists():
        return [str(installed)]
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["lightning-fsdp"]
    module, func = entry.split(":")
    return [
        sys.executable,
        "-c",
        f"import sys; sys.argv[0] = 'lightning-fsdp'; from {module} import {func}; sys.exit({func}())",
    ]


def _real_commands(folder: Path) -> list[list[str]]:
    """The commands of ``REAL_COMMANDS``, with their input files made in ``folder`` (started by ``launch``)."""
    (folder / "garbage.ckpt").write_bytes(bytes(range(256)) * 8)
    (folder / "bad.yaml").write_text(STRATEGY_BY_CLASS + "      sharding_strategy: BOGUS\n")
    return [[*prefix, *(a.format(dir=folder) for a in args)] for prefix, args, _, _ in REAL_COMMANDS]


# The commands as a user types them, each in its own process: (program, arguments, exit status, fragments of stderr).
# The other cases of both commands run through the same main() in this process (sections 7 and 8).
REAL_COMMANDS = [
    (
        [sys.executable, "-m", "lightning_fsdp.checkpoint.convert"],
        ["{dir}/garbage.ckpt", "{dir}/out"],
        1,
        ["lightning-fsdp convert: error:", "garbage.ckpt", "not a PyTorch checkpoint"],
    ),
    (
        _console_script(),
        ["fit", *CLI_BASE, "--config", "{dir}/bad.yaml"],
        2,
        ["lightning-fsdp: error:", "sharding_strategy='BOGUS'", "FULL_SHARD", "LIGHTNING_FSDP_DEBUG"],
    ),
]


def test_real_commands_exit_non_zero_without_a_traceback(launch):
    for (argv, code, out, err), (_, _, status, fragments) in zip(launch[2], REAL_COMMANDS):
        assert code == status, (argv, out[-2000:], err[-3000:])
        assert "Traceback" not in err, (argv, err[-3000:])
        for fragment in fragments:
            assert fragment in err, (argv, fragment, err[-3000:])
    assert not (Path(launch[2][0][0][-1])).exists()  # convert wrote nothing


# ======================================================================================== the count
CASE_COUNTS = {
    "constructor": len(CONSTRUCTOR_CASES) + 1,  # + the precision_plugin / mixed_precision conflict
    "MixedPrecision": len(MIXED_PRECISION_CASES),
    "fully_shard": len(FULLY_SHARD_CASES) + 1,  # + sharding a module twice
    "loaders (2 ranks)": len([n for n in LOADER_CASES if n not in MISUSE]),
    "loaders (offline readers)": len([c for c in READER_CASES if c[2] is not None]) + 1,  # + weights_only refusal
    "convert": len(CONVERT_CASES) + 1,  # + 1 run of the real command
    "CLI (fit)": len(CLI_CASES) + 1,  # + 1 run of the real command
    "other": len(OTHER_CASES) + len([n for n in LOADER_CASES if n in MISUSE]),  # + misuse on 2 ranks
}


def test_report_the_number_of_bad_input_cases():
    total = sum(CASE_COUNTS.values())
    # Printed so that `pytest -s` (or the log of a CI run with -rA) shows it; the counts are also importable.
    print(f"bad-input cases: {total} " + ", ".join(f"{k}: {v}" for k, v in CASE_COUNTS.items()))
    assert total >= 150
