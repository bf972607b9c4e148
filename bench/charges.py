"""What the daemon charged each tenant of a pair over its measured window, by rule and source, beside what the tenant
measured: kept by bench/gpu_pairs.py, read by bench/readers.py and shown by bench/summary.py's reports.

Why: a pair's measured shares say that a tenant got more or less than its weight, not why. The daemon keeps each
tenant's charges by the rule that split the busy time and their source (docs/design/scheduling.md, Charging): a
thawed tenant charged `beside-drain` paid for intervals in which the other's queued work drained, and a split that
puts that drain on it moves the shares. Two snapshots of `unisched tenants --json`, at the window's start and end,
give each tenant's charges over the window (their difference), to set next to its rate; where the end's came after a
tenant was removed, the `tenant removed` line of the daemon's log (kept with the run) says what it had been charged.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scoring import shares

DAEMON_LOGS = "daemon-logs"
"""Where in bench/gpu_pairs.py's --out each run's daemon log is kept (`keep_log`), named after its pair (`log_name`)."""
LOG_HEAD_BYTES = 50_000
LOG_TAIL_BYTES = 150_000
"""How much of a daemon's log a run keeps (its start-up, and its end: the charges of each tenant it removed, how it
split the busy time, its stop): a log at --log-level debug writes lines every slice, and a suite's raw archive holds
at most 1 MB compressed (bench/summary.py)."""


def keep_log(log: Path, dest: Path, head: int = LOG_HEAD_BYTES, tail: int = LOG_TAIL_BYTES) -> bool:
    """Copy a daemon's log to `dest`, whole up to head + tail bytes, else its first `head` and last `tail` bytes
    around a line that says how much was left out. False where there is no log."""
    try:
        size = log.stat().st_size
    except OSError:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    if size <= head + tail:
        shutil.copyfile(log, dest)
        return True
    with log.open("rb") as f:
        first = f.read(head)
        f.seek(size - tail)
        last = f.read(tail)
    first = first[:first.rfind(b"\n") + 1]  # whole lines only
    last = last[last.find(b"\n") + 1:]
    dest.write_bytes(first + f"... {size - len(first) - len(last)} bytes of the log left out ...\n".encode() + last)
    return True


def log_name(label: str) -> str:
    """The file a run's daemon log is kept as (`cuda+render 1:1` -> cuda+render_1-1.log)."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", label.replace(":", "-")) + ".log"


def compact(snap: Mapping[str, Any]) -> dict[str, Any]:
    """What a charges snapshot keeps of `unisched tenants --json` (pairs_runs.Daemon.tenants_json): when it was asked
    and answered, and per tenant its weight, GPU seconds and its charges as {"gpu0/sm signal/alone": seconds}."""
    out: dict[str, Any] = {"asked": snap.get("at"), "answered": snap.get("answered"), "rc": snap.get("rc")}
    if snap.get("error"):
        out["error"] = snap["error"]
    parsed = snap.get("parsed")
    if not isinstance(parsed, list):
        return out
    tenants: dict[str, Any] = {}
    for t in parsed:
        charges = {f"gpu{s['gpu']}/{s['domain']} {c['rule']}/{c['source']}": c["seconds"]
                   for s in t.get("shares") or [] for c in s.get("charges") or []}
        tenants[str(t["name"])] = {"weight": t.get("weight"), "gpu_seconds": t.get("gpu_seconds"), "charges": charges}
    out["tenants"] = tenants
    return out


def _failed(when: str, snap: Mapping[str, Any] | None) -> str:
    return f"the snapshot at the window's {when} ({(snap or {}).get('error') or 'rc ' + str((snap or {}).get('rc'))}) failed"


def over_window(start: Mapping[str, Any] | None, end: Mapping[str, Any] | None,
                removed: Mapping[str, tuple[float | None, Mapping[str, float]]] | None = None
                ) -> tuple[dict[str, dict[str, float]], dict[str, float | None], str | None]:
    """Each tenant's charges between two compact snapshots (the end's less the start's, per kind), and the seconds
    between the answers. A tenant the end snapshot missed (its workload ended and the daemon removed it first) ends
    at its removal instead, with what the daemon's log says it had charged it then (`removed`: daemon_log.
    removed_charges). Also why there are none."""
    if not start or "tenants" not in start:
        return {}, {}, "no charges: " + _failed("start", start)
    ends: dict[str, tuple[Any, Mapping[str, float]]] = {}
    if end and "tenants" in end:
        ends = {n: (end.get("answered"), t.get("charges") or {}) for n, t in end["tenants"].items()}
    for name, (at, charged) in (removed or {}).items():
        ends.setdefault(name, (at, charged))
    if not ends:
        return {}, {}, "no charges: " + _failed("end", end)
    t0 = start.get("answered")
    out: dict[str, dict[str, float]] = {}
    seconds: dict[str, float | None] = {}
    for name, (at, charged) in ends.items():
        before = (start["tenants"].get(name) or {}).get("charges") or {}
        out[name] = {k: round(s - float(before.get(k, 0.0)), 4) for k, s in charged.items()
                     if s - float(before.get(k, 0.0)) > 0}
        seconds[name] = at - t0 if isinstance(at, int | float) and isinstance(t0, int | float) else None
    return out, seconds, None


def pair_rows(group: Mapping[str, Any], derived: Mapping[str, Any],
              removed: Mapping[str, tuple[float | None, Mapping[str, float]]] | None = None
              ) -> tuple[list[dict[str, Any]], str | None]:
    """One row per tenant of a pair's run under the daemon (`group`, as results.json keeps it, with its charges
    snapshots; `removed`: over_window's) beside what was measured (`derived`: pairs_plan.derive_pair): its weight
    share, normalized rate and part of the summed rates, the GPU seconds it was charged over the window and its part
    of the pair's, and those seconds by resource, rule and source. Also why there are none."""
    snaps = group.get("charges") or {}
    window, seconds, why = over_window(snaps.get("start"), snaps.get("end"), removed)
    if why is not None:
        return [], why
    tenants = group.get("tenants") or []
    missing = [t["name"] for t in tenants if t["name"] not in window]
    if missing:
        return [], f"no charges: {', '.join(missing)} gone before the snapshot at the window's end, and not in the log"
    ended = set((snaps.get("end") or {}).get("tenants") or {})
    weights = [float(t.get("weight") or 0.0) for t in tenants]
    norm = ((derived.get("unisched") or {}).get("normalized")) or [None] * len(tenants)
    total_norm = sum(n for n in norm if isinstance(n, int | float))
    charged = [sum(window[t["name"]].values()) for t in tenants]
    total = sum(charged)
    rows = []
    for t, share, n, c in zip(tenants, shares(weights) if all(weights) else [None] * len(tenants), norm, charged,
                              strict=True):
        s = seconds[t["name"]]
        rows.append({"tenant": t["name"], "kind": t.get("kind"), "weight": t.get("weight"), "weight_share": share,
                     "normalized": n, "part": n / total_norm if isinstance(n, int | float) and total_norm else None,
                     "charged_s": round(c, 4), "charged_part": round(c / total, 4) if total else None,
                     "by": dict(sorted(window[t["name"]].items())), "window_s": None if s is None else round(s, 3),
                     "to": "end" if t["name"] in ended else "removal"})
    return rows, None


def _cell(x: Any) -> str:
    return "n/a" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)


def charges_md(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """report.md's section of the charges over each pair's window, per round (none where no case has them)."""
    rows = [(r["round"], case, row) for r in rounds for case, m in (r.get("cases") or {}).items()
            for row in (m.get("charges") or [])]
    if not rows:
        return []
    out = ["## What the daemon charged, by rule and source", "",
           "Per pair and round, each tenant's GPU seconds charged over the window (between snapshots of `unisched "
           "tenants --json` at its start and end), next to what it measured: its part of the pair's charges against "
           "its part of the summed normalized rates and its weight share. `beside-drain`: charged while thawed beside "
           "a tenant whose queued work drained (docs/design/scheduling.md, Charging). Over: the seconds between the "
           "snapshots, or to the tenant's removal where the end's missed it (its charges then from the daemon's log).",
           "", "| round | case | tenant | weight share | normalized | part of the sum | charged part | charged s "
           "| by rule and source (s) | over s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k, case, row in rows:
        by = ", ".join(f"{key} {_cell(s)}" for key, s in row["by"].items()) or "none"
        to = "" if row.get("to", "end") == "end" else " (to its removal)"
        out.append(f"| {k} | {case} | {row['tenant']} | {_cell(row['weight_share'])} | {_cell(row['normalized'])} | "
                   f"{_cell(row['part'])} | {_cell(row['charged_part'])} | {_cell(row['charged_s'])} | {by} | "
                   f"{_cell(row['window_s'])}{to} |")
    return [*out, ""]
