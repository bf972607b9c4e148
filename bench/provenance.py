"""What a benchmark run records of where and what it measured: the machine, its GPUs, the commit, and a digest of the
code (so that a commit named by hand, where the tree has no git metadata, can be checked against it later)."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def output_of(*argv: str) -> str:
    """What a command prints (stripped), run in the checkout; "" where it cannot run."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def gpus() -> list[dict[str, str]]:
    """Every GPU nvidia-smi lists (name, driver); empty without one."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = output_of("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader")
    return [{"name": n.strip(), "driver": d.strip()} for n, _, d in (line.rpartition(",") for line in out.splitlines())
            if n.strip()]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    found = gpus()
    return {"host": platform.node(), "cpu": cpu_model(), "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "gpus": found,
            "gpu": found[0]["name"] if found else None, "driver": found[0]["driver"] if found else None}


CODE_DIRS = ("unisched", "clients", "bench", "examples")
"""Where the code a run measures lives (its Python files; bench/results, the runs' records, left out)."""


def is_code(name: str) -> bool:
    """Whether a path in the checkout (relative, with /) is code a run measures: a Python file under CODE_DIRS but
    bench/results (callers list CODE_DIRS' files only)."""
    return name.endswith(".py") and not name.startswith("bench/results/")


def _code_digest(files: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, data in sorted(files):
        h.update(name.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def code_hash(root: Path = ROOT) -> str:
    """A digest of the code in the tree a run measures, so that the commit it names (`--commit`, given by hand where
    the tree has no git metadata) can be checked against it later (`code_hash_at`)."""
    files = [p for d in CODE_DIRS for p in sorted((root / d).rglob("*.py"))
             if "__pycache__" not in p.parts and is_code(p.relative_to(root).as_posix())]
    return _code_digest([(p.relative_to(root).as_posix(), p.read_bytes()) for p in files])


def code_hash_at(rev: str, root: Path = ROOT) -> str | None:
    """`code_hash` of commit `rev`'s tree, from git; None where git cannot say (no such commit, no git)."""
    try:
        names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "--", *CODE_DIRS], cwd=root,
                               capture_output=True, check=True, timeout=60).stdout.decode().splitlines()
        names = [n for n in names if is_code(n)]
        blobs = subprocess.run(["git", "cat-file", "--batch"], cwd=root, input="".join(f"{rev}:{n}\n" for n in names)
                               .encode(), capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    files, at = [], 0
    for n in names:
        header_end = blobs.index(b"\n", at)
        size = int(blobs[at:header_end].split()[2])
        files.append((n, blobs[header_end + 1:header_end + 1 + size]))
        at = header_end + 1 + size + 1
    return _code_digest(files)


def code_changed_since(rev: str, root: Path = ROOT) -> list[str] | None:
    """The code files (CODE_DIRS' Python, as `code_hash` counts them) that differ between commit `rev` and this
    checkout's tracked files; None where git cannot say (no such commit, no git)."""
    try:
        out = subprocess.run(["git", "diff", "--name-only", rev, "--", *CODE_DIRS], cwd=root, capture_output=True,
                             check=True, timeout=60, text=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [n for n in out.splitlines() if is_code(n)]


def commit() -> dict[str, Any]:
    head = output_of("git", "rev-parse", "HEAD")
    dirty = bool(output_of("git", "status", "--porcelain", "--untracked-files=no"))
    return {"commit": head or "unknown", "dirty": dirty}
