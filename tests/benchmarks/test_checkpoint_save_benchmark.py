"""The checkpoint-save benchmark command on a tiny GPT, 2 processes: every variant runs and saves, the report has its
rows, ratios and method. Timing is never asserted (the machines are shared); the 0.35x bound is the command's own
``--check-async-ratio``, for full-size runs."""

from __future__ import annotations

import json

from benchmarks.checkpoint_save import NAMES, VARIANTS, main

SAVES = 2
TINY = [
    *("--world-size", "2", "--layers", "2", "--width", "32", "--heads", "2", "--seq", "16", "--vocab", "65"),
    *("--batch", "1", "--saves", str(SAVES), "--steps-between", "1"),
]


def test_every_variant_saves_and_the_report_says_how(tmp_path):
    assert main([*TINY, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {row["key"]: row for row in results["variants"]}
    assert list(rows) == list(VARIANTS)
    for key, row in rows.items():
        assert len(row["blocked_s"]) == len(row["written_s"]) == SAVES
        assert all(0 < b <= w for b, w in zip(row["blocked_s"], row["written_s"])), (key, row)
        assert row["ratio_to_custom_sync"] > 0
    assert rows["custom_sync"]["ratio_to_custom_sync"] == 1.0
    table = (tmp_path / "results.md").read_text()
    assert "python -m benchmarks.checkpoint_save" in table and "## How each figure is measured" in table
    for name in NAMES.values():
        assert f"| {name} |" in table
