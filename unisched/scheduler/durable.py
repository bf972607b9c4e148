"""Replacing a small file so that a reader, or a crash midway, sees the old file or the new one, never part of one.

The one way the daemon and its commands write a file they read back later (state.json, contention.json, the list of
session hooks carried across a restart): a new temporary file of this write's own, fsync'ed, renamed over the old,
and the directory fsync'ed so that the rename itself survives a crash.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

__all__ = ["replace_durably"]


def replace_durably(path: Path, body: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `body`, readable as `mode` says (exactly: the umask does not narrow it). The temporary
    file is new and this call's own (O_EXCL, never opened through a link), so two writers in containers that are
    both pid 1 cannot write into one. Callers make the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
