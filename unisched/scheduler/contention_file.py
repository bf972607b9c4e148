"""STATE_DIR/contention.json: how much compute and graphics slow each other, per GPU model.

Written by `unisched calibrate` (unisched.calibrate), read by the daemon once at start (StateStore.
measured_contention), which derives its contention map from the two kept fractions (policy.contention,
ContentionMap.from_kept). One module owns the format, its checks and the atomic write, so the writer and the reader
cannot disagree:

  {"version": 1, "gpus": {"<NVML name of the GPU>": {"compute_kept": .., "graphics_kept": .., "measured_at": ..,
                                                      "command": .., "render_iterations": ..}}}

compute_kept (graphics_kept) is the CUDA load's (render load's) throughput beside the other over its throughput
alone. Entries of other GPU models are kept when one is written, so one file serves a mixed fleet.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unisched.scheduler.durable import replace_durably

__all__ = ["CONTENTION_FILE", "CONTENTION_VERSION", "MAX_KEPT", "ContentionFileError", "contention_path", "kept_of",
           "make_entry", "read_file", "write_entry"]

CONTENTION_FILE = "contention.json"
CONTENTION_VERSION = 1
MAX_KEPT = 1.5
"""The most a kept fraction may read. A load cannot run faster beside another than alone, so a little above 1 is
noise (the policy takes it as 1); this far above it the solo run measured something else (its start-up, another
process on the GPU) and the fraction is refused rather than filed."""


class ContentionFileError(RuntimeError):
    """The file (or an entry for it) is not one the daemon could use; the message says why."""


def contention_path(state_dir: str | Path) -> Path:
    """Where the daemon with this state dir reads the file."""
    return Path(state_dir) / CONTENTION_FILE


def kept_of(entry: Any) -> tuple[float, float]:
    """(compute_kept, graphics_kept) of one GPU's entry, checked: numbers, finite, within 0 .. MAX_KEPT."""
    if not isinstance(entry, Mapping):
        raise ContentionFileError(f"an entry must be an object, got {type(entry).__name__}")
    kept = []
    for key in ("compute_kept", "graphics_kept"):
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ContentionFileError(f"{key} must be a number, got {value!r}")
        if not (math.isfinite(value) and 0.0 <= value <= MAX_KEPT):
            raise ContentionFileError(f"{key} must be within 0 .. {MAX_KEPT:g}, got {value!r}")
        kept.append(float(value))
    return kept[0], kept[1]


def make_entry(compute_kept: float, graphics_kept: float, command: str, render_iterations: int | None,
               now: dt.datetime | None = None) -> dict[str, Any]:
    """One GPU's entry, rounded as written (the daemon's map is derived from these written numbers); checked."""
    entry = {"compute_kept": round(compute_kept, 4), "graphics_kept": round(graphics_kept, 4),
             "measured_at": (now or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ"),
             "command": command, "render_iterations": render_iterations}
    kept_of(entry)
    return entry


def read_file(path: Path) -> dict[str, Any]:
    """The whole file (an empty one when absent); ContentionFileError when it is not a file an entry can be merged
    into (it is then left as it is for a person to look at)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"version": CONTENTION_VERSION, "gpus": {}}
    except (OSError, ValueError) as exc:
        raise ContentionFileError(f"{path} is unreadable ({exc}): fix or move it away") from exc
    if not isinstance(data, dict) or data.get("version") != CONTENTION_VERSION or not isinstance(data.get("gpus"), dict):
        raise ContentionFileError(f"{path} is not a version-{CONTENTION_VERSION} contention file: fix or move it away")
    return data


def write_entry(path: Path, gpu: str, entry: Mapping[str, Any]) -> None:
    """Merge `entry` for `gpu` into the file at `path` (other GPUs' entries kept), atomically: a reader, or a crash
    midway, sees the old file or the new one, never part of one."""
    if not gpu:
        raise ContentionFileError("the GPU name is empty")
    kept_of(entry)
    data = read_file(path)
    data["gpus"][gpu] = dict(entry)
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_durably(path, text.encode(), 0o644)  # the daemon and `unisched status` readers need not be the writer
