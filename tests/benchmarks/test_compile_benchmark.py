"""``python -m benchmarks --compile``'s arithmetic: medians of the slowest rank's steps, speed-ups, compile time and
the targets, on hand-written step times (the run itself is timing, never asserted in tests)."""

from __future__ import annotations

import pytest

from benchmarks import BenchmarkConfig
from benchmarks.__main__ import parse_args
from benchmarks.compile import SETUPS, markdown, summarise

# Per setup: eager step seconds, compiled step seconds (after the first, which includes compiling).
STEP_S = {"local": (0.10, 0.05), "ddp": (0.12, 0.07), "fsdp2": (0.30, 0.25), "custom": (0.13, 0.072)}
FIRST_COMPILED_S = 5.0


def _per_rank(cfg: BenchmarkConfig, slower_rank: int) -> list[dict]:
    ranks = []
    for rank in range(2):
        runs = {}
        for setup, (eager, compiled) in STEP_S.items():
            for kind, seconds in (("eager", eager), ("compiled", compiled)):
                times = [FIRST_COMPILED_S if kind == "compiled" else seconds] + [seconds] * (cfg.warmup + cfg.steps)
                if rank == slower_rank:
                    times = [t + 0.01 for t in times]  # a step ends when the slowest rank's does
                runs[f"{setup}+{kind}"] = {"times": times, "losses": [2.0, 1.5]}
        ranks.append(runs)
    return ranks


def test_summary_of_interleaved_runs() -> None:
    cfg = BenchmarkConfig(warmup=1, steps=3)
    summary = summarise(_per_rank(cfg, slower_rank=1), cfg)
    rows = summary["rows"]
    assert len(rows) == 2 * len(SETUPS)
    for setup, (eager, compiled) in STEP_S.items():
        assert rows[f"{setup}+eager"]["median_step_ms"] == pytest.approx((eager + 0.01) * 1e3)
        assert rows[f"{setup}+compiled"]["median_step_ms"] == pytest.approx((compiled + 0.01) * 1e3)
        assert summary["speedups"][setup] == pytest.approx((eager + 0.01) / (compiled + 0.01))
        assert rows[f"{setup}+compiled"]["compile_s"] == pytest.approx(FIRST_COMPILED_S - compiled)
    targets = {t["ratio"]: t for t in summary["targets"]}
    assert len(targets) == 3
    vs_ddp = targets["custom+compiled / ddp+compiled"]
    assert vs_ddp["value"] == pytest.approx(0.082 / 0.08) and vs_ddp["met"] is True  # 1.025 <= 1.05
    vs_fsdp2 = targets["custom+compiled / fsdp2+compiled"]
    assert vs_fsdp2["value"] == pytest.approx(0.082 / 0.26) and vs_fsdp2["met"] is True
    share = targets["custom speed-up / ddp speed-up"]
    assert share["value"] == pytest.approx((0.14 / 0.082) / (0.13 / 0.08)) and share["met"] is True
    text = markdown(
        {
            **summary,
            "command": "cmd",
            "backend": "inductor",
            "config": vars(cfg),
            "environment": {"torch": "x", "cpus": 2},
        }
    )
    assert text.count("\n| ") == len(SETUPS) + 2 + len(targets) + 2  # two tables: headers, rules and rows


def test_compile_flags_parse() -> None:
    args = parse_args(["--compile", "--compile-backend", "aot_eager"])
    assert args.compile and args.compile_backend == "aot_eager"
    assert parse_args([]).compile is False
