"""Pipeline benchmark: P=2 x D=2 with each schedule against fsdp_custom and DDP over 4 ranks, on one GPT and batch.

``python -m benchmarks.pipeline --out DIR`` trains the same GPT (same seed, same global batch every
step) in 4 gloo processes on CPU, one thread each, as five variants:

* ``pp_gpipe`` / ``pp_1f1b`` / ``pp_interleaved``: pipeline parallelism P=2 x D=2 with torch's ``GPipe``,
  ``1F1B`` and ``Interleaved1F1B`` (2 stages per pipeline rank) schedules, M microbatches per data-parallel rank,
  each stage FULL_SHARD over its 2 data-parallel ranks (global rank = pp_rank * D + dp_rank);
* ``fsdp_x4``: fsdp_custom FULL_SHARD over all 4 ranks (P=1);
* ``ddp_x4``: torch DistributedDataParallel over all 4 ranks.

It writes ``results.json``, ``results.md`` and ``plot.png`` (benchmarks/pipeline_report.py).

[Note: what the pipeline benchmark runs]
The model is :class:`~lightning_fsdp.demo.gpt.PipelineGPT`: the demo GPT's ``Block`` s between an embedding
piece (``wte`` + ``wpe``) and ``ln_f``, ``lm_head`` (untied). The demo GPT itself cannot be pipelined as it is:
its ``lm_head`` is tied to ``wte`` (one parameter in the first and the last stage, refused by
lightning_fsdp/pipeline/split.py), its forward
adds ``wpe(pos)`` in the middle of the chain (an absent ``wpe`` would add the position ids themselves to the hidden
state), and it reads ``B, T = idx.shape`` from its input, which on a later stage is the hidden state. Stages are
the balanced split (by parameter count) that ``FSDPStrategy`` uses by default; the report records them.

Each variant is driven the way ``FSDPStrategy`` drives it, without Lightning in the way (so that all five can live
in one process and be interleaved step by step): the root module that ``fully_shard`` shards is a
:class:`StepModule` holding the model, whose forward is the training step's ``pipelined_loss(model, x, y, loss_fn)``
(as the strategy routes ``training_step`` through the LightningModule's forward); the pipeline variants build
``pipeline_layout``, a ``PipelineRuntime`` over the model and then ``fully_shard`` over the data-parallel group, and
hand the engine to the runtime, as ``FSDPStrategy.setup`` does. Every ``Block`` is a sharded unit; the root unit takes
the rest (on a pipeline rank: the embedding and/or the head that its stages hold). AdamW over the root's parameters.

Timing interleaves the variants as the main benchmark does: every process holds all five (same seed, so the same
initial weights), and each round runs one step of every variant on the same global batch, in an order rotated from
round to round, each variant on process groups of its own. Drift of a shared machine then slows all alike. A step's
time is ``zero_grad`` + the root's forward (for a pipeline: every microbatch's forward, P2P and backward) +
backward (not for a pipeline: it ran inside) + ``optimizer.step()``; the step's time is its slowest rank's.

[Note: how the bytes are counted, and the theory]
Per rank and timed step (the warmup steps are excluded: the first pipelined step also does torch's P2P handshake):

* all-gather and reduce-scatter: the engine's ``CommStats`` (lightning_fsdp/engine/comm.py), which count the bytes
  this rank passes *into* each collective: an all-gather's input (this rank's shard), a reduce-scatter's full-size
  input.
* P2P: what torch.distributed.pipelining sends. This process (only the benchmark's) replaces
  ``torch.distributed.isend`` / ``irecv`` (which ``P2POp``, ``batch_isend_irecv`` and the schedules call) by
  counting wrappers, and tags the tensors of the stage's ``get_fwd_send_ops`` (activations) and
  ``get_bwd_send_ops`` (gradients of the stage's input), so each sent byte lands in one of the two. (The runtime's
  scalar loss broadcast and all-reduce, 8 bytes a step, are collectives and not counted.)
* DDP's all-reduce runs in its C++ reducer, out of Python's sight: theory only.

The theory, from the parameter shapes alone (4 bytes per float32 element). With ``D`` ranks in the shard group,
a parameter of shape ``(r, ...)`` contributes ``shard(p) = ceil(r / D) * numel(p) / r`` elements to a flat collective
(lightning_fsdp/engine/layout.py: every rank sends ``ceil(r / D)`` rows, padded). For a unit ``u`` with parameters
``p_1..p_k``::

    AG(u) = 4 * sum_i shard(p_i)                    one all-gather: this rank's shard
    RS(u) = 4 * D * (sum_i shard(p_i) + k)          one reduce-scatter: full padded gradient + one used-flag per
                                                     parameter per rank (lightning_fsdp/engine/unit.py)

    FULL_SHARD, per step, M microbatches (M = 1 without pipelining):
    all-gather     = AG(root) + 2 * M * sum_blocks AG(block)
                     (each Block is gathered for each microbatch's forward and again for its backward; the root
                     unit takes part in the step's last backward only, so it stays gathered for the whole step)
                     - AG(last block) without pipelining: the last unit of the forward stays gathered into its
                     backward, which comes next (the benchmark times steps after the first, which records the order)
    reduce-scatter = sum_units RS(unit)
                     (once per step: the runtime defers the reduction to each stage's last microbatch, no_sync)

    P2P, per rank: a microbatch's activation is (G / D / M) x seq x width floats, a = 4 * that bytes:
    activations sent = a * M * (local stages that are not the last)
    gradients sent   = a * M * (local stages that are not the first)
    per pipeline     = a * 2 (forward + backward) * (S - 1) boundaries * M        (S = P * stages per rank)

    DDP: all-reduce = 4 * (number of parameters), per step.

The figures hold for every schedule, Interleaved1F1B's several stages per rank included (each stage's units are
reduced in its own last backward: lightning_fsdp/pipeline/runtime.py, [Note: gradient reduction per stage]).

On the wire (an estimate for ring algorithms; gloo picks its own): an all-gather sends ``(D - 1)`` times its input,
a reduce-scatter ``(D - 1) / D`` of its input, an all-reduce ``2 (D - 1) / D`` of its tensor, P2P what it sends. So
FULL_SHARD's per-step wire traffic is ``2 M params_stage (D - 1) / D`` gathered plus ``params_stage (D - 1) / D``
reduced, padding and flags aside.

[Note: how memory is measured]
After the timed rounds, each variant runs again on its own, freshly built, for ``mem_steps`` steps inside
:class:`~benchmarks.memory.LiveTensorBytes` (torch.profiler's allocator events, counted on every
thread, from before the model is built): the peak live tensor bytes over those steps, per rank. Model state is
:func:`~benchmarks.memory.model_state_bytes` (parameters + gradients + AdamW state this rank holds).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import ConfigOption, add_config_options, command_line, config_fields, gpt_config, machine
from benchmarks.memory import LIVE_BYTES_METHOD, MODEL_STATE_METHOD, LiveTensorBytes, model_state_bytes
from benchmarks.ranks import join_gloo_group, report_rank, run_ranks
from benchmarks.report import paired_ratio
from lightning_fsdp.demo.gpt import Block, GPTConfig, PipelineGPT, next_token_loss

__all__ = [
    "PipelineBenchmarkConfig",
    "VARIANTS",
    "WORLD_SIZE",
    "engine_theory",
    "p2p_theory",
    "run_pipeline_benchmark",
]

WORLD_SIZE = 4
PIPELINE_SIZE = 2
ELEMENT_BYTES = 4  # float32


@dataclass(frozen=True)
class VariantSpec:
    key: str
    name: str
    pipeline: bool  # P=2 x D=2; else P=1 over all ranks
    schedule: str | None = None  # the pipeline schedule
    ddp: bool = False
    # Units stay gathered from the step's first forward to the optimizer step (reshard_after_forward=False and
    # reshard_after_backward=False): each is gathered once per step instead of twice per microbatch.
    kept: bool = False


VARIANTS: dict[str, VariantSpec] = {
    v.key: v
    for v in (
        VariantSpec("pp_gpipe", "P=2 x D=2 GPipe", True, "GPipe"),
        VariantSpec("pp_1f1b", "P=2 x D=2 1F1B", True, "1F1B"),
        VariantSpec("pp_interleaved", "P=2 x D=2 Interleaved1F1B", True, "Interleaved1F1B"),
        VariantSpec("pp_1f1b_kept", "P=2 x D=2 1F1B, units kept gathered", True, "1F1B", kept=True),
        VariantSpec("fsdp_x4", "fsdp_custom FULL_SHARD x4", False),
        VariantSpec("ddp_x4", "torch DDP x4", False, ddp=True),
    )
}
DDP_KEY, FSDP_KEY = "ddp_x4", "fsdp_x4"


@dataclass
class PipelineBenchmarkConfig:
    """What to run. Global batch ``global_batch`` sequences per step: G / 4 per rank for the x4 variants, G / 2 per
    data-parallel rank (cut into ``microbatches``) for the pipelines."""

    layers: int = 6
    width: int = 384
    heads: int = 6
    seq: int = 64
    vocab: int = 64  # >= 62 (the bundled text's characters); 64 splits evenly over 2 and 4 ranks
    global_batch: int = 16
    microbatches: int = 4
    steps: int = 20  # timed steps, after warmup
    warmup: int = 2
    mem_steps: int = 2
    threads: int = 1
    lr: float = 3e-4  # at 1e-3 the default model spikes near step 9 and rounding differences grow past 1e-5
    seed: int = 0
    loss_rtol: float = 1e-5
    timeout: float = 1200.0  # seconds the whole run may take before its processes are killed
    collective_timeout: float = 300.0

    def gpt_config(self) -> GPTConfig:
        return gpt_config(self, tie_weights=False)

    def check(self) -> None:
        data = WORLD_SIZE // PIPELINE_SIZE
        if self.global_batch % WORLD_SIZE or self.global_batch % (data * self.microbatches):
            raise ValueError(
                f"global_batch={self.global_batch} must be a multiple of {WORLD_SIZE} (the x4 variants' ranks) and "
                f"of {data} x microbatches={self.microbatches} (each data-parallel rank's microbatches)"
            )
        if self.layers < 2:
            raise ValueError("layers must be >= 2: Interleaved1F1B cuts the model into 4 stages")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")
        from lightning_fsdp.options import PipelineOptions

        for spec in VARIANTS.values():
            if spec.pipeline:  # torch's rules on microbatches per schedule, as the strategy checks them
                PipelineOptions.parse(PIPELINE_SIZE, spec.schedule, self.microbatches)


# -------------------------------------------------------------------------------------------------- model
class StepModule(nn.Module):
    """The root that is sharded, as the LightningModule is under ``FSDPStrategy``: its forward is the training step's
    loss, ``pipelined_loss`` (the plain ``next_token_loss(model(x), y)`` without pipelining)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from lightning_fsdp import pipelined_loss

        return pipelined_loss(self.model, x, y, next_token_loss)


# ------------------------------------------------------------------------------------------------ theory
def shard_numel(shape: tuple[int, ...] | torch.Size, ranks: int) -> int:
    """Elements a parameter of ``shape`` puts into a flat collective over ``ranks`` (``ceil(rows / ranks)`` rows)."""
    rows = shape[0] if len(shape) else 1
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return -(-rows // ranks) * row


def engine_theory(
    model: nn.Module, pieces: list[str], ranks: int, microbatches: int, *, kept: bool = False, pipelined: bool = True
) -> dict[str, int]:
    """Bytes this rank passes into all-gathers and reduce-scatters per FULL_SHARD step (see the module docstring):
    ``pieces`` are the model's pieces this rank holds; every ``Block`` among them is a unit, the rest the root's."""
    root: list[torch.Size] = []
    blocks: list[list[torch.Size]] = []
    for name in pieces:
        module = model.get_submodule(name)
        shapes = [p.shape for p in module.parameters()]
        if isinstance(module, Block):
            blocks.append(shapes)
        else:
            root.extend(shapes)

    def gather(shapes: list[torch.Size]) -> int:
        return ELEMENT_BYTES * sum(shard_numel(s, ranks) for s in shapes)

    def reduce(shapes: list[torch.Size]) -> int:
        return ELEMENT_BYTES * ranks * (sum(shard_numel(s, ranks) for s in shapes) + len(shapes))

    units = ([root] if root else []) + blocks
    m = microbatches
    last_kept = gather(blocks[-1]) if blocks and not pipelined and not kept else 0
    return {
        "all_gather": gather(root) + (1 if kept else 2 * m) * sum(gather(b) for b in blocks) - last_kept,
        "reduce_scatter": sum(reduce(u) for u in units),
    }


def p2p_theory(
    cfg: PipelineBenchmarkConfig, local_stages: list[int], num_stages: int, data_size: int
) -> dict[str, int]:
    """Bytes this rank sends per step through P2P: one activation forward per microbatch and boundary below it, one
    input gradient backward per microbatch and boundary above it."""
    m = cfg.microbatches
    activation = ELEMENT_BYTES * (cfg.global_batch // data_size // m) * cfg.seq * cfg.width
    return {
        "p2p_activations": activation * m * sum(1 for s in local_stages if s < num_stages - 1),
        "p2p_gradients": activation * m * sum(1 for s in local_stages if s > 0),
        "microbatch_activation_bytes": activation,
    }


def wire_estimate(comm: dict[str, float], ranks: int) -> float:
    """Bytes a rank puts on the wire per step under ring algorithms (see [Note: how the bytes are counted ...])."""
    n = ranks
    return (
        comm.get("all_gather", 0) * (n - 1)
        + comm.get("reduce_scatter", 0) * (n - 1) / n
        + comm.get("all_reduce", 0) * 2 * (n - 1) / n
        + comm.get("p2p_activations", 0)
        + comm.get("p2p_gradients", 0)
        + comm.get("p2p_other", 0)
    )


# ------------------------------------------------------------------------------------------ P2P counting
class P2PCounter:
    """Counts the bytes torch.distributed.pipelining sends and receives, per variant (``current``), in this process.

    ``torch.distributed.isend`` / ``irecv`` are replaced (in ``torch.distributed`` and its ``distributed_c10d``, whose
    ``P2POp`` and ``batch_isend_irecv`` compare ops with them) by wrappers that count the tensor's bytes; the stage's
    ``get_fwd_send_ops`` / ``get_bwd_send_ops`` tag the tensors they send as activations / gradients. Install before
    any ``P2POp`` is built (the schedules build theirs at the first step).
    """

    KINDS = ("p2p_activations", "p2p_gradients", "p2p_other")

    def __init__(self) -> None:
        self.current: str | None = None
        self.sent: dict[str, dict[str, int]] = {}
        self.received: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._tags: dict[int, tuple[torch.Tensor, str]] = {}

    def reset(self, key: str) -> None:
        self.sent[key] = dict.fromkeys(self.KINDS, 0)
        self.received[key] = 0
        self.calls[key] = 0

    def install(self) -> None:
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed.pipelining.stage import _PipelineStageBase

        isend, irecv = c10d.isend, c10d.irecv

        def counted_isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            tagged = self._tags.pop(id(tensor), None)
            kind = tagged[1] if tagged is not None and tagged[0] is tensor else "p2p_other"
            if self.current is not None:
                self.sent.setdefault(self.current, dict.fromkeys(self.KINDS, 0))
                self.sent[self.current][kind] += tensor.numel() * tensor.element_size()
                self.calls[self.current] = self.calls.get(self.current, 0) + 1
            return isend(tensor, *args, **kwargs)

        def counted_irecv(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.current is not None:
                self.received[self.current] = (
                    self.received.get(self.current, 0) + tensor.numel() * tensor.element_size()
                )
            return irecv(tensor, *args, **kwargs)

        for module in (c10d, dist):
            module.isend = counted_isend
            module.irecv = counted_irecv

        def tagging(original: Any, kind: str) -> Any:
            def ops(stage: Any, chunk: int) -> list:
                result = original(stage, chunk)
                for op in result:
                    self._tags[id(op.tensor)] = (op.tensor, kind)
                return result

            return ops

        _PipelineStageBase.get_fwd_send_ops = tagging(_PipelineStageBase.get_fwd_send_ops, "p2p_activations")
        _PipelineStageBase.get_bwd_send_ops = tagging(_PipelineStageBase.get_bwd_send_ops, "p2p_gradients")


# ------------------------------------------------------------------------------------------------- data
def global_batch(tokens: torch.Tensor, cfg: PipelineBenchmarkConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: ``global_batch`` windows of ``seq + 1`` ids starting at
    ``torch.randint(0, len(tokens) - seq - 1)`` from a generator seeded ``seed * 100_003 + step`` (the main
    benchmark's rule); inputs the first ``seq`` ids of each window, targets the last ``seq``."""
    generator = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    starts = torch.randint(0, len(tokens) - cfg.seq - 1, (cfg.global_batch,), generator=generator)
    windows = torch.stack([tokens[s : s + cfg.seq + 1] for s in starts.tolist()])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _share(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    size = x.shape[0] // parts
    return x[index * size : (index + 1) * size]


# ------------------------------------------------------------------------------------------ the variants
class Built:
    """One variant on this rank: the root to call, its optimizer, and what the report needs to know about it."""

    def __init__(self, key: str, cfg: PipelineBenchmarkConfig, rank: int, timeout: timedelta) -> None:
        from lightning_fsdp.engine import fully_shard
        from lightning_fsdp.options import PipelineOptions
        from lightning_fsdp.pipeline.runtime import PipelineRuntime, pipeline_layout

        spec = VARIANTS[key]
        self.key = key
        torch.manual_seed(cfg.seed)
        model = PipelineGPT(cfg.gpt_config())
        self.pieces = _all_pieces(model)
        self.root: nn.Module = StepModule(model)
        self.engine: Any = None
        self.runtime: Any = None
        if spec.pipeline:
            options = PipelineOptions.parse(PIPELINE_SIZE, spec.schedule, cfg.microbatches)
            layout = pipeline_layout(options.size, WORLD_SIZE, rank, "cpu", timeout)
            self.runtime = PipelineRuntime(model, options, layout, torch.device("cpu"))
            self.engine = fully_shard(
                self.root, process_group=layout.dp_group, sharding_strategy="FULL_SHARD", auto_wrap_policy={Block}
            )
            self.runtime.attach_engine(self.engine)
            if spec.kept:
                self.engine.set_reshard_after_forward(False)
                self.engine.set_reshard_after_backward(False)
            self.batch_index, self.batch_parts = layout.dp_rank, layout.data_size
            self.local_stages = list(self.runtime.local_stages)
            self.stages = [list(s) for s in self.runtime.stages]
            self.pieces = [p for s in self.local_stages for p in self.stages[s]]
            self.data_size, self.pp_rank = layout.data_size, layout.pp_rank
            self.call = self.root
        else:
            group = dist.new_group(backend="gloo", timeout=timeout)
            if spec.ddp:
                from torch.nn.parallel import DistributedDataParallel

                self.call = DistributedDataParallel(self.root, process_group=group)
            else:
                self.engine = fully_shard(
                    self.root, process_group=group, sharding_strategy="FULL_SHARD", auto_wrap_policy={Block}
                )
                self.call = self.root
            self.batch_index, self.batch_parts = rank, WORLD_SIZE
            self.local_stages, self.stages = [0], [self.pieces]
            self.data_size, self.pp_rank = WORLD_SIZE, 0
        self.optimizer = torch.optim.AdamW(self.root.parameters(), lr=cfg.lr)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """One training step on this rank's share of the global batch; (seconds, loss)."""
        x, y = _share(x, self.batch_index, self.batch_parts), _share(y, self.batch_index, self.batch_parts)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.call(x, y)
        if loss.requires_grad:  # a pipelined step ran its backward inside (and returned the global loss)
            loss.backward()
        self.optimizer.step()
        return time.perf_counter() - start, loss.detach().item()

    def engine_bytes(self) -> dict[str, int] | None:
        if self.engine is None:
            return None
        stats = self.engine.shard_comm.stats
        return {
            "all_gather": stats.all_gather_bytes,
            "reduce_scatter": stats.reduce_scatter_bytes,
            "all_reduce": stats.all_reduce_bytes,
            "all_gather_calls": stats.all_gather_calls,
            "reduce_scatter_calls": stats.reduce_scatter_calls,
            "all_reduce_calls": stats.all_reduce_calls,
        }


def _all_pieces(model: nn.Module) -> list[str]:
    from lightning_fsdp.pipeline.split import pipeline_pieces

    return pipeline_pieces(model)


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[pipeline-benchmark] {text}", file=sys.stderr, flush=True)


def _timing(rank: int, cfg: PipelineBenchmarkConfig, tokens: torch.Tensor, counter: P2PCounter) -> dict[str, Any]:
    timeout = timedelta(seconds=cfg.collective_timeout)
    built = {key: Built(key, cfg, rank, timeout) for key in VARIANTS}
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    losses: dict[str, list[float]] = {k: [] for k in VARIANTS}
    keys = list(VARIANTS)
    total = cfg.warmup + cfg.steps
    for step in range(total):
        if step == cfg.warmup:  # count the timed steps only
            for key, b in built.items():
                if b.engine is not None:
                    b.engine.shard_comm.stats.reset()
                counter.reset(key)
        x, y = global_batch(tokens, cfg, step)
        shift = step % len(keys)
        for key in keys[shift:] + keys[:shift]:
            counter.current = key
            seconds, loss = built[key].step(x, y)
            counter.current = None
            times[key].append(seconds)
            losses[key].append(loss)
        _say(
            rank,
            f"timing step {step + 1}/{total}{' (warmup)' if step < cfg.warmup else ''}: "
            + ", ".join(f"{k} {times[k][-1] * 1e3:.0f} ms" for k in keys),
        )
    out = {}
    for key, b in built.items():
        out[key] = {
            "step_s": times[key][cfg.warmup :],
            "warmup_s": times[key][: cfg.warmup],
            "losses": losses[key],
            "engine_bytes": b.engine_bytes(),
            "p2p_sent": dict(counter.sent.get(key, {})),
            "p2p_received": counter.received.get(key, 0),
            "p2p_calls": counter.calls.get(key, 0),
            "counted_steps": cfg.steps,
            "pieces": b.pieces,
            "local_stages": b.local_stages,
            "stages": b.stages,
            "data_size": b.data_size,
            "pp_rank": b.pp_rank,
            "model_state": model_state_bytes(b.root, b.optimizer),
        }
    return out


def _memory(rank: int, key: str, cfg: PipelineBenchmarkConfig, tokens: torch.Tensor) -> dict[str, Any]:
    live = LiveTensorBytes()
    losses = []
    with live:
        b = Built(key, cfg, rank, timedelta(seconds=cfg.collective_timeout))
        with live.window():
            for step in range(cfg.mem_steps):
                x, y = global_batch(tokens, cfg, step)
                _, loss = b.step(x, y)
                losses.append(loss)
        state = model_state_bytes(b.root, b.optimizer)
        gathered = b.engine.shard_comm.stats.peak_gathered_units if b.engine is not None else None
        del b
    _say(rank, f"memory run {key}: peak live {live.peak / 2**20:.1f} MiB on rank 0")
    return {
        "peak_live_bytes": live.peak,
        "live_at_start_bytes": live.at_window_start,
        "live_bytes_all_threads": live.all_threads,
        "model_state": state,
        "peak_gathered_units": gathered,
        "losses": losses,
    }


def _worker(rank: int, folder: str, cfg_dict: dict[str, Any]) -> None:
    from benchmarks import _token_stream

    cfg = PipelineBenchmarkConfig(**cfg_dict)
    counter = P2PCounter()
    counter.install()  # before the group exists: every P2P send is counted
    join_gloo_group(folder, rank, WORLD_SIZE, threads=cfg.threads, timeout=cfg.collective_timeout)
    tokens = _token_stream(cfg.vocab)

    def measure() -> dict[str, Any]:
        timing = _timing(rank, cfg, tokens, counter)
        return {"timing": timing, "memory": {key: _memory(rank, key, cfg, tokens) for key in VARIANTS}}

    report_rank(folder, rank, measure)


def _run_processes(cfg: PipelineBenchmarkConfig) -> list[dict[str, Any]]:
    return run_ranks(
        _worker,
        lambda folder: (folder, asdict(cfg)),
        WORLD_SIZE,
        threads=cfg.threads,
        timeout=cfg.timeout,
        name="pipeline benchmark",
    )


# ----------------------------------------------------------------------------------------------- summary
def _per_step(total: dict[str, int] | None, steps: int) -> dict[str, float]:
    if not total:
        return {}
    return {k: v / steps for k, v in total.items()}


def _summarise(key: str, ranks: list[dict[str, Any]], cfg: PipelineBenchmarkConfig, meta: nn.Module) -> dict[str, Any]:
    spec = VARIANTS[key]
    timing = [r["timing"][key] for r in ranks]
    memory = [r["memory"][key] for r in ranks]
    per_step = [max(ts) for ts in zip(*(t["step_s"] for t in timing))]
    steps = timing[0]["counted_steps"]
    num_stages = len(timing[0]["stages"])
    row: dict[str, Any] = {
        "key": key,
        "name": spec.name,
        "schedule": spec.schedule,
        "pipeline_size": PIPELINE_SIZE if spec.pipeline else 1,
        "data_size": timing[0]["data_size"],
        "microbatches": cfg.microbatches if spec.pipeline else 1,
        "stages": timing[0]["stages"],
        "step_ms": [s * 1e3 for s in per_step],
        "median_step_ms": statistics.median(per_step) * 1e3 if per_step else None,
        "min_step_ms": min(per_step) * 1e3 if per_step else None,
        # Every rank of a pipeline returns the global loss; a DDP / FSDP rank its share's: the mean over all ranks
        # is the global batch's loss for both.
        "losses": [statistics.fmean(v) for v in zip(*(t["losses"] for t in timing))],
        "memory_run_losses": [statistics.fmean(v) for v in zip(*(m["losses"] for m in memory))],
        "peak_live_bytes": [m["peak_live_bytes"] for m in memory],
        "live_at_start_bytes": [m["live_at_start_bytes"] for m in memory],
        "live_bytes_all_threads": all(m["live_bytes_all_threads"] for m in memory),
        "model_state": [m["model_state"] for m in memory],
        "peak_gathered_units": [m["peak_gathered_units"] for m in memory],
        "ranks": [],
    }
    row["final_loss"] = row["losses"][-1] if row["losses"] else None
    row["known_difference"] = KNOWN_DIFFERENCES.get(key)
    for rank, t in enumerate(timing):
        measured = _per_step(t["engine_bytes"], steps)
        measured.update(_per_step(t["p2p_sent"], steps))
        if spec.ddp:
            theory: dict[str, float] = {"all_reduce": ELEMENT_BYTES * sum(p.numel() for p in meta.parameters())}
            measured = {k: v for k, v in measured.items() if k.startswith("p2p")}
            source = "all-reduce: theory only (DDP's C++ reducer); P2P: counted (none)"
        else:
            theory = dict(
                engine_theory(
                    meta, t["pieces"], t["data_size"], row["microbatches"], kept=spec.kept, pipelined=spec.pipeline
                )
            )
            source = "engine CommStats; P2P: counted isend"
        if spec.pipeline:
            theory.update(p2p_theory(cfg, t["local_stages"], num_stages, t["data_size"]))
        kinds = ["all_gather", "reduce_scatter", "all_reduce", "p2p_activations", "p2p_gradients"]
        measured_cmp = {k: measured.get(k, 0) for k in kinds if not (spec.ddp and k == "all_reduce")}
        theory_cmp = {k: theory.get(k, 0) for k in measured_cmp}
        row["ranks"].append(
            {
                "rank": rank,
                "pp_rank": t["pp_rank"],
                "local_stages": t["local_stages"],
                "pieces": t["pieces"],
                "measured_per_step": measured,
                "theory_per_step": theory,
                "p2p_other_per_step": measured.get("p2p_other", 0),
                "p2p_received_per_step": t["p2p_received"] / steps,
                "matches_theory": all(measured_cmp[k] == theory_cmp[k] for k in measured_cmp),
                "excess_per_step": {
                    k: measured_cmp[k] - theory_cmp[k] for k in measured_cmp if measured_cmp[k] != theory_cmp[k]
                },
                "wire_estimate_per_step": wire_estimate(
                    {**measured, **({"all_reduce": theory["all_reduce"]} if spec.ddp else {})}, t["data_size"]
                ),
                "source": source,
            }
        )
    return row


def _compare(rows: list[dict[str, Any]], rtol: float) -> None:
    by_key = {r["key"]: r for r in rows}
    ddp, fsdp = by_key.get(DDP_KEY), by_key.get(FSDP_KEY)
    for row in rows:
        for ref, name in ((ddp, "ddp"), (fsdp, "fsdp")):
            if ref is None:
                continue
            row[f"ratio_to_{name}"] = row["median_step_ms"] / ref["median_step_ms"] if ref["median_step_ms"] else None
            row[f"paired_ratio_to_{name}"] = paired_ratio(row, ref)
        if ddp is not None:
            diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["losses"], ddp["losses"])]
            row["loss_max_rel_diff"] = max(diffs) if diffs else None
            row["loss_agrees"] = bool(diffs) and all(math.isfinite(d) and d <= rtol for d in diffs)


def run_pipeline_benchmark(
    cfg: PipelineBenchmarkConfig, out: str | Path | None = None, command: str | None = None
) -> dict[str, Any]:
    """Run every variant (see the module docstring); write results.json/.md and plot.png into ``out`` if given."""
    cfg.check()
    with torch.device("meta"):
        meta = PipelineGPT(cfg.gpt_config())
    num_parameters = sum(p.numel() for p in meta.parameters())
    print(
        f"[pipeline-benchmark] PipelineGPT {cfg.layers} x {cfg.width}, {num_parameters:,} parameters; global batch "
        f"{cfg.global_batch} x {cfg.seq}; {WORLD_SIZE} gloo processes; variants {', '.join(VARIANTS)}",
        file=sys.stderr,
        flush=True,
    )
    started = time.time()
    ranks = _run_processes(cfg)
    rows = [_summarise(key, ranks, cfg, meta) for key in VARIANTS]
    _compare(rows, cfg.loss_rtol)
    results = {
        "command": command,
        "config": asdict(cfg),
        "model": "PipelineGPT (lightning_fsdp.demo.gpt: the demo GPT as a chain of embed, blocks, ln_f, lm_head)",
        "num_parameters": num_parameters,
        "param_bytes": num_parameters * ELEMENT_BYTES,
        "world_size": WORLD_SIZE,
        "pipeline_size": PIPELINE_SIZE,
        "variants": rows,
        "methods": {
            "step_time": "zero_grad + root forward (pipelines: every microbatch's forward, P2P and backward) + "
            "backward (not for pipelines) + optimizer.step, perf_counter; per step the slowest rank; median over the "
            "timed steps; variants interleaved step by step on the same global batch, order rotated each round",
            "peak_live": LIVE_BYTES_METHOD + "; each variant alone, freshly built, after the timed rounds",
            "model_state": MODEL_STATE_METHOD,
            "collectives": "lightning_fsdp's CommStats over the timed steps: bytes this rank passes into each "
            "collective (all-gather: its shard; reduce-scatter: the full-size input incl. padding and used-flags)",
            "p2p": "torch.distributed.isend/irecv wrapped in the benchmark's processes (what P2POp, "
            "batch_isend_irecv and the pipelining schedules call); tensors from get_fwd_send_ops counted as "
            "activations, from get_bwd_send_ops as gradients; bytes sent by this rank per timed step",
            "wire_estimate": "ring algorithms: all-gather (D-1) x input, reduce-scatter (D-1)/D x input, all-reduce "
            "2(D-1)/D x tensor, P2P as sent",
        },
        "theory": THEORY_TEXT,
        "environment": machine(),
        "elapsed_s": time.time() - started,
    }
    if out is not None:
        from benchmarks.pipeline_report import write_report

        write_report(results, Path(out))
    return results


KNOWN_DIFFERENCES: dict[str, str] = {}  # where a variant as built moves more than the theory: none now

THEORY_TEXT = [
    "shard(p) = ceil(rows(p) / D) * numel(p) / rows(p)   (elements a parameter puts into a flat collective over D)",
    "AG(unit) = 4 * sum_p shard(p);  RS(unit) = 4 * D * (sum_p shard(p) + k)   (k parameters: one used-flag each)",
    "all-gather / step = AG(root) + 2 * M * sum_blocks AG(block)   (M = 1 without pipelining)",
    "  with units kept gathered (1F1B, kept): AG(root) + sum_blocks AG(block)   (once per step)",
    "reduce-scatter / step = sum_units RS(unit)   (the pipeline reduces on each stage's last microbatch only)",
    "a = 4 * (G / D / M) * seq * width   (one microbatch's activation, = its input gradient)",
    "P2P activations / step = a * M * (local stages that are not last); gradients = a * M * (not first)",
    "P2P per pipeline / step = a * 2 * (S - 1) * M   (S stages: forward + backward over each boundary)",
    "DDP all-reduce / step = 4 * parameters",
]


# --------------------------------------------------------------------------------------------------- CLI
_CONFIG_OPTIONS: tuple[ConfigOption, ...] = (
    ("layers", int, "GPT n_layer (>= 2)"),
    ("width", int, "GPT n_embd"),
    ("heads", int, "GPT n_head"),
    ("seq", int, "sequence length (= block_size)"),
    ("vocab", int, "vocabulary size, >= 62"),
    ("global_batch", int, "sequences per step over all ranks"),
    ("microbatches", int, "pipeline microbatches per data-parallel rank"),
    ("steps", int, "timed steps after warmup"),
    ("warmup", int, "untimed first steps (>= 1: the first pipelined step does a P2P handshake)"),
    ("mem_steps", int, "steps of each variant's profiled memory run"),
    ("threads", int, "torch threads per process"),
    ("lr", float, "AdamW learning rate"),
    ("seed", int, "model and data seed"),
    ("loss_rtol", float, "relative tolerance for every step's loss to agree with DDP's"),
    ("timeout", float, "seconds before the processes are killed"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pipeline",
        description="Train one GPT in 4 gloo processes on CPU as P=2 x D=2 pipelines (GPipe, 1F1B, "
        "Interleaved1F1B), fsdp_custom FULL_SHARD x4 and DDP x4, interleaved; report step time, memory, bytes "
        "moved against theory, and losses.",
    )
    add_config_options(parser, PipelineBenchmarkConfig(), _CONFIG_OPTIONS)
    parser.add_argument("--out", default="pipeline-benchmark-results", help="output folder (default %(default)s)")
    args = parser.parse_args(argv)
    for name in ("layers", "width", "heads", "seq", "global_batch", "microbatches", "steps", "mem_steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first pipelined step includes torch's P2P handshake)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = PipelineBenchmarkConfig(**config_fields(args, _CONFIG_OPTIONS))
    try:
        cfg.check()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    results = run_pipeline_benchmark(cfg, out=args.out, command=command_line("benchmarks.pipeline", argv))
    disagree = [r["name"] for r in results["variants"] if r.get("loss_agrees") is False]
    mismatch = [r["name"] for r in results["variants"] if not all(x["matches_theory"] for x in r["ranks"])]
    print(
        f"results in {args.out}/results.md"
        + (f"; losses disagree with DDP's: {', '.join(disagree)}" if disagree else "")
        + (f"; bytes differ from theory: {', '.join(mismatch)}" if mismatch else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
