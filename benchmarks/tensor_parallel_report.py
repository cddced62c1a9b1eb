"""The tensor-parallel benchmark's results as Markdown (:mod:`benchmarks.tensor_parallel`)."""

from __future__ import annotations

from typing import Any

MIB = 2**20


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(results: dict[str, Any]) -> str:
    cfg, env = results["config"], results["machine"]
    lines = [
        f"Run {results['date']} on {env['cpus']} CPU cores ({env['machine']}, torch {env['torch']}), gloo, "
        f"{cfg['threads']} thread per process: GPT {cfg['layers']} x {cfg['width']} ({cfg['heads']} heads, seq "
        f"{cfg['seq']}, vocab {cfg['vocab']}), global batch {cfg['global_batch']}, {cfg['optimizer']}; "
        f"{cfg['rounds']} rounds of {cfg['warmup']} warm-up + {cfg['steps']} timed steps per variant"
        + ("" if cfg.get("trim", True) else "; fsdp_custom WITHOUT host-memory trimming")
        + (f"; `{results['command']}`" if results.get("command") else ""),
        "",
        "| variant | ranks (P x D x T) | median step, ms | x MPS | x TP2xDP2 | x FSDP x4 | peak over base, MiB/rank "
        "| x MPS | max loss diff vs FSDP x4 | bytes = theory |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in results["variants"]:
        layout = f"{row['pipeline_parallel']} x {row['data_parallel']} x {row['tensor_parallel']}"
        lines.append(
            f"| {row['name']} | {layout} | {row['median_step_ms']:.0f} | {_ratio(row['step_ratio_to_mps'])} "
            f"| {_ratio(row['step_ratio_to_tp2_dp2'])} | {_ratio(row['step_ratio_to_fsdp_x4'])} "
            f"| {row['peak_bytes'] / MIB:.1f} | {_ratio(row['peak_ratio_to_mps'])} "
            f"| {row['loss_max_rel_diff']:.1e} | {'yes' if row['matches_theory'] else 'NO'} |"
        )
    bound = results.get("bound_met")
    if bound is not None:
        lines += [
            "",
            "Bound (TP=2 x DP=2 at most 1.0x ModelParallelStrategy): step time "
            f"{'met' if bound['step_time'] else 'NOT met'}, "
            f"peak memory {'met' if bound['peak_memory'] else 'NOT met'}.",
        ]
    lines += [
        "",
        "Bytes per step passed into each op, rank 0 (every rank's in results.json), measured / theory:",
        "",
        "| variant | all-gather | reduce-scatter | all-reduce | broadcast | all-to-all | send | recv |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    kinds = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send", "recv")
    for row in results["variants"]:
        rank = row["ranks"][0]
        cells = [f"{rank['measured_per_step'].get(k, 0):,.0f} / {rank['theory_per_step'].get(k, 0):,}" for k in kinds]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    lines += ["", "How each figure is measured:", ""]
    lines += [f"- {name}: {text}" for name, text in results["methods"].items()]
    return "\n".join(lines) + "\n"
