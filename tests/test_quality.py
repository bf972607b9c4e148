"""Checks that cost nothing later: the layer contract, lint and strict typing of the package."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return path


def test_layers_import_downward_only() -> None:
    """Also the client contract: unisched_client imports only the wire module (this checkout's, not an installed copy)."""
    out = subprocess.run([_tool("lint-imports")], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]


def test_ruff_is_clean() -> None:
    out = subprocess.run([_tool("ruff"), "check", "unisched", "clients", "bench", "examples", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]


def test_mypy_strict_on_the_benchmarks_and_examples() -> None:
    """Every bench module and example, held to mypy strict like the package: users run them, and the README quotes
    their numbers."""
    _tool("mypy")
    paths = [ROOT / "examples" / "workloads", ROOT / "examples", ROOT / "bench", ROOT / "clients"]
    files = sorted(str(f.relative_to(ROOT)) for d in ("bench", "examples", "examples/workloads") for f in (ROOT / d).glob("*.py"))
    out = subprocess.run([sys.executable, "-m", "mypy", *files], cwd=ROOT,
                         env={**os.environ, "MYPYPATH": ":".join(map(str, paths))}, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert len(files) > 30 and "bench/scenarios.py" in files and "examples/02_pytorch_training.py" in files


def test_mypy_strict_on_the_package() -> None:
    _tool("mypy")
    out = subprocess.run([sys.executable, "-m", "mypy", "unisched", "clients"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]


DOCS = ("README.md", "bench/README.md", "bench/results/HISTORY.md")
"""The pages users read first; their relative links point at committed plots and results."""


def markdown_links(page: Path) -> list[str]:
    """Relative link targets of a markdown page (web links and in-page anchors left out)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    return [t.split("#")[0] for t in targets if not t.startswith(("http://", "https://", "#", "mailto:"))]


def test_the_docs_link_only_to_files_that_exist(tmp_path: Path) -> None:
    missing = [f"{doc}: {t}" for doc in DOCS for t in markdown_links(ROOT / doc) if not (ROOT / doc).parent.joinpath(t).exists()]
    assert not missing, missing
    page = tmp_path / "page.md"  # the check itself: a link to a moved plot is caught, web links and anchors are not
    page.write_text("[a](gone.png) [b](https://example.org/x.png) [c](#results) [d](page.md#top)")
    assert markdown_links(page) == ["gone.png", "page.md"]
