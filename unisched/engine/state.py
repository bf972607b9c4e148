"""Tenants and weights survive restarts: a small JSON state file, written atomically (tmp, fsync, rename).

A truncated or corrupt file never stops the daemon: it is kept aside as state.json.corrupt-<time> and the
daemon starts with what the config declares, saying so in the log.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from unisched.enforce.cgroups import MANAGED_DIR
from unisched.policy import Engine, PolicyError, Priority, validate_tenant_name, validate_weight
from unisched.policy.caps import SessionLimits

__all__ = ["SavedTenant", "StateStore"]

log = structlog.get_logger("unisched.state")
STATE_VERSION = 1


@dataclass(frozen=True)
class SavedTenant:
    name: str
    weight: int
    priority: Priority
    engines: frozenset[Engine]
    gpus: tuple[int, ...] | None
    cgroup: str
    adopted: bool
    owner_uid: int
    limits: SessionLimits = field(default_factory=SessionLimits)
    ephemeral: bool = False
    """Removed once its last process exits (`unisched run` without --keep). Absent in older files: kept."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "weight": self.weight,
            "priority": self.priority.value,
            "engines": sorted(e.value for e in self.engines),
            "gpus": list(self.gpus) if self.gpus is not None else None,
            "cgroup": self.cgroup,
            "adopted": self.adopted,
            "owner_uid": self.owner_uid,
            "limits": {
                "render": self.limits.render, "decode": self.limits.decode, "encode": self.limits.encode,
                "memory_bytes": self.limits.memory_bytes,
            },
            "ephemeral": self.ephemeral,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> SavedTenant:
        gpus = d.get("gpus")
        name = validate_tenant_name(d["name"])
        return SavedTenant(
            name=name,
            weight=validate_weight(d["weight"]),
            priority=Priority(d["priority"]),
            engines=frozenset(Engine(e) for e in d["engines"]),
            gpus=tuple(int(g) for g in gpus) if gpus is not None else None,
            cgroup=_checked_cgroup(name, d["cgroup"], d["adopted"]),
            adopted=bool(d["adopted"]),
            owner_uid=int(d["owner_uid"]),
            limits=SessionLimits(**d.get("limits", {})),
            ephemeral=d.get("ephemeral", False) is True,
        )


def _checked_cgroup(name: str, cgroup: Any, adopted: Any) -> str:
    """A corrupt file must not point the daemon at a cgroup it does not manage: a tenant it created lives at
    /unisched/<name>; an adopted one at an absolute path below the root, without '..'."""
    if not isinstance(cgroup, str) or not isinstance(adopted, bool):
        raise ValueError(f"tenant {name!r}: cgroup must be a string and adopted a boolean")
    if not adopted and cgroup != f"/{MANAGED_DIR}/{name}":
        raise ValueError(f"tenant {name!r}: cgroup {cgroup!r} is not /{MANAGED_DIR}/{name}")
    if not cgroup.startswith("/") or cgroup.strip("/") == "" or ".." in cgroup.split("/") or "\0" in cgroup:
        raise ValueError(f"tenant {name!r}: cgroup {cgroup!r} is not a path below the cgroup root")
    return cgroup


class StateStore:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.path = self.dir / "state.json"

    def load(self) -> list[SavedTenant]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            data = json.loads(raw)
            if data.get("version") != STATE_VERSION:
                raise ValueError(f"unsupported state version {data.get('version')!r}")
            return [SavedTenant.from_json(t) for t in data["tenants"]]
        except (ValueError, KeyError, TypeError, AttributeError, PolicyError) as e:
            keep = self.path.with_name(f"state.json.corrupt-{int(time.time())}")
            n = 1
            while keep.exists():  # two corrupt files within a second: keep both
                keep = self.path.with_name(f"state.json.corrupt-{int(time.time())}-{n}")
                n += 1
            os.replace(self.path, keep)
            log.error("state file unreadable; kept a copy and starting from the config", error=str(e), copy=str(keep))
            return []

    def measured_contention(self, gpu_name: str) -> tuple[float, float] | None:
        """(compute_kept, graphics_kept) from a calibration run on this GPU model (bench/calibrate_contention.py)."""
        path = self.dir / "contention.json"
        try:
            entry = json.loads(path.read_text())["gpus"][gpu_name]
            return float(entry["compute_kept"]), float(entry["graphics_kept"])
        except FileNotFoundError:
            return None
        except (KeyError, TypeError, ValueError) as e:
            if not isinstance(e, KeyError):
                log.error("contention file unreadable; slicing compute and graphics together", path=str(path), error=str(e))
            return None

    def save(self, tenants: list[SavedTenant]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        # one tenant per line, each line by the C encoder (indent= would make the whole dump pure Python:
        # 60 ms at 1000 tenants, paid on every registration)
        lines = ",\n ".join(json.dumps(t.to_json(), separators=(",", ":")) for t in tenants)
        body = f'{{"version": {STATE_VERSION}, "tenants": [\n {lines}\n]}}\n'.encode()
        tmp = self.path.with_name(f".state.json.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
