"""The child processes of the scenario orchestrators (cloud_gaming.py, ad_sim.py).

Why one place: both start their players or stages the same way (this checkout first on PYTHONPATH, headless EGL,
each child leading its own session so that a stop reaches everything it started, optionally wrapped in `unisched
run` as a tenant) and quote the same log tails when one fails. They stop them with the daemon's own
unisched.calibrate.runs.kill_group (SIGTERM, then SIGKILL, to the child's whole session).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL_CHARS = 3000


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the orchestrator: stop the children, still write what is known."""


def raise_interrupted(_signum: int, _frame: object) -> None:
    """A signal handler that turns SIGTERM into Interrupted, so the orchestrator's clean-up runs."""
    raise Interrupted


def child_env() -> dict[str, str]:
    """This checkout first on PYTHONPATH (so `python3 -m unisched` is this one) and headless EGL for PyOpenGL."""
    paths = [str(ROOT), str(ROOT / "clients"), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "PYTHONUNBUFFERED": "1",
            "PYOPENGL_PLATFORM": os.environ.get("PYOPENGL_PLATFORM", "egl")}


def unisched_argv(python: str, socket: str, *args: str) -> list[str]:
    """A `unisched` client command on the daemon's socket (run as a module: works without the console script)."""
    return [python, "-m", "unisched", args[0], "--socket", socket, *args[1:]]


def run_argv(python: str, socket: str, tenant: str, weight: int, engines: str, cmd: Sequence[str]) -> list[str]:
    """`unisched run`: the command starts in the tenant's own cgroup, behind the session hooks."""
    return unisched_argv(python, socket, "run", "--tenant", tenant, "--weight", str(weight), "--engines", engines,
                         "--", *cmd)


def log_tail(path: Path, limit: int = LOG_TAIL_CHARS) -> str:
    """The last `limit` characters of a child's log ('' when there is none)."""
    try:
        return path.read_bytes()[-limit:].decode(errors="replace")
    except OSError:
        return ""
