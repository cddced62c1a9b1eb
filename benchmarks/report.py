"""Write the benchmark's results: ``results.json`` (everything), ``results.md`` (tables) and ``plot.png``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["write_report", "markdown", "plot", "fmt_bytes", "paired_ratio"]


def fmt_bytes(value: float | None) -> str:
    """Bytes in binary units with three significant figures: ``'73.2 MiB'``."""
    if value is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _multiple(measured: float | None, param_bytes: int) -> str:
    return "n/a" if measured is None else f"{measured / param_bytes:.3f} P"


def _comm_cells(row: dict[str, Any], param_bytes: int) -> list[str]:
    """All-gathered, reduce-scattered and all-reduced bytes per step, each with its multiple of P."""
    comm = row.get("comm_per_step")
    cells = []
    for measured_key, theory_key in (
        ("all_gathered", "all_gather"),
        ("reduce_scatter", "reduce_scatter"),
        ("all_reduce", "all_reduce"),
    ):
        theory = row["theory_per_step"][theory_key]
        if comm is None:
            cells.append("n/a" if not theory else f"n/a (theory {theory / param_bytes:g} P)")
            continue
        measured = comm.get(measured_key, 0)
        if not measured and not theory:
            cells.append("0")
        else:
            cells.append(f"{fmt_bytes(measured)} = {measured / param_bytes:.3f} P (theory {theory / param_bytes:g} P)")
    theory_total = sum(row["theory_per_step"].values()) / param_bytes
    if comm is None:
        cells.append(f"n/a (theory {theory_total:g} P)")
    else:
        total = sum(comm.get(k, 0) for k in ("all_gathered", "reduce_scatter", "all_reduce")) / param_bytes
        cells.append(f"**{total:.3f} P** (theory {theory_total:g} P)")
    return cells


def paired_ratio(row: dict[str, Any], reference: dict[str, Any] | None) -> float | None:
    """Median over timed steps of (this variant's step time / the reference's in the same round).

    The variants run interleaved, one step each per round, so a burst of load from other processes lands on the
    same round of both; the ratio per round cancels most of it, and its median is steadier than a ratio of medians.
    """
    if not reference or not row.get("step_ms") or not reference.get("step_ms"):
        return None
    ratios = sorted(a / b for a, b in zip(row["step_ms"], reference["step_ms"]) if b > 0)
    if not ratios:
        return None
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def _max(values: list[float] | None) -> float | None:
    return max(values) if values else None


def markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    P = results["param_bytes"]
    ws = results["comparison_world_size"]
    ref_name = next((r["name"] for r in results["variants"] if r["key"] == results["reference"]), results["reference"])
    env = results["environment"]
    lines = [
        "# lightning_fsdp benchmark",
        "",
        *([f"`{results['command']}`", ""] if results.get("command") else []),
        f"GPT n_layer={cfg['layers']} n_embd={cfg['width']} n_head={cfg['heads']} block_size={cfg['seq']} "
        f"vocab={cfg['vocab']}: {results['num_parameters']:,} parameters, P = {fmt_bytes(P)} (float32). "
        f"{ws} gloo processes on CPU, {cfg['threads']} thread(s) each; batch {cfg['batch']} sequences per rank; "
        f"AdamW(lr={cfg['lr']}); each Block a unit; {cfg['warmup']} warmup + {cfg['steps']} timed steps "
        f"(variants interleaved step by step), then a "
        f"separate profiled run of {cfg['mem_steps']} steps for memory and collectives. torch {env['torch']}, "
        f"{env['cpus']} CPUs; engine prefetch options: {env['engine_options'] or 'none (no prefetching)'}.",
        "",
        f"| Variant | Median step (ms) | vs {ref_name}: ratio of medians (median of per-step ratios) "
        "| Peak live / rank | Model state / rank (vs DDP) "
        "| All-gathered / step | Reduce-scattered / step | All-reduced / step | Total moved / step | Final loss |",
        "|---|---:|---:|---:|---:|---|---|---|---|---:|",
    ]
    ddp = next((r for r in results["variants"] if r["key"] == "ddp" and r["status"] == "ok"), None)
    reference = next((r for r in results["variants"] if r["key"] == results["reference"] and r["status"] == "ok"), None)
    ddp_state = _max([m["total"] for m in ddp["model_state"]]) if ddp else None
    disagreements = []
    for row in results["variants"]:
        if row["status"] != "ok":
            error = str(row.get("error", "")).replace("|", "\\|").replace("\n", " ")[:200]
            lines.append(f"| {row['name']} | **failed**: {error} | | | | | | | | |")
            continue
        state = _max([m["total"] for m in row["model_state"]])
        state_cell = fmt_bytes(state) + (f" ({state / ddp_state:.3f})" if ddp_state else "")
        loss = f"{row['final_loss']:.6f}"
        if row.get("loss_agrees") is False:
            loss += f" **DISAGREES** (rel. diff {row['loss_rel_diff']:.1e})"
            disagreements.append(row["name"])
        lines.append(
            f"| {row['name']} | {_ms(row.get('median_step_ms'))} | {_ratio(row.get('ratio_to_reference'))} "
            f"({_ratio(paired_ratio(row, reference))}) "
            f"| {fmt_bytes(_max(row['peak_live_bytes']))}"
            f"{'' if row.get('live_bytes_all_threads') else ' (upper bound)'} "
            f"| {state_cell} | " + " | ".join(_comm_cells(row, P)) + f" | {loss} |"
        )
    rtol = cfg["loss_rtol"]
    ok_rows = [r for r in results["variants"] if r["status"] == "ok"]
    if disagreements:
        lines += ["", f"**Final losses disagree** (relative tolerance {rtol:g}) for: {', '.join(disagreements)}."]
    elif ok_rows:
        worst = max(r.get("loss_rel_diff", 0.0) for r in ok_rows)
        lines += [
            "",
            f"All final losses agree with {ref_name}'s within relative tolerance {rtol:g} "
            f"(largest relative difference {worst:.1e}).",
        ]

    lines += _scaling_section(results)

    lines += [
        "",
        "## How each column is measured",
        "",
        "- **Median step**: wall time of `zero_grad` + forward + backward + `optimizer.step()` per step on each rank "
        "(`time.perf_counter`), the slower rank's time per step, median over the timed steps after warmup. The "
        "variants are interleaved: both processes hold every variant (same initial weights) and run one step of "
        "each per round on the same batch, in an order rotated every round, each variant on its own process group, "
        "so load from other processes on a shared machine slows all variants alike. Ratio: to "
        f"{ref_name}'s median in the same run; in brackets the median over steps of the per-step ratio (both "
        "variants' step in the same round), which cancels most of the load that hits a round. The timed run carries "
        "no profiler or counters.",
        f"- **Peak live / rank**: {results['methods']['peak_live']}; the larger of the ranks. Includes model state, "
        "gathered parameters, activations, gradients, optimizer state and communication buffers; not RSS.",
        f"- **Model state / rank**: {results['methods']['model_state']}; the larger of the ranks. "
        "In brackets: ratio to DDP's (ideal 1/N for sharded variants).",
        "- **All-gathered / reduce-scattered / all-reduced per step**: per rank, averaged over the profiled run's "
        "steps; all-gathered counts the gathered full-size output, reduce-scattered the full-size input, "
        "all-reduced the tensor. fsdp_custom: the engine's own `CommStats`; torch FSDP1/FSDP2: calls to "
        "`torch.distributed`'s collectives counted by a wrapper; torch DDP: its reducer all-reduces from C++ "
        "where Python cannot see it, so theory only (1 P). P is the model's full parameter bytes; theory: "
        "FULL_SHARD gathers 2 P (forward and again for backward) and reduce-scatters 1 P (3 P in total), "
        "SHARD_GRAD_OP gathers 1 P (2 P in total), replicated variants all-reduce 1 P. A root unit that stays "
        "gathered from forward into backward is gathered once, so measured FULL_SHARD figures sit slightly under 2 P.",
        f"- **Final loss**: mean over ranks (= the global batch's loss) of the last timed step; compared with "
        f"{ref_name}'s at relative tolerance {rtol:g}.",
        "- **Scaling run**: at each world size its variants run interleaved exactly like the comparison (same "
        "warmup and timed steps, median of the slowest rank's time per step, then a profiled memory run per "
        "variant), so each world size's ratios are paired; the ratio is to the baseline at the same world size. "
        "Shards / replica at step start: live tensor bytes when the profiled steps begin, after wrapping and "
        "before any gradient or optimizer state exists: a sharded variant's parameter shards; for DDP the whole "
        "parameters plus the gradient buckets its reducer allocates when it wraps the model (about 2 P).",
        "",
    ]
    return "\n".join(lines)


def _scaling_section(results: dict[str, Any]) -> list[str]:
    """The scaling run's table, one row per (world size, variant), and what its step times mean on this machine.

    Also reads results written before the scaling run was timed (fsdp_custom FULL_SHARD rows only, no step times).
    """
    cfg, P = results["config"], results["param_bytes"]
    scaling = results["scaling"]
    names = list(dict.fromkeys(r["name"] for r in scaling)) or [results["reference"]]
    baseline_key = results.get("scaling_baseline")
    baseline = next((r["name"] for r in scaling if r["key"] == baseline_key), baseline_key or "the baseline")
    cpus, threads = results["environment"].get("cpus"), cfg["threads"]
    world_sizes = sorted({r["world_size"] for r in scaling})
    crowded = [w for w in world_sizes if cpus and w * threads > cpus]
    lines = [
        "",
        f"## Step time and per-rank memory by world size: {', '.join(names)}",
        "",
        f"Weak scaling: batch per rank fixed at {cfg['batch']} sequences, so the global batch grows with the world "
        "size (losses are not comparable across world sizes) and with perfect scaling the step time would stay "
        "flat, while a sharded variant's model state per rank falls as 1/N.",
    ]
    if cpus:
        lines += [
            "",
            f"**Cores: this machine has {cpus} CPU cores (`os.cpu_count()`); world size N runs N processes x "
            f"{threads} thread(s).** "
            + (
                f"At world size {', '.join(map(str, crowded))} there are more threads than cores, so the step time "
                "there mostly measures oversubscription (ranks waiting for a core, and every collective waiting "
                "for the rank that is descheduled), not the cost of sharding. It also weighs more on a variant "
                "that synchronises the ranks more often (a sharded one gathers and reduce-scatters per unit, DDP "
                "all-reduces per gradient bucket), so the ratio there is no clean comparison either."
                if crowded
                else "Every world size fits in the cores."
            ),
        ]
    reused = sorted({r["world_size"] for r in scaling if len(r.get("interleaved_with", [])) > len(names)})
    if reused:
        lines += [
            "",
            f"At world size {', '.join(map(str, reused))} the rows come from the comparison's run (all its variants "
            "interleaved); at the others the scaling variants alone are interleaved.",
        ]
    lines += [
        "",
        f"| World size | Variant | Median step (ms) | vs {baseline}: ratio of medians (paired) | Model state / rank "
        "| x world size (1.0 = ideal 1/N) | Peak live / rank | Shards / replica at step start "
        "| All-gathered / step | Reduce-scattered / step | Total moved / step |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    at_one = {
        r["key"]: _max([m["total"] for m in r["model_state"]])
        for r in scaling
        if r["status"] == "ok" and r["world_size"] == 1
    }
    for row in sorted(scaling, key=lambda r: r["world_size"]):  # stable: the variants' order within a world size
        world = f"{row['world_size']}" + (" (oversubscribed)" if row["world_size"] in crowded else "")
        if row["status"] != "ok":
            error = str(row.get("error", "")).replace("|", "\\|").replace("\n", " ")[:200]
            lines.append(f"| {world} | {row['name']} | **failed**: {error} |" + " |" * 8)
            continue
        state = _max([m["total"] for m in row["model_state"]])
        base = at_one.get(row["key"])
        scaled = f"{state * row['world_size'] / base:.3f}" if base else "n/a"
        comm = _comm_cells(row, P)
        lines.append(
            f"| {world} | {row['name']} | {_ms(row.get('median_step_ms'))} "
            f"| {_ratio(row.get('ratio_to_reference'))} ({_ratio(row.get('paired_ratio_to_reference'))}) "
            f"| {fmt_bytes(state)} | {scaled} | {fmt_bytes(_max(row['peak_live_bytes']))} "
            f"| {fmt_bytes(_max(row['live_at_start_bytes']))} | {comm[0]} | {comm[1]} | {comm[3]} |"
        )
    return lines


_SHORT = {
    "custom_full_shard": "custom\nFULL_SHARD",
    "custom_full_shard_post": "custom FULL_SHARD\nBACKWARD_POST",
    "custom_shard_grad_op": "custom\nSHARD_GRAD_OP",
    "custom_no_shard": "custom\nNO_SHARD",
    "ddp": "torch\nDDP",
    "fsdp1": "torch\nFSDP1",
    "fsdp2": "torch\nFSDP2",
}


def plot(results: dict[str, Any], path: Path) -> None:
    """Step time and memory per rank per variant; per-rank memory and step time against world size."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            f"the benchmark's plot needs matplotlib: pip install matplotlib (results.md and results.json are already "
            f"written to {path.parent})"
        ) from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["variants"]
    names = [_SHORT.get(r["key"], r["name"]) for r in rows]
    fig, grid = plt.subplots(2, 2, figsize=(15, 10.5))
    axes = grid.flatten()

    ax = axes[0]
    times = [r.get("median_step_ms") or 0.0 for r in rows]
    colors = ["tab:blue" if r["key"].startswith("custom") else "tab:gray" for r in rows]
    bars = ax.bar(range(len(rows)), times, color=colors)
    for bar, row in zip(bars, rows):
        label = (
            "failed"
            if row["status"] != "ok"
            else (f"{row.get('median_step_ms', 0):.0f}\n{_ratio(row.get('ratio_to_reference'))}")
        )
        label_bar(ax, bar, label)
    ax.set_xticks(range(len(rows)), names, fontsize=7)
    ax.set_ylabel("median step time (ms)")
    ax.margins(y=0.15)
    ax.set_title(f"Step time, {results['comparison_world_size']} processes")

    ax = axes[1]
    mib = 2**20
    peak = [(_max(r.get("peak_live_bytes")) or 0) / mib for r in rows]
    state = [(_max([m["total"] for m in r["model_state"]]) if r.get("model_state") else 0) / mib for r in rows]
    width = 0.4
    ax.bar([i - width / 2 for i in range(len(rows))], peak, width, label="peak live tensors", color="tab:orange")
    ax.bar([i + width / 2 for i in range(len(rows))], state, width, label="model state", color="tab:green")
    ax.set_xticks(range(len(rows)), names, fontsize=7)
    ax.set_ylabel("MiB per rank")
    ax.set_title("Memory per rank")
    ax.legend(fontsize=8)

    # The scaling run: one line per variant and quantity; the first variant (FULL_SHARD) solid, the others dashed.
    scaling = [r for r in results["scaling"] if r["status"] == "ok"]
    keys = list(dict.fromkeys(r["key"] for r in scaling))
    every_ws = sorted({r["world_size"] for r in scaling})
    for ax in axes[2:]:
        ax.set_xlabel("world size (processes)")
        if every_ws:
            ax.set_xscale("log", base=2)
            ax.set_xticks(every_ws, [str(w) for w in every_ws])
            ax.set_xlim(min(every_ws) / 1.3, max(every_ws) * 1.3)
    ax_memory, ax_time = axes[2], axes[3]
    timed = False
    for i, key in enumerate(keys):
        rows_of = sorted((r for r in scaling if r["key"] == key), key=lambda r: r["world_size"])
        ws = [r["world_size"] for r in rows_of]
        name, style = rows_of[0]["name"], "-" if i == 0 else "--"
        state = [_max([m["total"] for m in r["model_state"]]) / mib for r in rows_of]
        peak = [_max(r["peak_live_bytes"]) / mib for r in rows_of]
        ax_memory.plot(ws, state, "o" + style, label=f"{name}: model state / rank", color="tab:green")
        ax_memory.plot(ws, peak, "s" + style, label=f"{name}: peak live / rank", color="tab:orange")
        base = next((s for w, s in zip(ws, state) if w == 1), None)
        if i == 0 and base is not None:
            ax_memory.plot(ws, [base / w for w in ws], "k:", linewidth=1, label=f"{name}: ideal 1/N of model state")
        times = [(r["world_size"], r["median_step_ms"]) for r in rows_of if r.get("median_step_ms")]
        if times:
            timed = True
            ax_time.plot(*zip(*times), "o" + style, label=name, color=f"C{i}")
    ax_memory.set_ylim(bottom=0)
    ax_memory.set_ylabel("MiB per rank")
    ax_memory.set_title("Per-rank memory vs world size (batch per rank fixed)")
    ax_memory.legend(fontsize=8)

    cpus, threads = results["environment"].get("cpus"), results["config"]["threads"]
    crowded = [w for w in every_ws if cpus and w * threads > cpus]
    if crowded:
        ax_time.axvspan(min(crowded) / 1.2, max(every_ws) * 1.3, color="0.9", zorder=0)
        ax_time.annotate(
            f"more processes x threads\nthan the {cpus} cores:\noversubscribed",
            (min(crowded), 0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 8),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    ax_time.set_ylim(bottom=0)
    ax_time.set_ylabel("median step time (ms)")
    ax_time.set_title("Step time vs world size (weak scaling: flat is ideal)")
    if timed:
        ax_time.legend(fontsize=8)

    cfg = results["config"]
    save_figure(
        fig,
        f"GPT {cfg['layers']}x{cfg['width']} ({results['num_parameters']:,} parameters), "
        f"batch {cfg['batch']}x{cfg['seq']} per rank, gloo on CPU, torch {results['environment']['torch']}",
        path,
    )


def label_bar(ax: Any, bar: Any, text: str) -> None:
    """``text`` just above ``bar``, centred."""
    ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)


def save_figure(fig: Any, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict[str, Any], out: Path) -> None:
    write_outputs(results, out, markdown(results), plot, plot_optional=False)


def write_outputs(results: dict[str, Any], out: Path, text: str, plot_fn: Any, *, plot_optional: bool = True) -> None:
    """``results.json``, ``results.md`` (``text``) and ``plot.png`` (``plot_fn(results, path)``) into ``out``.
    ``plot_optional``: without matplotlib, a note replaces the plot (the tables and the JSON are written already)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=_json_default))
    (out / "results.md").write_text(text)
    try:
        plot_fn(results, out / "plot.png")
    except ImportError:
        if not plot_optional:
            raise
        (out / "plot-missing.txt").write_text("matplotlib is not installed: pip install matplotlib\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
