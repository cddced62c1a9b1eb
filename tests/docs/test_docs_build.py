"""The user's manual builds with MkDocs in strict mode (any warning fails: broken links, missing pages, docstrings
the API reference cannot parse), and the generated pages hold what the manual promises."""

from __future__ import annotations

import re
import sys
from html import unescape
from pathlib import Path

import yaml

from benchmarks.ranks import ROOT
from tests.toolbox.launch import run_command


def _text(page: Path) -> str:
    """The visible text of a built HTML page, whitespace collapsed."""
    return unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page.read_text(encoding="utf-8"))))


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_docs_build_strict(tmp_path):
    site = tmp_path / "site"
    mkdocs = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    proc = run_command([*mkdocs, "--config-file", ROOT / "mkdocs.yml", "--site-dir", site], cwd=ROOT, timeout=120)
    assert "WARNING" not in proc.stderr

    # Every page of the nav was rendered.
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    for page in _nav_pages(config["nav"]):
        built = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), page

    # The API reference is generated from docstrings: signatures and docstring sentences are in it.
    api = _text(site / "api" / "index.html")
    for expected in (
        "FSDPStrategy",
        "estimate_memory ( model : Module , world_size : int",
        "Predict the bytes rank",  # estimate_memory's docstring
        "Logs per-step, per-rank memory of the sharded model state",  # ShardingMonitor's docstring
        "none for processes started by someone else",  # choose_launcher's docstring
        "fully_shard",
        "MixedPrecision",
        # Arguments, from the Args sections: FSDPStrategy's (as docs/options.md), fully_shard's device,
        # load_pretrained's path.
        "filled in by the Trainer",
        "gather for forward, free, gather again for backward",
        "where units are gathered, computed and reduced",
        "a directory holding model.safetensors",
    ):
        assert expected in api, expected
    # Development notes are built but are not part of the user's navigation.
    assert "contributing.md" not in _nav_pages(config["nav"])

    # The pages this manual adds: the notebook and gathered-peak diagrams, the CLI's strategy spellings.
    assert "-- fork --> rank 0" in _text(site / "notebooks" / "index.html")
    assert "peak R + the largest block" in _text(site / "monitoring" / "index.html")
    cli = _text(site / "cli" / "index.html")
    assert "strategy: fsdp_custom" in cli and "class_path: lightning_fsdp.FSDPStrategy" in cli
