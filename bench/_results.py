"""What each benchmark script writes beside its numbers: the exact command, when, on which host; and the two files,
results.json and results.md, in its --out folder. One place, so that every script's results say the same."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import shlex
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def utc_now() -> str:
    """Now, in UTC, as every results file writes its dates."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def run_info() -> dict[str, Any]:
    """The command as run from the project root, the UTC date, the host, its CPUs and Python."""
    return {"command": f"python3 bench/{Path(sys.argv[0]).name} " + shlex.join(sys.argv[1:]),
            "date_utc": utc_now(), "host": socket.gethostname(),
            "cpus": os.cpu_count(), "python": platform.python_version()}


def header(res: Mapping[str, Any]) -> str:
    """results.md's first line: run_info's command, date and host."""
    return f"Command: `{res['command']}` | {res['date_utc']} UTC | host {res['host']} ({res['cpus']} CPUs)\n\n"


def finite(obj: Any) -> Any:
    """NaN and infinities as null, so that what is written is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def write_atomic(path: Path, text: str) -> None:
    """Readers (and a run cut short) see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def save_json(path: Path, data: Any, indent: int = 1) -> None:
    write_atomic(path, json.dumps(finite(data), indent=indent) + "\n")


def write(out: Path, res: Mapping[str, Any], md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_json(out / "results.json", res)
    write_atomic(out / "results.md", md)


def save_plot(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write (PNG, 110 dpi) and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
