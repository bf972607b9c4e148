"""What a daemon may freeze, kept where neither its config nor its state file can lose it.

A running daemon keeps one record file, `<dir>/<id>.list`, flock'ed for its whole life: first the line
`subtree /<its subtree>`, then `adopted /<path>` for each cgroup outside its subtree, written before it first
freezes that cgroup. A daemon killed while a tenant is frozen leaves its record unlocked; the first thing the
next `unisched serve` does, before it reads a config or a state file, is thaw every cgroup such records name
(recursively below a subtree) and delete them. So a restart that then fails (a bad config, a corrupt state file)
still leaves nothing frozen.

The directory does not come from the config (a bad config must not hide it): /var/lib/unisched/governed, or
$UNISCHED_GOVERNED_DIR (tests, a second instance). Records are read as untrusted text: bad lines are skipped,
paths with '..' refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from unisched.enforce.cgtree import folders_below

__all__ = [
    "GOVERNED_DIR",
    "GOVERNED_DIR_ENV",
    "LEGACY_GOVERNED_DIR",
    "GovernedRecord",
    "Orphans",
    "RecordError",
    "governed_dir",
    "live_subtrees",
    "orphan_dirs",
    "parse_record",
    "thaw_orphans",
]

GOVERNED_DIR = "/var/lib/unisched/governed"
"""Below the default state directory, which only root reads (the systemd unit's StateDirectory, the DaemonSet's
state volume). Not in /run/unisched: systemd removes a unit's RuntimeDirectory whenever the unit stops, a crash
before its automatic restart included, which would lose the record exactly when it is needed; and pods get
/run/unisched mounted for the daemon's sockets, where the records (node cgroups, pod UIDs) are not theirs to read.
Records outlive a reboot: the first start after one finds only cgroups that are gone, and thaws nothing."""
LEGACY_GOVERNED_DIR = "/run/unisched/governed"
"""Where records were kept before: the orphan thaw reads it too, so a daemon that died before an upgrade leaves
nothing frozen after it."""
GOVERNED_DIR_ENV = "UNISCHED_GOVERNED_DIR"
MAX_RECORD_BYTES = 4 << 20
"""A record holds one line per adopted cgroup (a few hundred bytes each): 4 MiB is ten thousand adoptions and
more; a bigger file is not ours to read whole."""
MAX_THAW_CGROUPS = 100_000
"""Bound on the cgroups one orphan thaw visits below a subtree (a host has far fewer): a runaway tree must not
stall the start."""
_SUFFIX = ".list"


class RecordError(OSError):
    """The record of what this daemon governs cannot be kept; the message says where and why."""


def governed_dir() -> Path:
    return Path(os.environ.get(GOVERNED_DIR_ENV) or GOVERNED_DIR)


def orphan_dirs() -> tuple[Path, ...]:
    """Where a dead daemon's record may be: governed_dir(), and LEGACY_GOVERNED_DIR unless the environment names
    the directory (tests, a second instance: theirs alone)."""
    if os.environ.get(GOVERNED_DIR_ENV):
        return (governed_dir(),)
    return governed_dir(), Path(LEGACY_GOVERNED_DIR)


@dataclass(frozen=True)
class Governed:
    """What one record names: subtrees (thawed with all below them) and single adopted cgroups."""

    subtrees: tuple[str, ...] = ()
    adopted: tuple[str, ...] = ()


def _clean(path: str) -> str | None:
    """An absolute cgroup path below the root, without '..', '.', empty names or control characters."""
    if not path.startswith("/") or any(ord(c) < 32 for c in path):
        return None
    parts = path.strip("/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        return None
    return "/" + "/".join(parts)


def parse_record(text: str) -> tuple[Governed, list[str]]:
    """The entries of a record and, for each line skipped, why (records are read after a crash: any garbage)."""
    subtrees: list[str] = []
    adopted: list[str] = []
    skipped: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        kind, _, path = line.partition(" ")
        clean = _clean(path)
        if kind not in ("subtree", "adopted") or clean is None:
            skipped.append(f"line {n}: not 'subtree /PATH' or 'adopted /PATH' below the cgroup root: {line[:80]!r}")
            continue
        (subtrees if kind == "subtree" else adopted).append(clean)
    return Governed(tuple(dict.fromkeys(subtrees)), tuple(dict.fromkeys(adopted))), skipped


def _freezer_mounts() -> list[tuple[str, Path]]:
    """("v2" | "v1", mount) of every hierarchy that can freeze, read from /proc/self/mounts."""
    out: list[tuple[str, Path]] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            f = line.split()
            if len(f) >= 4 and f[2] == "cgroup2":
                out.append(("v2", Path(f[1])))
            elif len(f) >= 4 and f[2] == "cgroup" and "freezer" in f[3].split(","):
                out.append(("v1", Path(f[1])))
    return out


def _thaw_dir(kind: str, d: Path) -> bool:
    """Thaw one cgroup directory; True when it was frozen."""
    name, thawed = ("cgroup.freeze", "0") if kind == "v2" else ("freezer.state", "THAWED")
    try:
        state = (d / name).read_text().strip()
    except OSError:
        return False
    if state in ("0", "THAWED"):
        return False
    (d / name).write_text(thawed)
    return True


def _below(d: Path, budget: list[int]) -> Iterator[Path]:
    """`d` and the directories below it, parents first, at most MAX_THAW_CGROUPS all told."""
    for top in folders_below(str(d), budget[0]):
        budget[0] -= 1
        yield Path(top)


@dataclass(frozen=True)
class Orphans:
    """What the orphan thaw did: cgroups it found frozen and thawed, records it removed, and what went wrong."""

    thawed: tuple[str, ...] = ()
    records: int = 0
    problems: tuple[str, ...] = ()


def _thaw(governed: Governed, mounts: list[tuple[str, Path]], problems: list[str]) -> list[str]:
    thawed: list[str] = []
    budget = [MAX_THAW_CGROUPS]
    for kind, mount in mounts:
        targets = [(p, True) for p in governed.subtrees] + [(p, False) for p in governed.adopted]
        for path, recursive in targets:
            top = mount / path.lstrip("/")
            if not top.is_dir():
                continue
            for d in _below(top, budget) if recursive else iter((top,)):
                try:
                    if _thaw_dir(kind, d):
                        thawed.append("/" + str(d.relative_to(mount)))
                except OSError as e:
                    problems.append(f"cannot thaw {d}: {e.strerror or e}")
    return thawed


def _untrusted(directory: Path) -> str | None:
    """Why records there must not be acted on (another user could write them), or None. Missing: nothing to do."""
    try:
        st = directory.lstat()
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{directory}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return f"{directory}: not a directory of ours that only we can write; its records are ignored"
    return None


def _records(directory: Path) -> list[Path]:
    if _untrusted(directory) is not None:
        return []
    try:
        return sorted(p for p in directory.iterdir() if p.name.endswith(_SUFFIX) and p.is_file())
    except OSError:
        return []


def _read_locked(path: Path) -> tuple[int, str] | None:
    """Open a record and take its lock; None when its daemon still holds it (or it is gone)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise PermissionError
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd, os.pread(fd, MAX_RECORD_BYTES, 0).decode(errors="replace")


def thaw_orphans(directories: Sequence[Path] | None = None) -> Orphans:
    """Thaw what every daemon that is gone may have left frozen, and delete its record (in `directories`, default
    `orphan_dirs()`). Never raises: it runs first on every start, before anything that could fail."""
    directories = orphan_dirs() if directories is None else directories
    mounts = _freezer_mounts()
    thawed: list[str] = []
    problems: list[str] = [why for d in directories if (why := _untrusted(d))]
    removed = 0
    for path in (p for d in directories for p in _records(d)):
        opened = _read_locked(path)
        if opened is None:
            continue
        fd, text = opened
        try:
            governed, skipped = parse_record(text)
            problems += [f"{path}: {why}" for why in skipped]
            thawed += _thaw(governed, mounts, problems)
            with contextlib.suppress(FileNotFoundError):  # another starter removed it first
                path.unlink()
            removed += 1
        except OSError as e:
            problems.append(f"{path}: {e.strerror or e}")
        finally:
            os.close(fd)
    return Orphans(tuple(dict.fromkeys(thawed)), removed, tuple(problems))


def live_subtrees(directory: Path | None = None) -> list[tuple[Path, str]]:
    """(record, subtree) of every daemon alive now (its record locked)."""
    out: list[tuple[Path, str]] = []
    for path in _records(directory or governed_dir()):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:  # held: its daemon lives
                text = os.pread(fd, MAX_RECORD_BYTES, 0).decode(errors="replace")
                out += [(path, s) for s in parse_record(text)[0].subtrees]
        finally:
            os.close(fd)
    return out


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


class GovernedRecord:
    """This daemon's record, locked for its life. Created under a hidden name, locked, then renamed into place,
    so no starter ever sees it unlocked."""

    def __init__(self, directory: Path, subtree: str) -> None:
        self.subtree = "/" + subtree.strip("/")
        self.path = directory / f"{uuid.uuid4().hex}{_SUFFIX}"
        self._noted: set[str] = set()
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise RecordError(f"cannot keep the record of governed cgroups in {directory}: {e.strerror or e}") from None
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)  # one starter at a time checks for overlap and adds its record
            self._check_overlap(directory)
            tmp = directory / f".{self.path.name}.tmp"
            self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(self._fd, f"subtree {self.subtree}\n".encode())
            os.rename(tmp, self.path)
        except RecordError:
            raise
        except OSError as e:
            raise RecordError(f"cannot keep the record of governed cgroups in {directory}: {e.strerror or e}") from None
        finally:
            os.close(dir_fd)  # closing drops the directory lock

    def _check_overlap(self, directory: Path) -> None:
        for other, subtree in live_subtrees(directory):
            if _nested(subtree, self.subtree):
                raise RecordError(f"cgroup subtree {self.subtree} overlaps {subtree}, which a running daemon governs "
                                  f"(its record {other}); give each daemon its own cgroup_subtree")

    def note(self, cgroup: str) -> None:
        """Before a cgroup outside the subtree is first frozen: name it, so a crash cannot leave it frozen."""
        if cgroup in self._noted or cgroup == self.subtree or cgroup.startswith(self.subtree + "/"):
            return
        clean = _clean(cgroup)
        if clean is None:
            raise RecordError(f"cgroup path {cgroup!r} cannot be recorded")
        os.write(self._fd, f"adopted {clean}\n".encode())
        self._noted.add(cgroup)

    def close(self) -> None:
        """On a clean stop, after everything was thawed: the record is no longer needed."""
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            os.close(self._fd)
