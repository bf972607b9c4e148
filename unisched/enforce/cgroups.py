"""Tenant cgroups: create, attach, read CPU usage, freeze and thaw (cgroup v2, or the v1 freezer).

One Protocol, `CgroupDriver`, with the two real drivers and `FakeCgroupDriver` for logic tests. A cgroup
is named by its path relative to the hierarchy's mount ("/unisched/trainer"), as /proc/PID/cgroup shows it.

Each daemon governs one subtree of the hierarchy (`cgroup_subtree`, default "unisched"): it creates its tenants'
cgroups there and looks nowhere else for cgroups of its own, so two daemons (tests beside a production one) never
touch each other's tenants.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from unisched.enforce.cgtree import MAX_CGROUPS_READ, folders_below

__all__ = [
    "CgroupDriver",
    "CgroupError",
    "CgroupV1Driver",
    "CgroupV2Driver",
    "DEFAULT_SUBTREE",
    "FakeCgroupDriver",
    "adopt_refusal",
    "canonical_cgroup",
    "check_subtree",
    "detect_driver",
    "path_in",
    "within",
]

DEFAULT_SUBTREE = "unisched"
MAX_SUBTREE_CHARS = 255
"""A subtree is a short path of cgroup names; one name may not exceed NAME_MAX (255) anyway."""
_SUBTREE_PART = re.compile(r"[A-Za-z0-9_@:+-][A-Za-z0-9._@:+-]*")
"""Names a systemd slice or a plain directory uses; no whitespace or newline (the governed record is
line-oriented), no leading '.' (so never '.' or '..')."""


def check_subtree(value: str) -> str:
    """The normalised subtree ("a/b", no leading or trailing '/'), or ValueError saying what is wrong."""
    if not isinstance(value, str):
        raise ValueError(f"must be a cgroup path relative to the cgroup root; got {value!r}")
    parts = value.strip("/").split("/")
    if len(value) > MAX_SUBTREE_CHARS or not all(_SUBTREE_PART.fullmatch(p) for p in parts):
        raise ValueError(f"must be a path of cgroup names (letters, digits, '.', '_', '-', '@', ':', '+'; "
                         f"no empty name, no '..', at most {MAX_SUBTREE_CHARS} characters); got {value!r}")
    return "/".join(parts)


class CgroupError(RuntimeError):
    """A cgroup operation that cannot be done; the message says what and why."""


class CgroupDriver(Protocol):
    kind: str
    """"v2" or "v1"."""
    mount: Path
    """Where the hierarchy that carries the freezer is mounted."""
    subtree: str
    """This daemon's own part of the hierarchy ("unisched"): its tenants' cgroups are created below it."""
    before_freeze: Callable[[str], None] | None
    """Called with a cgroup before each freeze; an OSError from it refuses the freeze (CgroupError)."""

    def tenant_cgroup(self, tenant: str) -> str: ...
    def create(self, cgroup: str) -> None: ...
    def exists(self, cgroup: str) -> bool: ...
    def remove(self, cgroup: str) -> None: ...
    def attach(self, cgroup: str, pid: int) -> None: ...
    def pids(self, cgroup: str) -> list[int]:
        """The processes in the cgroup and in the cgroups below it (an adopted pod's are in its containers')."""
        ...
    def cpu_usage_s(self, cgroup: str) -> float | None:
        """CPU seconds the cgroup used so far; None when the cgroup is gone. Read every slice for every tenant,
        so it is one small read (1000 tenants: 6 ms a slice, was 29 ms with a separate existence check)."""
        ...
    def set_frozen(self, cgroup: str, frozen: bool) -> None: ...
    def is_frozen(self, cgroup: str) -> bool: ...
    def cgroup_of(self, pid: int) -> str | None: ...
    def managed(self) -> list[str]: ...
    def normalize(self, path: str) -> str: ...


# A cgroup removed between a file's open and its read or write fails that call with ENODEV, not ENOENT
_GONE = (errno.ENOENT, errno.ENODEV)


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except PermissionError:
        raise CgroupError(f"permission denied writing {path}: run the daemon as root") from None
    except OSError as e:
        if e.errno == errno.ESRCH:
            return  # the process exited before it could be moved
        if e.errno in _GONE:
            raise CgroupError(f"{path.parent} does not exist (cgroup removed?)") from None
        raise CgroupError(f"cannot write {value!r} to {path}: {e.strerror}") from None


def canonical_cgroup(path: str, mount: Path) -> str:
    """One spelling per cgroup ("/a/b"): `//a/b/` and `a/b` name the same cgroup, so they must not become two
    tenants. An absolute path under `mount` is taken relative to it. '.', '..' and NUL are refused rather than
    resolved: a path that needs them is not one an operator means to hand the daemon."""
    if "\0" in path:
        raise CgroupError(f"cgroup path {path!r} contains a NUL byte")
    parts = [p for p in path.split("/") if p]
    under = list(mount.parts[1:])
    if path.startswith("/") and parts[: len(under)] == under:
        parts = parts[len(under):]
    if any(p in (".", "..") for p in parts) or not parts:
        raise CgroupError(f"cgroup path {path!r} must name a cgroup below {mount} (no '.' or '..')")
    return "/" + "/".join(parts)


def within(path: str, root: str) -> bool:
    """`path` is the cgroup `root` or below it (both canonical: "/a/b")."""
    return root == "/" or path == root or path.startswith(root + "/")


def adopt_refusal(path: str, subtree: str, daemon_cgroup: str | None, governed: Iterable[tuple[str, str]]) -> str | None:
    """Why a canonical cgroup path must not become a tenant, or None. Freezing a cgroup freezes everything below
    it: the parent of every tenant (`subtree`) or one holding the daemon would stop the scheduler itself, and a
    cgroup nested with a governed one would be frozen and thawed by two tenants' turns at once."""
    if within(subtree, path):
        return f"cgroup {path} holds every tenant this daemon creates ({subtree}); adopt a container's cgroup instead"
    if daemon_cgroup is not None and within(daemon_cgroup, path):
        return f"cgroup {path} contains the daemon itself ({daemon_cgroup}): freezing it would stop the scheduler"
    for name, cgroup in governed:
        if path == cgroup:
            return f"cgroup {path} is already tenant {name!r}"
        if within(path, cgroup) or within(cgroup, path):
            return f"cgroup {path} is nested with tenant {name!r}'s cgroup {cgroup}"
    return None


def _read_head(path: str) -> bytes | None:
    """The first bytes of a cgroup file (the counter the slice path needs comes first); None when it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.read(fd, 64)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in _GONE:
            return None
        raise


def _read_text(path: Path) -> str | None:
    """A whole cgroup file; None when the cgroup is gone."""
    try:
        return path.read_text()
    except OSError as e:
        if e.errno in _GONE:
            return None
        raise


def _read_pids(path: Path) -> list[int]:
    return [int(line) for line in (_read_text(path) or "").split()]


def _pids_below(top: Path) -> list[int]:
    """The processes of the cgroup at `top` and of those below it (MAX_CGROUPS_READ of them at most)."""
    return [pid for folder in folders_below(str(top), MAX_CGROUPS_READ) for pid in _read_pids(Path(folder, "cgroup.procs"))]


class _Common:
    kind: str
    mount: Path
    subtree: str
    before_freeze: Callable[[str], None] | None = None
    """Called with a cgroup before each freeze (the daemon records it there, enforce.governed); a failure refuses
    the freeze, so nothing is frozen that a crash could leave frozen for good."""

    def _note_freeze(self, cgroup: str) -> None:
        if self.before_freeze is not None:
            try:
                self.before_freeze(cgroup)
            except OSError as e:
                raise CgroupError(f"not freezing {cgroup}: {e}") from None

    def tenant_cgroup(self, tenant: str) -> str:
        return f"/{self.subtree}/{tenant}"

    def normalize(self, path: str) -> str:
        """An adoptable cgroup: absolute under the mount, or relative to it; never outside it."""
        resolved = canonical_cgroup(path, self.mount)
        if not (self.mount / resolved.lstrip("/")).is_dir():
            raise CgroupError(f"cgroup {path!r} does not exist under {self.mount}")
        return resolved

    def _dir(self, cgroup: str) -> Path:
        return self.mount / cgroup.lstrip("/")

    def managed(self) -> list[str]:
        """The cgroups directly below this daemon's subtree (its tenants', and any it left behind)."""
        base = self.mount / self.subtree
        if not base.is_dir():
            return []
        return sorted(f"/{self.subtree}/{p.name}" for p in base.iterdir() if p.is_dir())


class CgroupV2Driver(_Common):
    kind = "v2"

    def __init__(self, mount: Path, subtree: str = DEFAULT_SUBTREE) -> None:
        self.mount = mount
        self.subtree = check_subtree(subtree)

    def create(self, cgroup: str) -> None:
        d = self._dir(cgroup)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except PermissionError:
            raise CgroupError(f"permission denied creating {d}: run the daemon as root") from None
        if not (d / "cgroup.freeze").exists():
            raise CgroupError(f"{d} has no cgroup.freeze: this kernel's cgroup v2 cannot freeze")

    def exists(self, cgroup: str) -> bool:
        return self._dir(cgroup).is_dir()

    def remove(self, cgroup: str) -> None:
        try:
            self._dir(cgroup).rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CgroupError(f"cannot remove {self._dir(cgroup)}: {e.strerror}") from None

    def attach(self, cgroup: str, pid: int) -> None:
        _write(self._dir(cgroup) / "cgroup.procs", str(pid))

    def pids(self, cgroup: str) -> list[int]:
        return _pids_below(self._dir(cgroup))

    def cpu_usage_s(self, cgroup: str) -> float | None:
        # `_dir` as a string: per tenant per slice, pathlib's join costs about what the read does
        head = _read_head(f"{self.mount}/{cgroup.lstrip('/')}/cpu.stat")
        if head is None:
            return None
        key, _, value = head.split(b"\n", 1)[0].partition(b" ")
        return int(value) / 1e6 if key == b"usage_usec" else 0.0

    def set_frozen(self, cgroup: str, frozen: bool) -> None:
        if frozen:
            self._note_freeze(cgroup)
        _write(self._dir(cgroup) / "cgroup.freeze", "1" if frozen else "0")

    def is_frozen(self, cgroup: str) -> bool:
        return (_read_text(self._dir(cgroup) / "cgroup.freeze") or "").strip() == "1"

    def cgroup_of(self, pid: int) -> str | None:
        return _cgroup_of(pid, self.kind)


class CgroupV1Driver(_Common):
    """The v1 freezer, with CPU usage from cpuacct (hybrid hosts, such as CI's)."""

    kind = "v1"

    def __init__(self, mount: Path, cpuacct: Path | None, subtree: str = DEFAULT_SUBTREE) -> None:
        self.mount = mount
        self.cpuacct = cpuacct
        self.subtree = check_subtree(subtree)

    def _acct(self, cgroup: str) -> Path | None:
        return self.cpuacct / cgroup.lstrip("/") if self.cpuacct else None

    def create(self, cgroup: str) -> None:
        for d in (self._dir(cgroup), self._acct(cgroup)):
            if d is None:
                continue
            try:
                d.mkdir(parents=True, exist_ok=True)
            except PermissionError:
                raise CgroupError(f"permission denied creating {d}: run the daemon as root") from None

    def exists(self, cgroup: str) -> bool:
        return self._dir(cgroup).is_dir()

    def remove(self, cgroup: str) -> None:
        for d in (self._dir(cgroup), self._acct(cgroup)):
            if d is None:
                continue
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise CgroupError(f"cannot remove {d}: {e.strerror}") from None

    def attach(self, cgroup: str, pid: int) -> None:
        _write(self._dir(cgroup) / "cgroup.procs", str(pid))
        acct = self._acct(cgroup)
        if acct is not None and acct.is_dir():
            _write(acct / "cgroup.procs", str(pid))

    def pids(self, cgroup: str) -> list[int]:
        return _pids_below(self._dir(cgroup))

    def cpu_usage_s(self, cgroup: str) -> float | None:
        acct = self._acct(cgroup)
        head = _read_head(str(acct / "cpuacct.usage")) if acct is not None else None
        if head is None:  # no cpuacct hierarchy, or this group lacks it: the freezer's says whether it exists
            return 0.0 if self.exists(cgroup) else None
        try:
            return int(head) / 1e9
        except ValueError:
            return 0.0

    def set_frozen(self, cgroup: str, frozen: bool) -> None:
        if frozen:
            self._note_freeze(cgroup)
        _write(self._dir(cgroup) / "freezer.state", "FROZEN" if frozen else "THAWED")

    def is_frozen(self, cgroup: str) -> bool:
        state = _read_text(self._dir(cgroup) / "freezer.state")
        return state is not None and state.strip() != "THAWED"

    def cgroup_of(self, pid: int) -> str | None:
        return _cgroup_of(pid, self.kind)


def _cgroup_of(pid: int, kind: str) -> str | None:
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return path_in(text, kind)


def path_in(text: str, kind: str) -> str | None:
    """The cgroup a process's /proc/PID/cgroup `text` names in the hierarchy a driver of `kind` governs: the unified
    one's line on v2, the freezer's on v1."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if (hierarchy == "0" and controllers == "") if kind == "v2" else ("freezer" in controllers.split(",")):
            return path
    return None


def _mounts() -> list[tuple[str, Path, list[str]]]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        f = line.split()
        if len(f) >= 4:
            out.append((f[2], Path(f[1]), f[3].split(",")))
    return out


def _v2_can_freeze(mount: Path, subtree: str, create: bool = True) -> bool:
    probe = mount / subtree
    existed = probe.is_dir()
    if not create and not existed:  # (a root cgroup has no cgroup.freeze: ask an existing child)
        return any((c / "cgroup.freeze").exists() for c in mount.iterdir() if c.is_dir())
    try:
        probe.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    if (probe / "cgroup.freeze").exists():
        return True
    if not existed:  # this v2 cannot freeze: leave no empty subtree behind on it
        with contextlib.suppress(OSError):
            probe.rmdir()
    return False


def detect_driver(prefer: str = "auto", subtree: str = DEFAULT_SUBTREE, create: bool = True) -> CgroupDriver:
    """Pick the freezer at start: cgroup v2 where it can freeze, else the v1 freezer; clear errors.
    create=False (`serve --check-config`) decides without making the probe cgroup."""
    if prefer not in ("auto", "v2", "v1"):
        raise CgroupError(f"cgroup_driver must be one of auto, v2, v1; got {prefer!r}")
    try:
        subtree = check_subtree(subtree)
    except ValueError as e:
        raise CgroupError(f"cgroup_subtree {e}") from None
    if os.geteuid() != 0 and create:  # (create=False only looks: a config can be checked as any user)
        raise CgroupError("unisched serve must run as root to create and freeze cgroups")
    mounts = _mounts()
    if prefer in ("auto", "v2"):
        for fstype, path, _ in mounts:
            if fstype == "cgroup2" and _v2_can_freeze(path, subtree, create):
                return CgroupV2Driver(path, subtree)
        if prefer == "v2":
            raise CgroupError("no cgroup v2 hierarchy with cgroup.freeze is mounted")
    freezer = next((p for t, p, o in mounts if t == "cgroup" and "freezer" in o), None)
    cpuacct = next((p for t, p, o in mounts if t == "cgroup" and "cpuacct" in o), None)
    if freezer is None:
        raise CgroupError("no freezer found: need cgroup v2 with cgroup.freeze (Linux >= 5.2) or the v1 freezer controller")
    return CgroupV1Driver(freezer, cpuacct, subtree)


@dataclass
class _FakeGroup:
    pids: list[int] = field(default_factory=list)
    cpu_s: float = 0.0
    frozen: bool = False


class FakeCgroupDriver:
    """In-memory cgroups for engine logic tests: tests set CPU usage and see freeze calls."""

    kind = "fake"
    mount = Path("/fake")

    def __init__(self, subtree: str = DEFAULT_SUBTREE) -> None:
        self.subtree = check_subtree(subtree)
        self.before_freeze: Callable[[str], None] | None = None
        self.groups: dict[str, _FakeGroup] = {}
        self.freeze_log: list[tuple[str, bool]] = []
        self.pid_cgroup: dict[int, str] = {}

    def tenant_cgroup(self, tenant: str) -> str:
        return f"/{self.subtree}/{tenant}"

    def normalize(self, path: str) -> str:
        p = canonical_cgroup(path, self.mount)
        if p not in self.groups:
            raise CgroupError(f"cgroup {path!r} does not exist under {self.mount}")
        return p

    def create(self, cgroup: str) -> None:
        self.groups.setdefault(cgroup, _FakeGroup())

    def exists(self, cgroup: str) -> bool:
        return cgroup in self.groups

    def remove(self, cgroup: str) -> None:
        self.groups.pop(cgroup, None)

    def attach(self, cgroup: str, pid: int) -> None:
        if cgroup not in self.groups:
            raise CgroupError(f"{cgroup} does not exist")
        self.groups[cgroup].pids.append(pid)
        self.pid_cgroup[pid] = cgroup

    def pids(self, cgroup: str) -> list[int]:
        below = f"{cgroup.rstrip('/')}/"
        return [pid for name, g in sorted(self.groups.items()) if name == cgroup or name.startswith(below)
                for pid in g.pids]

    def cpu_usage_s(self, cgroup: str) -> float | None:
        g = self.groups.get(cgroup)
        return g.cpu_s if g else None

    def set_frozen(self, cgroup: str, frozen: bool) -> None:
        if cgroup not in self.groups:
            raise CgroupError(f"{cgroup} does not exist (cgroup removed?)")
        if frozen and self.before_freeze is not None:
            self.before_freeze(cgroup)
        self.groups[cgroup].frozen = frozen
        self.freeze_log.append((cgroup, frozen))

    def is_frozen(self, cgroup: str) -> bool:
        g = self.groups.get(cgroup)
        return bool(g and g.frozen)

    def cgroup_of(self, pid: int) -> str | None:
        return self.pid_cgroup.get(pid)

    def managed(self) -> list[str]:
        base = f"/{self.subtree}/"
        return sorted(c for c in self.groups if c.startswith(base) and "/" not in c[len(base):])


def cgroup_mount_problem(mount: Path) -> str | None:
    """Why `mount` is not a mounted cgroup (v1 or v2) filesystem now, or None (the daemon's readiness probe)."""
    try:
        mounts = _mounts()
    except OSError as e:
        return f"cannot read /proc/self/mounts: {e.strerror or e}"
    if any(fstype in ("cgroup", "cgroup2") and path == mount for fstype, path, _ in mounts):
        return None
    return f"{mount} is not a mounted cgroup filesystem"
