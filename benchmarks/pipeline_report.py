"""Write the pipeline benchmark's results: ``results.json``, ``results.md`` (tables) and ``plot.png``.

The measurements and the theory are benchmarks/pipeline.py's (see its notes); this module only lays
them out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import fmt_bytes, label_bar, save_figure, write_outputs

__all__ = ["markdown", "plot", "write_report"]

_KINDS = (
    ("all_gather", "All-gather"),
    ("reduce_scatter", "Reduce-scatter"),
    ("all_reduce", "All-reduce"),
    ("p2p_activations", "P2P activations"),
    ("p2p_gradients", "P2P gradients"),
)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _bytes_cell(measured: float | None, theory: float | None) -> str:
    """``measured (theory)``, a check mark when they are equal; ``theory only`` when nothing was measured."""
    if measured is None:
        return "0" if not theory else f"n/a (theory {fmt_bytes(theory)})"
    if not measured and not theory:
        return "0"
    mark = " ✓" if theory is not None and measured == theory else ""
    return f"{fmt_bytes(measured)} ({fmt_bytes(theory)}){mark}"


def _rank_label(row: dict[str, Any], rank: dict[str, Any]) -> str:
    d = row["data_size"]
    if row["pipeline_size"] > 1:
        return f"{rank['rank']} (pp {rank['pp_rank']}, dp {rank['rank'] % d})"
    return str(rank["rank"])


def _stage_text(row: dict[str, Any]) -> str:
    return " \\| ".join(", ".join(stage) for stage in row["stages"])


def markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    env = results["environment"]
    rows = results["variants"]
    lines = [
        "# lightning_fsdp pipeline benchmark",
        "",
        *([f"`{results['command']}`", ""] if results.get("command") else []),
        f"{results['model']}: n_layer={cfg['layers']} n_embd={cfg['width']} n_head={cfg['heads']} seq={cfg['seq']} "
        f"vocab={cfg['vocab']}, {results['num_parameters']:,} parameters ({fmt_bytes(results['param_bytes'])} "
        f"float32). {results['world_size']} gloo processes on CPU, {cfg['threads']} thread(s) each; global batch "
        f"{cfg['global_batch']} sequences per step (the same for every variant: {cfg['global_batch'] // 4} per rank "
        f"for x4, {cfg['global_batch'] // 2} per data-parallel rank in {cfg['microbatches']} microbatches for the "
        f"pipelines); AdamW(lr={cfg['lr']}); FULL_SHARD, each Block a unit; {cfg['warmup']} warmup + "
        f"{cfg['steps']} timed steps, variants interleaved step by step; then each variant alone for "
        f"{cfg['mem_steps']} profiled steps (memory). torch {env['torch']}, {env['cpus']} CPUs. "
        f"Elapsed {results['elapsed_s']:.0f} s.",
        "",
        "Pipeline stages (balanced by parameter count, as `FSDPStrategy` splits by default; stage s on pipeline rank "
        "s % 2):",
        "",
    ]
    for row in rows:
        if row["pipeline_size"] > 1:
            lines.append(f"- {row['name']}: {_stage_text(row)}")
    lines += [
        "",
        "| Variant | Median step (ms) | vs DDP x4 | vs fsdp_custom x4 | Peak live / rank (max; ranks 0..3) "
        "| Model state / rank (max) | All-gather / step | Reduce-scatter / step | P2P act. / step "
        "| P2P grad. / step | On the wire / step (est.) | Final loss |",
        "|---|---:|---:|---:|---|---:|---|---|---|---|---:|---:|",
    ]
    for row in rows:
        peak = row["peak_live_bytes"]
        state = max(m["total"] for m in row["model_state"])
        cells = []
        for kind in ("all_gather", "reduce_scatter", "p2p_activations", "p2p_gradients"):
            m = max(r["measured_per_step"].get(kind, 0) for r in row["ranks"])
            t = max(r["theory_per_step"].get(kind, 0) for r in row["ranks"])
            if kind == "reduce_scatter" and "all_reduce" in row["ranks"][0]["theory_per_step"]:
                cells.append(f"all-reduce {_bytes_cell(None, row['ranks'][0]['theory_per_step']['all_reduce'])}")
                continue
            cells.append(_bytes_cell(m, t))
        wire = max(r["wire_estimate_per_step"] for r in row["ranks"])
        loss = f"{row['final_loss']:.6f}" if row.get("final_loss") is not None else "n/a"
        if row.get("loss_agrees") is False:
            loss += " **DISAGREES**"
        lines.append(
            f"| {row['name']} | {_ms(row['median_step_ms'])} "
            f"| {_ratio(row.get('ratio_to_ddp'))} ({_ratio(row.get('paired_ratio_to_ddp'))}) "
            f"| {_ratio(row.get('ratio_to_fsdp'))} ({_ratio(row.get('paired_ratio_to_fsdp'))}) "
            f"| {fmt_bytes(max(peak))} ({' / '.join(fmt_bytes(p) for p in peak)}) | {fmt_bytes(state)} | "
            + " | ".join(cells)
            + f" | {fmt_bytes(wire)} | {loss} |"
        )
    lines += [
        "",
        "Ratios: ratio of medians (in brackets: median over the timed steps of the per-step ratio, both variants' "
        "step in the same round). Byte columns: the largest over the ranks, measured (theory); ✓ = equal. "
        "All-gather counts this rank's shard sent into each all-gather, reduce-scatter the full-size input, P2P the "
        "bytes this rank sends; the wire column converts them for ring algorithms (see below).",
        "",
    ]
    agree = [r for r in rows if r.get("loss_max_rel_diff") is not None]
    if agree:
        worst = max(r["loss_max_rel_diff"] for r in agree)
        verdict = "agree" if all(r.get("loss_agrees") for r in agree) else "**do not all agree**"
        lines += [
            f"Losses of all {len(rows)} variants {verdict} with DDP's at every step (relative tolerance "
            f"{cfg['loss_rtol']:g}; largest relative difference {worst:.1e}).",
            "",
        ]

    lines += [
        "## Bytes per step, per rank: measured (theory)",
        "",
        "| Variant | Rank | Stages held | Pieces | All-gather | Reduce-scatter | P2P activations | P2P gradients "
        "| Equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for rank in row["ranks"]:
            m, t = rank["measured_per_step"], rank["theory_per_step"]
            if "all_reduce" in t:
                collectives = [f"all-reduce {_bytes_cell(None, t['all_reduce'])}", "(DDP: theory only)"]
            else:
                collectives = [_bytes_cell(m.get(k, 0), t.get(k, 0)) for k in ("all_gather", "reduce_scatter")]
            p2p = [_bytes_cell(m.get(k, 0), t.get(k, 0)) for k in ("p2p_activations", "p2p_gradients")]
            pieces = ", ".join(rank["pieces"])
            stages = ", ".join(map(str, rank["local_stages"])) if row["pipeline_size"] > 1 else "all (P=1)"
            lines.append(
                f"| {row['name']} | {_rank_label(row, rank)} | {stages} | {pieces} | "
                + " | ".join(collectives + p2p)
                + f" | {'yes' if rank['matches_theory'] else '**no**'} |"
            )

    differing = [r for r in rows if not all(x["matches_theory"] for x in r["ranks"])]
    if differing:
        lines += ["", "## Where measured bytes differ from the theory", ""]
        for row in differing:
            excess = "; ".join(
                f"rank {x['rank']}: "
                + ", ".join(
                    f"{k.replace('_', '-')} {'+' if v > 0 else ''}{fmt_bytes(v)}"
                    for k, v in x["excess_per_step"].items()
                )
                for x in row["ranks"]
                if x["excess_per_step"]
            )
            lines.append(
                f"- **{row['name']}** (measured minus theory per step: {excess}). {row.get('known_difference') or ''}"
            )

    lines += ["", "## Global-batch loss per step (every variant on the same batches)", ""]
    lines.append("| Step | " + " | ".join(r["name"] for r in rows) + " |")
    lines.append("|---:|" + "---:|" * len(rows))
    for step in range(len(rows[0]["losses"])):
        mark = " (warmup)" if step < cfg["warmup"] else ""
        lines.append(f"| {step + 1}{mark} | " + " | ".join(f"{r['losses'][step]:.6f}" for r in rows) + " |")

    methods = results["methods"]
    lines += [
        "",
        "## Theory (bytes per step per rank; D = ranks in the shard group, M = microbatches, G = global batch)",
        "",
        "```",
        *results["theory"],
        "```",
        "",
        "## How each column is measured",
        "",
        f"- **Median step**: {methods['step_time']}.",
        f"- **Peak live / rank**: {methods['peak_live']}. Listed for ranks 0..3 (pipelines: ranks 0, 1 hold pipeline "
        "rank 0's stages, ranks 2, 3 pipeline rank 1's).",
        f"- **Model state / rank**: {methods['model_state']}.",
        f"- **All-gather / reduce-scatter**: {methods['collectives']}. DDP's all-reduce runs in its C++ reducer, "
        "where Python cannot count it: theory only.",
        f"- **P2P**: {methods['p2p']}. The pipeline runtime's 4-byte loss broadcast and all-reduce per step are "
        "not counted.",
        f"- **On the wire (estimate)**: {methods['wire_estimate']}; the largest over the ranks.",
        "- **Loss**: the global batch's loss per step (pipelines: the loss `pipelined_loss` returns, the same on "
        "every rank; x4: the mean over ranks of each rank's share), compared with DDP's at every step.",
        "",
    ]
    return "\n".join(lines)


_SHORT = {
    "pp_gpipe": "P2xD2\nGPipe",
    "pp_1f1b": "P2xD2\n1F1B",
    "pp_interleaved": "P2xD2\nInterleaved",
    "pp_1f1b_kept": "P2xD2 1F1B\nkept gathered",
    "fsdp_x4": "fsdp_custom\nx4",
    "ddp_x4": "DDP\nx4",
}


def plot(results: dict[str, Any], path: Path) -> None:
    """Step time, peak live memory per rank, and estimated wire bytes per rank per step, per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["variants"]
    names = [_SHORT.get(r["key"], r["name"]) for r in rows]
    x = list(range(len(rows)))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.4))

    ax = axes[0]
    times = [r["median_step_ms"] or 0.0 for r in rows]
    bars = ax.bar(x, times, color=["tab:blue" if r["pipeline_size"] > 1 else "tab:gray" for r in rows])
    for bar, row in zip(bars, rows):
        label_bar(ax, bar, f"{row['median_step_ms']:.0f}\n{_ratio(row.get('ratio_to_ddp'))} DDP")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("median step time (ms)")
    ax.margins(y=0.18)
    ax.set_title("Step time (4 processes, same global batch)")

    ax = axes[1]
    mib = 2**20
    width = 0.2
    for r in range(results["world_size"]):
        ax.bar(
            [i + (r - 1.5) * width for i in x],
            [row["peak_live_bytes"][r] / mib for row in rows],
            width,
            label=f"rank {r}",
        )
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("peak live tensor MiB")
    ax.set_title("Peak live tensors per rank (pipelines: ranks 0-1 stage(s) of pp 0)")
    ax.legend(fontsize=8)

    ax = axes[2]
    parts = (
        ("all-gather", "tab:orange", lambda m, d: m.get("all_gather", 0) * (d - 1)),
        ("reduce-scatter", "tab:green", lambda m, d: m.get("reduce_scatter", 0) * (d - 1) / d),
        ("all-reduce (theory)", "tab:gray", lambda m, d: m.get("all_reduce", 0) * 2 * (d - 1) / d),
        ("P2P activations", "tab:blue", lambda m, d: m.get("p2p_activations", 0)),
        ("P2P gradients", "tab:purple", lambda m, d: m.get("p2p_gradients", 0)),
    )
    bottom = [0.0] * len(rows)
    for label, color, value in parts:
        heights = []
        for row in rows:
            d = row["data_size"]
            per_rank = []
            for rank in row["ranks"]:
                merged = dict(rank["measured_per_step"])
                if "all_reduce" in rank["theory_per_step"]:
                    merged["all_reduce"] = rank["theory_per_step"]["all_reduce"]
                per_rank.append(value(merged, d) / mib)
            heights.append(sum(per_rank) / len(per_rank))
        ax.bar(x, heights, bottom=bottom, color=color, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("MiB per rank per step (mean over ranks)")
    ax.set_title("Sent on the wire per rank (ring estimate)")
    ax.legend(fontsize=8)

    cfg = results["config"]
    save_figure(
        fig,
        f"PipelineGPT {cfg['layers']}x{cfg['width']} ({results['num_parameters']:,} parameters), global batch "
        f"{cfg['global_batch']}x{cfg['seq']}, M={cfg['microbatches']}, gloo on CPU, torch "
        f"{results['environment']['torch']}",
        path,
    )


def write_report(results: dict[str, Any], out: Path) -> None:
    write_outputs(results, out, markdown(results), plot)
