"""Tensor-parallel benchmark: TP=2 x DP=2 and P=2 x TP=2 under fsdp_custom against fsdp_custom FULL_SHARD over 4 ranks
and Lightning's ``ModelParallelStrategy`` (FSDP2 x TP) on the same layout, through Lightning, on CPU / gloo.

    python -m benchmarks.tensor_parallel --out DIR            # the benchmark rows (4 launches x --rounds)
    python -m benchmarks.tensor_parallel --check-3d           # P=2 x TP=2 x DP=2 (8 processes) against one device

Each launch is a Lightning run of ``benchmarks/tensor_parallel_rank.py`` (the model, the TP plan, what each rank
measures). The launches of one round run one after another in an order rotated from round to round, so that a burst
of load on a shared machine lands on one round of every variant; ratios are medians over rounds of the ratio within
a round. What each figure means and how it is measured: docs/benchmarks.md, "Tensor parallelism"; the byte theory:
[Note: the bytes of a tensor-parallel step] below.

[Note: the bytes of a tensor-parallel step]
Per rank and step, the bytes each rank passes *into* each op (``benchmarks/collective_bytes.py``: an all-gather's
input, a reduce-scatter's full-size input, an all-reduce's tensor, a broadcast's tensor on every rank, an
all-to-all's input, a send's tensor), 4 bytes per float32 element. T: tensor-parallel size, D: data-parallel size,
M: microbatches (1 without pipelining), b = G / D / M sequences per microbatch, s: sequence length, C: width.

TP-local shapes (``parallelize_gpt``): ``c_attn`` and ``mlp.c_fc`` are split by rows (weight and bias: 3C/T and
4C/T rows), ``attn.c_proj`` and ``mlp.c_proj`` by columns (weights C x C/T and C x 4C/T, biases whole); LayerNorms,
embeddings and the head whole. Data-parallel sharding takes ``shard(p) = ceil(rows / D) * numel / rows`` elements of
each local tensor ``p``; ``AG(u) = 4 sum_p shard(p)`` and ``RS(u) = 4 D sum_p shard(p)`` for a unit ``u`` (each Block a
unit, the rest of the pieces a rank holds the root).

Tensor parallelism (DTensor's functional collectives, the same plan under both strategies), per Block held:
    forward:  all-reduce 2 x 4bsC (the row-wise outputs) + all-gather 4bs(3C/T) (the fused qkv output, see
              ``_local_heads``), per microbatch
    backward: all-reduce 2 x 4bsC (input gradients of the column-wise layers) + reduce-scatter 4bs(3C) (the qkv
              output's gradient), per microbatch

fsdp_custom's data-parallel collectives on gloo (lightning_fsdp/engine/backends.py): a unit's all-gather is D
broadcasts of ``AG(u)`` bytes (one per rank's shard), its reduce-scatter one all-to-all of ``RS(u) + 4 D k`` bytes
(k parameters: one used-flag each); units gathered: the root once per step, each Block twice per microbatch, except
without pipelining the last Block, kept gathered from its forward into its backward; each unit reduced once per step.
D = 1 sends nothing. Plus one all-reduce of 8 bytes a step (the preemption flags, lightning_fsdp/preemption.py).

FSDP2 (``ModelParallelStrategy``): ``all_gather_into_tensor`` of ``AG(u)``, the root once per step (FSDP2 does not
reshard the root after forward), each Block twice; ``reduce_scatter_tensor`` of ``RS(u)`` once per unit.

Pipelining (P=2 x TP=2): each rank sends one microbatch activation ``4bsC`` per microbatch forward if its stage is not
the last, one input gradient of the same size backward if it is not the first (and receives the mirror image), plus
the runtime's float32 loss: broadcast from the last stage and all-reduced (4 bytes each).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import command_line, machine
from benchmarks.ranks import clean_env, run_logged

__all__ = [
    "VARIANTS",
    "TensorParallelConfig",
    "check_3d",
    "main",
    "run_tensor_parallel",
    "theory_bytes",
]

ELEMENT_BYTES = 4
REFERENCE = "mps_tp2_dp2"
VARIANTS = {
    "tp2_dp2": "fsdp_custom TP=2 x DP=2",
    "p2_tp2": "fsdp_custom P=2 x TP=2 (ModelParallelStrategy has no pipelines)",
    "fsdp_x4": "fsdp_custom FULL_SHARD x4 (no TP)",
    "mps_tp2_dp2": "ModelParallelStrategy TP=2 x DP=2 (FSDP2 x TP)",
}
STEP_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send", "recv")


@dataclass
class TensorParallelConfig:
    """What to run: the pipeline benchmark's GPT (6 x 384, 6 heads, seq 64, vocab 64), global batch 16."""

    layers: int = 6
    width: int = 384
    heads: int = 6
    seq: int = 64
    vocab: int = 64
    global_batch: int = 16
    microbatches: int = 4  # P=2 x TP=2's, per step
    steps: int = 8  # timed, after warmup
    warmup: int = 2
    count_steps: int = 1  # after the timed steps, under the byte counter
    rounds: int = 3
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    trim: bool = True  # False: fsdp_custom without its host-memory trimming (--without-trimming)
    optimizer: str = "adamw"
    lr: float = 3e-4
    seed: int = 0
    threads: int = 1
    loss_rtol: float = 1e-4
    timeout: float = 600.0  # seconds one launch may take
    collective_timeout: float = 300.0

    def model(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab,
            "block_size": self.seq,
            "n_layer": self.layers,
            "n_head": self.heads,
            "n_embd": self.width,
            "dropout": 0.0,
            "tie_weights": False,
        }


# ---------------------------------------------------------------------------------------------------- theory
def _local_shapes(cfg: TensorParallelConfig, piece: str, tp: int) -> list[tuple[int, ...]]:
    """The TP-local shapes of one piece's parameters, in ``named_parameters`` order."""
    c, v, s = cfg.width, cfg.vocab, cfg.seq
    if piece == "embed":
        return [(v, c), (s, c)]
    if piece == "ln_f":
        return [(c,), (c,)]
    if piece == "lm_head":
        return [(v, c)]
    norm = [(c,), (c,)]
    attn = [(3 * c // tp, c), (3 * c // tp,), (c, c // tp), (c,)]
    mlp = [(4 * c // tp, c), (4 * c // tp,), (c, 4 * c // tp), (c,)]
    return norm + attn + norm + mlp


def _shard(shape: tuple[int, ...], ranks: int) -> int:
    rows = shape[0]
    return -(-rows // ranks) * math.prod(shape) // rows


def theory_bytes(
    cfg: TensorParallelConfig, variant: str, pieces: list[str], *, tp: int, data: int, pipeline: int
) -> dict[str, int]:
    """Bytes per step one rank holding ``pieces`` passes into each kind of op ([Note: the bytes of a
    tensor-parallel step])."""
    micro = cfg.microbatches if pipeline > 1 else 1
    blocks = [p for p in pieces if p.startswith("blocks.")]
    root = [shape for p in pieces if not p.startswith("blocks.") for shape in _local_shapes(cfg, p, tp)]
    block = _local_shapes(cfg, "blocks.0", tp)
    ag_root = ELEMENT_BYTES * sum(_shard(s, data) for s in root)
    ag_block = ELEMENT_BYTES * sum(_shard(s, data) for s in block)
    out = dict.fromkeys(STEP_KINDS, 0)
    b, s, c = cfg.global_batch // data // micro, cfg.seq, cfg.width
    activation = ELEMENT_BYTES * b * s * c
    if tp > 1:
        out["all_reduce"] += 4 * activation * micro * len(blocks)
        out["all_gather"] += activation * 3 // tp * micro * len(blocks)
        out["reduce_scatter"] += activation * 3 * micro * len(blocks)
    if variant == "mps_tp2_dp2":
        out["all_gather"] += ag_root + 2 * len(blocks) * ag_block
        out["reduce_scatter"] += data * (ag_root + len(blocks) * ag_block)
        return out
    out["all_reduce"] += 8  # the preemption flags
    if data > 1:
        gathers = ag_root + 2 * micro * len(blocks) * ag_block - (ag_block if pipeline == 1 else 0)
        out["broadcast"] += data * gathers
        flags = ELEMENT_BYTES * data * (len(root) + len(blocks) * len(block))
        out["all_to_all"] += data * (ag_root + len(blocks) * ag_block) + flags
    if pipeline > 1:
        stage = _stage_of(cfg, pieces, pipeline)
        out["send"] += activation * micro * ((stage < pipeline - 1) + (stage > 0))
        out["recv"] += activation * micro * ((stage > 0) + (stage < pipeline - 1))
        out["broadcast"] += 4  # the runtime's loss, from the last stage
        out["all_reduce"] += 4  # and its average over data-parallel ranks
    return out


def _stage_of(cfg: TensorParallelConfig, pieces: list[str], pipeline: int) -> int:
    if "embed" in pieces:
        return 0
    if "lm_head" in pieces:
        return pipeline - 1
    raise ValueError(f"a middle stage ({pieces}) is not modelled: the theory covers P=2")


# ---------------------------------------------------------------------------------------------------- launches
def _launch(cfg: TensorParallelConfig, key: str, work: Path, **overrides: Any) -> dict[str, Any]:
    """One Lightning run of ``key``; its ranks' records, or the failure with the log's end."""
    from benchmarks.tensor_parallel_rank import LAUNCHES

    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "launch": key,
        "model": cfg.model(),
        "global_batch": cfg.global_batch,
        "microbatches": cfg.microbatches,
        "warmup": cfg.warmup,
        "steps": cfg.steps,
        "count_steps": cfg.count_steps,
        "optimizer": cfg.optimizer,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "threads": cfg.threads,
        "collective_timeout": cfg.collective_timeout,
        "out": str(work),
        "state": False,
        "trim": cfg.trim,
        **overrides,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = clean_env(OMP_NUM_THREADS=str(cfg.threads), MKL_NUM_THREADS=str(cfg.threads))
    log = work / "log.txt"
    cmd = [sys.executable, "-m", "benchmarks.tensor_parallel_rank", str(work / "spec.json")]
    code = run_logged(cmd, log, env, work, cfg.timeout)
    world = LAUNCHES[key]["world"]
    files = [work / f"rank{r}.json" for r in range(world)]
    if code != 0 or not all(f.exists() for f in files):
        why = "timed out" if code is None else f"exit status {code}"
        raise RuntimeError(f"launch {key} failed ({why}):\n{log.read_text(errors='replace')[-4000:]}")
    return {"ranks": [json.loads(f.read_text()) for f in files], "work": work}


def _round_figures(cfg: TensorParallelConfig, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    timed = slice(cfg.warmup, cfg.warmup + cfg.steps)
    steps = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))][timed]
    return {
        "median_step_ms": statistics.median(steps) * 1e3,
        "step_ms": [t * 1e3 for t in steps],
        "peak_bytes": [r["peak_bytes"] for r in ranks],
    }


def _summarise(cfg: TensorParallelConfig, key: str, rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    from benchmarks.tensor_parallel_rank import LAUNCHES

    launch = LAUNCHES[key]
    tp, pipeline = launch["tp"], launch["pp"]
    data = launch["world"] // (tp * pipeline)
    figures = [_round_figures(cfg, ranks) for ranks in rounds]
    first = rounds[0]
    per_rank = []
    for r in first:
        measured = {k: v / cfg.count_steps for k, v in r.get("collective_bytes", {}).items()}
        theory = theory_bytes(cfg, key, r["pieces"], tp=tp, data=data, pipeline=pipeline)
        kinds = sorted(set(theory) | set(measured))
        per_rank.append(
            {
                "rank": r["rank"],
                "pieces": r["pieces"],
                "measured_per_step": {k: measured.get(k, 0) for k in kinds},
                "theory_per_step": {k: theory.get(k, 0) for k in kinds},
                "calls_per_step": {k: v / cfg.count_steps for k, v in r.get("collective_calls", {}).items()},
                "ops_per_step": {k: v / cfg.count_steps for k, v in r.get("collective_ops", {}).items()},
                "matches_theory": all(measured.get(k, 0) == theory.get(k, 0) for k in kinds),
            }
        )
    same_bytes = all(
        [x.get("collective_bytes") for x in ranks] == [x.get("collective_bytes") for x in first] for ranks in rounds
    )
    # The global batch's loss: the mean over ranks (TP ranks of one DP rank hold the same; pipelined ranks the global).
    losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in first))]
    peaks = [max(f["peak_bytes"]) for f in figures]
    return {
        "key": key,
        "name": VARIANTS[key],
        "world": launch["world"],
        "tensor_parallel": tp,
        "pipeline_parallel": pipeline,
        "data_parallel": data,
        "median_step_ms": statistics.median(f["median_step_ms"] for f in figures),
        "round_median_step_ms": [f["median_step_ms"] for f in figures],
        "peak_bytes_per_rank": [statistics.median(v) for v in zip(*(f["peak_bytes"] for f in figures))],
        "peak_bytes": statistics.median(peaks),
        "round_peak_bytes": peaks,
        "losses": losses,
        "bytes_same_every_round": same_bytes,
        "ranks": per_rank,
        "matches_theory": all(r["matches_theory"] for r in per_rank),
    }


def _paired(rows: dict[str, dict[str, Any]], key: str, ref: str, figure: str) -> float | None:
    if key not in rows or ref not in rows:
        return None
    ratios = [a / b for a, b in zip(rows[key][f"round_{figure}"], rows[ref][f"round_{figure}"]) if b]
    return statistics.median(ratios) if ratios else None


def run_tensor_parallel(cfg: TensorParallelConfig, out: Path, say: Any = print) -> dict[str, Any]:
    """Every variant, ``cfg.rounds`` times interleaved; writes results.json and results.md into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    keys = list(cfg.variants)
    launched: dict[str, list[list[dict[str, Any]]]] = {k: [] for k in keys}
    started = time.time()
    for index in range(cfg.rounds):
        order = keys[index % len(keys) :] + keys[: index % len(keys)]
        for key in order:
            result = _launch(cfg, key, out / "runs" / f"{key}-round{index}")
            launched[key].append(result["ranks"])
            figures = _round_figures(cfg, result["ranks"])
            say(
                f"[tensor-parallel] round {index + 1}/{cfg.rounds} {key}: median step "
                f"{figures['median_step_ms']:.0f} ms, peak {max(figures['peak_bytes']) / 2**20:.0f} MiB over base"
            )
    rows = {key: _summarise(cfg, key, launched[key]) for key in keys}
    reference = rows.get("fsdp_x4") or next(iter(rows.values()))
    for row in rows.values():
        row["step_ratio_to_mps"] = _paired(rows, row["key"], REFERENCE, "median_step_ms")
        row["peak_ratio_to_mps"] = _paired(rows, row["key"], REFERENCE, "peak_bytes")
        row["step_ratio_to_tp2_dp2"] = _paired(rows, row["key"], "tp2_dp2", "median_step_ms")
        row["step_ratio_to_fsdp_x4"] = _paired(rows, row["key"], "fsdp_x4", "median_step_ms")
        diffs = [abs(a - b) / abs(b) for a, b in zip(row["losses"], reference["losses"])]
        row["loss_max_rel_diff"] = max(diffs) if diffs else None
    results = {
        "config": asdict(cfg),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "variants": list(rows.values()),
        "bound_met": _bound(rows),
        "elapsed_s": time.time() - started,
        "methods": METHODS,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    from benchmarks.tensor_parallel_report import markdown

    (out / "results.md").write_text(markdown(results))
    return results


def _bound(rows: dict[str, dict[str, Any]]) -> dict[str, bool] | None:
    """The issue's bound: TP=2 x DP=2 at most 1.0x ModelParallelStrategy's step time and peak memory."""
    ours = rows.get("tp2_dp2")
    if ours is None or REFERENCE not in rows:
        return None
    return {"step_time": ours["step_ratio_to_mps"] <= 1.0, "peak_memory": ours["peak_ratio_to_mps"] <= 1.0}


METHODS = {
    "step_time": "on_train_batch_start to on_train_batch_end (forward, backward, optimizer step; perf_counter); per "
    "step the slowest rank; median over the timed steps (warm-up excluded) of each launch; the row's figure is the "
    "median over rounds, a ratio the median over rounds of the ratio within a round",
    "peak_memory": "resident memory over the base per rank: VmHWM (reset at on_train_start) at the end of the timed "
    "steps, less VmRSS at the setup hook (process group up, model not yet built); the row's figure is the largest "
    "rank's, median over rounds",
    "bytes": "benchmarks/collective_bytes.py: a TorchDispatchMode counting the input bytes of every c10d and "
    "functional collective (fsdp_custom's, FSDP2's and DTensor's) over the count_steps steps after the timed ones",
}


# ---------------------------------------------------------------------------------------------------- 3-D check
def check_3d(cfg: TensorParallelConfig, out: Path, say: Any = print) -> int:
    """P=2 x TP=2 x DP=2 on 8 processes against one device on the same global batches, SGD with momentum, fp32:
    each step's loss and every full parameter after the steps at rtol 1e-5. Returns the number of tensors compared;
    raises AssertionError on a mismatch."""
    import torch

    from benchmarks.tensor_parallel_rank import LAUNCHES

    settings = {"optimizer": "sgd", "lr": 0.1, "warmup": 0, "count_steps": 0, "state": True}
    ref = _launch(cfg, "one_device", out / "one_device", **settings)
    run = _launch(cfg, "p2_tp2_dp2", out / "p2_tp2_dp2", **settings)
    assert LAUNCHES["p2_tp2_dp2"]["world"] == len(run["ranks"]) == 8
    expected = torch.load(ref["work"] / "rank0.pt", weights_only=True)
    ref_losses = torch.tensor(ref["ranks"][0]["losses"], dtype=torch.float64)
    compared, covered = 0, set()
    for record in run["ranks"]:
        assert record["mesh_dims"] == ["pipeline_parallel", "data_parallel", "tensor_parallel"], record["mesh_dims"]
        # pipelined_loss returns the global batch's loss on every rank
        torch.testing.assert_close(torch.tensor(record["losses"], dtype=torch.float64), ref_losses, rtol=1e-5, atol=0)
        state = torch.load(run["work"] / f"rank{record['rank']}.pt", weights_only=True)
        for name, value in state.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
            compared += 1
        covered |= set(state)
    missing = set(expected) - covered
    assert not missing, f"parameters no rank holds: {sorted(missing)}"
    # The check can fail: 3 SGD steps move every parameter of the reference far beyond the tolerance.
    from lightning_fsdp.demo.gpt import GPTConfig, PipelineGPT

    torch.manual_seed(cfg.seed)
    initial = PipelineGPT(GPTConfig(**cfg.model())).state_dict()
    unmoved = [n for n, v in expected.items() if torch.allclose(v, initial[n], rtol=1e-5, atol=1e-7)]
    assert not unmoved, f"parameters the reference's steps left within the tolerance: {unmoved}"
    say(
        f"[tensor-parallel] P=2 x TP=2 x DP=2 matches one device: {len(ref_losses)} losses on each of 8 ranks and "
        f"{compared} tensors ({len(expected)} parameters, each on every rank of its stage) at rtol 1e-5"
    )
    return compared


# ---------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    defaults = TensorParallelConfig()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=__doc__.split("\n")[0])
    for name in ("layers", "width", "heads", "seq", "vocab", "global_batch", "microbatches", "steps", "warmup"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("count_steps", "rounds", "threads"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=defaults.variants,
        help=f"comma-separated, of {','.join(VARIANTS)} (default all)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: a temporary one)")
    parser.add_argument(
        "--without-trimming",
        action="store_true",
        help="fsdp_custom without the engine's host-memory trimming after each unit's backward (engine/host_memory.py)",
    )
    parser.add_argument(
        "--check-3d",
        action="store_true",
        help="instead: P=2 x TP=2 x DP=2 (8 processes, a tiny GPT unless sizes are given) against one device; "
        "exits 1 when they differ",
    )
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants {','.join(unknown)} is not valid; choose from {','.join(VARIANTS)}")
    given = {k: getattr(args, k) for k in asdict(defaults) if hasattr(args, k) and k != "variants"}
    given["trim"] = not args.without_trimming
    out = args.out or Path(tempfile.mkdtemp(prefix="lfsdp-tp-"))
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if args.check_3d:
        tiny = {"layers": 4, "width": 32, "heads": 4, "seq": 8, "global_batch": 8, "microbatches": 2, "steps": 3}
        explicit = {k: v for k, v in given.items() if v != getattr(defaults, k)}
        cfg = TensorParallelConfig(**{**given, **tiny, **explicit})
        try:
            check_3d(cfg, out, say)
        except AssertionError as error:
            print(f"P=2 x TP=2 x DP=2 differs from one device: {error}", file=sys.stderr)
            return 1
        return 0
    cfg = TensorParallelConfig(**given, variants=args.variants)
    results = run_tensor_parallel(cfg, out, say)
    results["command"] = command_line("benchmarks.tensor_parallel", argv)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    from benchmarks.tensor_parallel_report import markdown

    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    mismatch = [r["key"] for r in results["variants"] if not r["matches_theory"]]
    if mismatch:
        print(f"bytes differ from theory: {', '.join(mismatch)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
