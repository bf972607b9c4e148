"""The cloud-gaming orchestrator's calls to the daemon (examples/cloud_gaming.py), all through the `unisched`
command line: the tenants' view, memory caps set as soon as each tenant exists, and this run's refusals; and the
story of the instance that went over its cap (hog_summary), told from those views."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from _children import ROOT, unisched_argv


def set_limit_argv(python: str, socket: str, tenant: str, memory: str) -> list[str]:
    """`unisched set-limit --memory` (admin); '-1' clears a cap an earlier run left on the tenant."""
    return unisched_argv(python, socket, "set-limit", "--tenant", tenant, "--memory", memory)


class Daemon:
    """The orchestrator's calls to the daemon, all through the `unisched` command line."""

    def __init__(self, socket: str, env: dict[str, str]) -> None:
        self.socket, self.env = socket, env

    def call(self, *args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(unisched_argv(sys.executable, self.socket, *args), capture_output=True, text=True,
                              timeout=timeout, env=self.env, cwd=ROOT)

    def tenants(self) -> list[dict[str, Any]] | None:
        try:
            p = self.call("tenants", "--json")
            found = json.loads(p.stdout) if p.returncode == 0 else None
            return found if isinstance(found, list) else None
        except (subprocess.TimeoutExpired, ValueError):
            return None

    def set_limits(self, names: Sequence[str], memory: str) -> dict[str, str | None]:
        """`set-limit --memory` on each tenant at once (in parallel: N start-ups must fit in the warm-up)."""
        procs = {n: subprocess.Popen(set_limit_argv(sys.executable, self.socket, n, memory), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=self.env, cwd=ROOT) for n in names}
        out: dict[str, str | None] = {}
        for n, p in procs.items():
            try:
                text, _ = p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
            out[n] = None if p.returncode == 0 else (text.strip()[-300:] or f"exit status {p.returncode}")
        return out


def apply_caps(daemon: Daemon, names: Sequence[str], memory: str, until: float,
               alive: Callable[[], bool]) -> tuple[dict[str, float], list[str]]:
    """Cap every tenant as soon as the daemon knows it, polling `tenants --json` until `until` at the latest.

    Returns (the time each cap was applied, errors).
    """
    pending = set(names)
    applied: dict[str, float] = {}
    errors: list[str] = []
    while pending:
        known = {t["name"] for t in daemon.tenants() or []}
        ready = sorted(pending & known)
        for name, err in daemon.set_limits(ready, memory).items():
            pending.discard(name)
            if err is None:
                applied[name] = time.time()
            else:
                errors.append(f"set-limit --memory {memory} on {name} failed: {err}")
        if not pending or time.time() >= until or not alive():
            break
        time.sleep(0.5)  # each poll is a Python start-up: leave the CPUs to the starting players
    errors += [f"tenant {n} did not appear before the window; its memory cap was not applied" for n in sorted(pending)]
    return applied, errors


def refusal_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int]:
    """Refusals counted during this run (the daemon keeps counting across runs of a tenant name)."""
    before, after = before or {}, after or {}
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] - before.get(k, 0)}


def daemon_row(tenants: list[dict[str, Any]] | None, name: str | None) -> dict[str, Any] | None:
    return next((t for t in tenants or [] if t.get("name") == name), None)


def compact(tenants: list[dict[str, Any]] | None, names: Sequence[str | None]) -> dict[str, Any]:
    """The daemon's view of our tenants, reduced to what the memory story needs."""
    keep = ("memory_bytes", "over_memory", "state", "refusals")
    return {t["name"]: {k: t.get(k) for k in keep} for t in tenants or [] if t.get("name") in names}


def hog_summary(args: argparse.Namespace, per: list[dict[str, Any]], reports: list[dict[str, Any] | None],
                polls: list[dict[str, Any]], others: list[float]) -> dict[str, Any] | None:
    """What happened to the instance that went over its cap, and to everyone else meanwhile."""
    if not args.hog_mib or args.hog_instance >= len(per):
        return None
    k = args.hog_instance
    entry, own = per[k], (reports[k] or {}).get("hog") or {}
    name = entry["tenant"]
    seen_over = [p["t"] for p in polls if (p["tenants"].get(name) or {}).get("over_memory")]
    if entry["over_memory"]:
        seen_over.append(round(args.seconds, 2))
    probes = {w: own.get(f"probe_{w}") or {} for w in ("in_process", "new_process")}
    refused = {w: p.get("error") for w, p in probes.items() if p and not p.get("opened")}
    out: dict[str, Any] = {
        "instance": k, "tenant": name, **own, "memory_bytes": entry["memory_bytes"],
        "daemon_over_memory": bool(seen_over) if args.unisched_socket else None,
        "daemon_over_memory_first_seen_s": min(seen_over) if seen_over else None,
        "daemon_refusals": entry["refusals"], "refused": bool(refused),
        "refused_error": "; ".join(f"{w}: {e}" for w, e in refused.items()) or None,
        "others_fps_mean": sum(others) / len(others) if others else None,
    }
    tried = [w for w, p in probes.items() if p]
    state = ("not tried" if not tried else f"did not open ({out['refused_error']})" if refused else "opened")
    cap = f"(cap {args.memory_cap})" if args.memory_cap else "(no cap)"
    alloc = (f"allocated {args.hog_mib} MiB" if own.get("allocated") else
             f"allocation failed ({own['alloc_error']})" if own.get("alloc_error") else "reported no allocation")
    daemon = ("" if not args.unisched_socket else
              f", daemon over_memory={out['daemon_over_memory']} refusals={entry['refusals'] or {}}")
    out["summary"] = f"instance {k} {alloc} {cap}; new GPU session {state}{daemon}"
    return out
