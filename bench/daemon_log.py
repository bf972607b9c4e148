"""What a daemon's log (JSON lines) says it did over a measured window: how long its saturation gate kept a GPU
sliced, and how often it opened the GPU again because the turns were left unused; and, over its whole run, by which
rule it split the GPU's busy time among the tenants (`charged_by_rule`), and what it had charged each tenant it
removed (`removed_charges`).

Why from the log: a run's figures (FPS, rates) say what the tenants got, not whether the daemon was rationing at
all; a miss with the GPU sliced throughout and one with it open throughout are different findings. The gate logs
each change ("slicing", "lending" with its reason), and the daemon thaws everything when it stops.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

UNUSED = "turns left unused"
"""The start of a "lending" reason that says the turns were left unused (paced tenants), not that demand fell."""


@dataclass(frozen=True)
class Gate:
    """The gate over [start, end]: seconds with some GPU resource sliced, the openings for unused turns (one per
    contention domain that opened), and the highest busy fraction the gate read at one of them (how little the turn
    holders used)."""

    sliced_s: float
    unused_openings: int
    opening_util: float | None = None


def _stamp(entry: dict[str, object]) -> float | None:
    text = entry.get("timestamp")
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def gate_over(log: Path, start: float, end: float) -> Gate | None:
    """The gate's sliced time and unused-turn openings inside [start, end] (wall-clock seconds); None without the log.
    A resource sliced when the log ends counts as sliced to `end` (the daemon was killed before it could say)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    since: dict[tuple[object, object], float] = {}  # resource -> when it was sliced
    spans: list[tuple[float, float]] = []
    openings: list[float | None] = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or (t := _stamp(entry)) is None:
            continue
        event, key = entry.get("event"), (entry.get("gpu"), entry.get("domain"))
        if event == "slicing":
            since.setdefault(key, t)
        elif event == "lending":
            if key in since:
                spans.append((since.pop(key), t))
            if str(entry.get("reason", "")).startswith(UNUSED) and start <= t <= end:
                util = entry.get("util")
                openings.append(float(util) if isinstance(util, int | float) else None)
        elif event in ("all managed cgroups thawed", "stopped"):
            spans += [(s, t) for s in since.values()]
            since.clear()
    spans += [(s, end) for s in since.values()]
    utils = [u for u in openings if u is not None]
    return Gate(round(_union(spans, start, end), 3), len(openings), max(utils) if utils else None)


def _union(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] covered by any of the spans."""
    total, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b > max(a, reach):
            total += b - max(a, reach)
            reach = b
    return total


CHARGED = "busy time charged, by the rule that split it"
"""The line the daemon logs as it stops: per resource, the GPU seconds charged under each charge rule."""


def charged_by_rule(log: Path) -> dict[str, float] | None:
    """GPU seconds the daemon charged over its run under each charge rule (process-rate, signal, cpu-time), all its
    resources together, from the line it logs as it stops; None without the log or the line (a daemon killed)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == CHARGED and isinstance(entry.get("charged"), dict):
            out: dict[str, float] = {}
            for rules in entry["charged"].values():
                for rule, seconds in (rules.items() if isinstance(rules, dict) else ()):
                    if isinstance(seconds, int | float):
                        out[str(rule)] = out.get(str(rule), 0.0) + float(seconds)
            return out
    return None


REMOVED = "tenant removed"
"""The line the daemon logs as it removes a tenant, with what it charged it (per resource, by `rule/source`)."""


def removed_charges(log: Path) -> dict[str, tuple[float | None, dict[str, float]]]:
    """Per tenant the daemon removed, when (wall clock) and what it had charged it, as {"gpu0/sm signal/alone":
    seconds} (bench/charges.py's keys); empty without the log or such lines."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    out: dict[str, tuple[float | None, dict[str, float]]] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("event") != REMOVED or not isinstance(entry.get("charged"), dict):
            continue
        charged = {f"{r} {kind}": float(s) for r, kinds in entry["charged"].items() if isinstance(kinds, dict)
                   for kind, s in kinds.items() if isinstance(s, int | float)}
        out[str(entry.get("tenant"))] = (_stamp(entry), charged)
    return out
