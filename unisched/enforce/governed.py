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
"""The records' directory of older versions: the orphan thaw reads it too, so a daemon of such a version that
died before an upgrade leaves nothing frozen after it."""
GOVERNED_DIR_ENV = "UNISCHED_GOVERNED_DIR"
MAX_RECORD_BYTES = 4 << 20
"""A record holds one line per adopted cgroup (a few hundred bytes each): 4 MiB is ten thousand adoptions and
more; a bigger file is not ours to read whole (its tail is reported unread and the record kept)."""
COMPACT_RECORD_BYTES = 256 << 10
"""A live record past this many bytes is rewritten with only the adopted cgroups that still exist (a node's pods
come and go: appended for ever, a record would pass MAX_RECORD_BYTES in weeks of pod churn), and again each time it
has doubled since."""
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


def _below(d: Path, budget: list[int], problems: list[str]) -> Iterator[Path]:
    """`d` and the directories below it, parents first, at most MAX_THAW_CGROUPS all told (a problem past that)."""
    for top in folders_below(str(d), budget[0]):
        budget[0] -= 1
        yield Path(top)
    if budget[0] <= 0:
        problems.append(f"{d}: more than {MAX_THAW_CGROUPS} cgroups; those past them were not thawed")


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
            for d in _below(top, budget, problems) if recursive else iter((top,)):
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


def _read_locked(path: Path) -> tuple[int, str, bool] | None:
    """Open a record and take its lock: (fd, its text, whether all of it was read). None when its daemon still holds
    it, or it is gone, or its name now names another file (its daemon rewrote it meanwhile: _compact)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise FileNotFoundError
    except OSError:
        os.close(fd)
        return None
    data = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
    whole = len(data) <= MAX_RECORD_BYTES
    return fd, data[:MAX_RECORD_BYTES].decode(errors="replace"), whole


def thaw_orphans(directories: Sequence[Path] | None = None,
                 mounts: Sequence[tuple[str, Path]] | None = None) -> Orphans:
    """Thaw what every daemon that is gone may have left frozen, and delete its record (in `directories`, default
    `orphan_dirs()`; `mounts`: the freezer hierarchies, default this host's). A record whose thaw met a problem is
    kept, so the next start tries again. Never raises: it runs first on every start, before anything that could
    fail."""
    directories = orphan_dirs() if directories is None else directories
    mounts = _freezer_mounts() if mounts is None else list(mounts)
    thawed: list[str] = []
    problems: list[str] = [why for d in directories if (why := _untrusted(d))]
    removed = 0
    for path in (p for d in directories for p in _records(d)):
        opened = _read_locked(path)
        if opened is None:
            continue
        fd, text, whole = opened
        try:
            governed, skipped = parse_record(text)
            problems += [f"{path}: {why}" for why in skipped]
            failed: list[str] = [] if whole else [f"{path}: larger than {MAX_RECORD_BYTES} bytes; its tail was not "
                                                  "read, and it is kept"]
            thawed += _thaw(governed, mounts, failed)
            problems += failed
            if failed:
                continue  # kept: the next start tries again
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
        self._directory = directory
        self._noted: set[str] = set()
        self._bytes = 0
        self._compact_at = COMPACT_RECORD_BYTES
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise RecordError(f"cannot keep the record of governed cgroups in {directory}: {e.strerror or e}") from None
        try:
            st = os.fstat(dir_fd)
            if st.st_uid != os.geteuid():  # the next start would ignore a record there (_untrusted): no safety net
                raise RecordError(f"{directory} is not owned by this daemon's user: the record of governed cgroups "
                                  "kept there would be ignored after a crash; remove it or choose another")
            if st.st_mode & 0o022:
                os.fchmod(dir_fd, stat.S_IMODE(st.st_mode) & ~0o022)
        except OSError as e:
            os.close(dir_fd)
            raise RecordError(f"cannot keep the record of governed cgroups in {directory}: {e.strerror or e}") from None
        except RecordError:
            os.close(dir_fd)
            raise
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)  # one starter at a time checks for overlap and adds its record
            self._check_overlap(directory)
            self._fd = self._write_locked([])
        except RecordError:
            raise
        except OSError as e:
            raise RecordError(f"cannot keep the record of governed cgroups in {directory}: {e.strerror or e}") from None
        finally:
            os.close(dir_fd)  # closing drops the directory lock

    def _write_locked(self, adopted: Sequence[str]) -> int:
        """A new file with the subtree and `adopted`, locked, then renamed over the record: the name always names a
        locked record of everything this daemon may have frozen. Its fd; OSError as it comes."""
        tmp = self._directory / f".{self.path.name}.tmp"
        text = f"subtree {self.subtree}\n" + "".join(f"adopted {a}\n" for a in adopted)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, text.encode())
            os.rename(tmp, self.path)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._bytes = len(text)
        return fd

    def _compact(self) -> None:
        """Rewrite the record with the adopted cgroups that still exist on some freezer hierarchy (one that is gone
        cannot be frozen). Kept as it is when that fails: it only grows."""
        mounts = _freezer_mounts()
        live = sorted(c for c in self._noted if any((m / c.lstrip("/")).is_dir() for _, m in mounts))
        try:
            fd = self._write_locked(live)
        except OSError:
            self._compact_at *= 2
            return
        os.close(self._fd)  # the old file, renamed over: a starter that waited on its lock finds it gone
        self._fd = fd
        self._noted = set(live)
        self._compact_at = max(COMPACT_RECORD_BYTES, 2 * self._bytes)

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
        if clean != cgroup:
            self.note(clean)
            return
        if self._bytes > self._compact_at:
            self._compact()
        line = f"adopted {clean}\n".encode()
        os.write(self._fd, line)
        self._bytes += len(line)
        self._noted.add(clean)

    def close(self, keep: bool = False) -> None:
        """On a stop: unlocked, and removed when everything was thawed (`keep`: something may still be frozen, and
        the next start thaws what the record names)."""
        if not keep:
            with contextlib.suppress(OSError):
                self.path.unlink()
        with contextlib.suppress(OSError):
            os.close(self._fd)
