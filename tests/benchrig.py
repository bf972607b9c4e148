"""bench/ (a script folder, not a package) as the bench tests import it, and its runner run as a user runs it."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType

from conftest import ROOT, child_env

BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))  # as bench/run.py imports its modules

import provenance  # noqa: E402
import readers  # noqa: E402
import suites  # noqa: E402
import summary  # noqa: E402
import verdicts  # noqa: E402

__all__ = ["BENCH", "bench_module", "provenance", "readers", "run_py", "suites", "summary", "verdicts"]


def run_py(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """bench/run.py with these arguments, from the project root."""
    return subprocess.run([sys.executable, str(BENCH / "run.py"), *args], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(), timeout=timeout, check=False)


def bench_module(name: str) -> ModuleType:
    """Another module of bench/ (run, hook_startup, ...), imported as bench/run.py imports it."""
    return importlib.import_module(name)
