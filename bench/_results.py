"""What each benchmark script writes beside its numbers: the exact command, when, on which host; and the two files,
results.json and results.md, in its --out folder. One place, so that every script's results say the same."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def run_info() -> dict[str, Any]:
    """The command as run from the project root, the UTC date, the host, its CPUs and Python."""
    return {"command": f"python3 bench/{Path(sys.argv[0]).name} " + shlex.join(sys.argv[1:]),
            "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname(),
            "cpus": os.cpu_count(), "python": platform.python_version()}


def header(res: Mapping[str, Any]) -> str:
    """results.md's first line: run_info's command, date and host."""
    return f"Command: `{res['command']}` | {res['date_utc']} UTC | host {res['host']} ({res['cpus']} CPUs)\n\n"


def write(out: Path, res: Mapping[str, Any], md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(md)
