"""Tenants and weights survive restarts: a small JSON state file, written atomically (tmp, fsync, rename).

A damaged file never stops the daemon and never costs the tenants it still describes: the file holds one tenant
per line, so from a truncated or partly corrupt file every entry that parses is kept and each dropped one is
logged with why. The damaged file is kept aside as state.json.corrupt-<time>. A state path that is a directory,
or JSON nested past the parser's depth, is the same: logged, kept aside, and the daemon starts.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from unisched.enforce.cgroups import DEFAULT_SUBTREE
from unisched.policy import Engine, PolicyError, Priority, validate_tenant_name, validate_weight
from unisched.policy.caps import SessionLimits
from unisched.scheduler.contention_file import ContentionFileError, contention_path, kept_of, read_file
from unisched.scheduler.durable import replace_durably
from unisched.scheduler.labels import validate_labels

__all__ = ["LineCache", "SavedFields", "SavedTenant", "StateStore", "parse_state"]

log = structlog.get_logger("unisched.state")
STATE_VERSION = 1
MAX_ENTRY_CHARS = 64 << 10
"""A tenant's line is a few hundred characters; a longer line is damage, not parsed (and cannot nest deep)."""
_HEADER = re.compile(r'\{"version": (\d+), "tenants": \[')
_ENTRY_ERRORS = (ValueError, KeyError, TypeError, AttributeError, PolicyError, RecursionError)


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
    labels: Mapping[str, str] = field(default_factory=dict)
    """Where an orchestrator runs it (scheduler.labels); absent in older files: none."""

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
                "memory_bytes": self.limits.memory_bytes, "memory_reserve": self.limits.memory_reserve,
            },
            "ephemeral": self.ephemeral,
            "labels": dict(self.labels),
        }

    @staticmethod
    def from_json(d: dict[str, Any], subtree: str = DEFAULT_SUBTREE) -> SavedTenant:
        gpus = d.get("gpus")
        name = validate_tenant_name(d["name"])
        return SavedTenant(
            name=name,
            weight=validate_weight(d["weight"]),
            priority=Priority(d["priority"]),
            engines=frozenset(Engine(e) for e in d["engines"]),
            gpus=tuple(int(g) for g in gpus) if gpus is not None else None,
            cgroup=_checked_cgroup(name, d["cgroup"], d["adopted"], subtree),
            adopted=bool(d["adopted"]),
            owner_uid=int(d["owner_uid"]),
            limits=SessionLimits(**d.get("limits", {})),
            ephemeral=d.get("ephemeral", False) is True,
            labels=validate_labels(d.get("labels", {})),
        )


def _checked_cgroup(name: str, cgroup: Any, adopted: Any, subtree: str) -> str:
    """A corrupt file must not point the daemon at a cgroup it does not manage: a tenant it created lives at
    /<subtree>/<name>; an adopted one at an absolute path below the root, without '..'."""
    if not isinstance(cgroup, str) or not isinstance(adopted, bool):
        raise ValueError(f"tenant {name!r}: cgroup must be a string and adopted a boolean")
    if not adopted and cgroup != f"/{subtree}/{name}":
        raise ValueError(f"tenant {name!r}: cgroup {cgroup!r} is not /{subtree}/{name}")
    if not cgroup.startswith("/") or cgroup.strip("/") == "" or ".." in cgroup.split("/") or "\0" in cgroup:
        raise ValueError(f"tenant {name!r}: cgroup {cgroup!r} is not a path below the cgroup root")
    return cgroup


def _why(e: BaseException) -> str:
    if isinstance(e, KeyError):
        return f"missing {e}"
    if isinstance(e, RecursionError):
        return "nested too deep"
    return str(e) or type(e).__name__


def _entries(data: Any) -> tuple[list[Any], list[str]]:
    """The tenant entries of a whole parsed file, or why there are none."""
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), list):
        return [], ["not a state file: no tenants list"]
    if data.get("version") != STATE_VERSION:
        return [], [f"unsupported state version {data.get('version')!r}"]
    return list(data["tenants"]), []


def _entries_by_line(text: str) -> tuple[list[tuple[str, Any]], list[str]]:
    """(where, entry) from each line that parses, when the whole file does not; and why each other line does not."""
    out: list[tuple[str, Any]] = []
    problems: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        body = line.strip().rstrip(",")
        header = _HEADER.match(body)
        if header:
            if int(header.group(1)) != STATE_VERSION:
                return [], [f"line {n}: unsupported state version {header.group(1)}"]
            body = body[header.end():].strip().rstrip(",")  # a file cut inside its first entry
        if body in ("", "]}", "]", "}"):
            continue
        if len(body) > MAX_ENTRY_CHARS:
            problems.append(f"line {n}: {len(body)} characters, more than any tenant's entry")
            continue
        try:
            out.append((f"line {n}", json.loads(body)))
        except (ValueError, RecursionError) as e:
            problems.append(f"line {n}: {_why(e)}")
    return out, problems


def parse_state(raw: bytes, subtree: str = DEFAULT_SUBTREE) -> tuple[list[SavedTenant], list[str]]:
    """Every tenant entry that parses, and for each one dropped, why (empty when the file is whole)."""
    text = raw.decode("utf-8", errors="replace")
    try:
        whole, problems = _entries(json.loads(text))
        entries = [(f"entry {i + 1}", e) for i, e in enumerate(whole)]
    except (ValueError, RecursionError) as e:
        entries, problems = _entries_by_line(text)
        problems.insert(0, f"file: {_why(e)}")
    tenants: dict[str, SavedTenant] = {}
    for where, entry in entries:
        try:
            t = SavedTenant.from_json(entry, subtree)
        except _ENTRY_ERRORS as e:
            problems.append(f"{where}: {_why(e)}")
            continue
        if t.name in tenants:
            problems.append(f"{where}: tenant {t.name!r} again")
            continue
        tenants[t.name] = t
    return list(tenants.values()), problems


class StateStore:
    def __init__(self, directory: str | Path, subtree: str = DEFAULT_SUBTREE) -> None:
        self.dir = Path(directory)
        self.path = self.dir / "state.json"
        self.subtree = subtree

    def load(self) -> list[SavedTenant]:
        """The saved tenants: all that parse, whatever else the file holds; a damaged file is kept aside."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:  # a directory where the file should be, or unreadable
            copy = self._keep_aside()
            log.error("state file unreadable; kept it aside and starting from the config", error=e.strerror or str(e),
                      copy=copy)
            return []
        tenants, problems = parse_state(raw, self.subtree)
        if problems:
            copy = self._keep_aside()
            for why in problems:
                log.error("state entry dropped", why=why, copy=copy)
            log.error("state file unreadable in part; kept a copy and restoring every entry that parses",
                      restored=len(tenants), dropped=len(problems), error=problems[0], copy=copy)
        return tenants

    def _keep_aside(self) -> str | None:
        """Move the damaged file (or directory) aside for a person to look at, never over an earlier copy."""
        keep = self.path.with_name(f"state.json.corrupt-{int(time.time())}")
        n = 1
        while keep.exists():  # two corrupt files within a second: keep both
            keep = self.path.with_name(f"state.json.corrupt-{int(time.time())}-{n}")
            n += 1
        try:
            os.replace(self.path, keep)
        except OSError as e:
            log.error("could not keep the damaged state file aside", path=str(self.path), error=e.strerror or str(e))
            return None
        return str(keep)

    def measured_contention(self, gpu_name: str) -> tuple[float, float] | None:
        """(compute_kept, graphics_kept) from a calibration on this GPU model (`unisched calibrate`); None when there
        is none, or when the file or the entry is unusable (logged: compute and graphics are then sliced together)."""
        path = contention_path(self.dir)
        try:
            entry = read_file(path)["gpus"].get(gpu_name)
            return None if entry is None else kept_of(entry)
        except ContentionFileError as e:
            log.error("contention file unusable; slicing compute and graphics together", path=str(path), gpu=gpu_name,
                      error=str(e))
            return None

    def save(self, tenants: list[SavedTenant]) -> None:
        self.write(self.encode(tenants))

    @staticmethod
    def encode(tenants: list[SavedTenant]) -> bytes:
        """The file's bytes: made on the event loop (a consistent snapshot), written by `write`, maybe elsewhere."""
        return _body(_line(t) for t in tenants)

    def write(self, body: bytes) -> None:
        """Replace the file with `body` atomically and durably (durable.replace_durably). Callers make one write at a
        time."""
        self.dir.mkdir(parents=True, exist_ok=True)
        replace_durably(self.path, body)


SavedFields = tuple[Any, ...]
"""A tenant's SavedTenant fields, in their order (Tenant.saved_fields): cheaper to make and compare than the
dataclass."""


class LineCache:
    """The state file's bytes from the tenants' saved fields, encoding again only the lines of tenants whose fields
    changed since the last call. It runs on the event loop at every save, and a thousand tenants' lines are
    milliseconds there; the lines of a few changed tenants are not."""

    def __init__(self) -> None:
        self._lines: dict[str, tuple[SavedFields, str]] = {}

    def body(self, tenants: Iterable[SavedFields]) -> bytes:
        """`tenants` in the file's order; those not given are forgotten."""
        kept, lines = self._lines, {}
        for fields in tenants:
            hit = kept.get(fields[0])
            lines[fields[0]] = hit if hit is not None and hit[0] == fields else (fields, _line(SavedTenant(*fields)))
        self._lines = lines
        return _body(line for _, line in lines.values())


def _line(t: SavedTenant) -> str:
    # one tenant per line, each line by the C encoder (indent= would make the whole dump pure Python:
    # 60 ms at 1000 tenants, paid on every registration)
    return json.dumps(t.to_json(), separators=(",", ":"))


def _body(lines: Iterable[str]) -> bytes:
    joined = ",\n ".join(lines)
    return f'{{"version": {STATE_VERSION}, "tenants": [\n {joined}\n]}}\n'.encode()
