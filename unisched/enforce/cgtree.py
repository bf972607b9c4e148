"""Walking a cgroup and the cgroups below it, bounded: a tenant with a delegated cgroup makes what it likes there.

Iterative (a chain a thousand levels deep does not exhaust Python's recursion, as os.walk does before 3.12), never
following symbolic links, a directory that vanishes or cannot be read skipped, and at most `most` directories
looked at.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Final

__all__ = ["MAX_CGROUPS_READ", "folders_below"]

MAX_CGROUPS_READ: Final = 4096
"""Cgroups at most read for one tenant's processes (its own and those below it: a pod's containers sit below the
pod's cgroup). A pod has a few; past this a delegated tenant's own processes below are not all seen, which only
that tenant's figures (its memory, its processes on the GPU) miss."""


def folders_below(top: str, most: int) -> Iterator[str]:
    """`top` and the directories below it, parents first (siblings in name order), `most` at most."""
    stack, looked = [top], 0
    while stack and looked < most:
        folder = stack.pop()
        looked += 1
        yield folder
        try:
            with os.scandir(folder) as entries:
                below = sorted(e.path for e in entries if e.is_dir(follow_symlinks=False))
        except OSError:
            continue  # removed meanwhile, or not readable
        stack.extend(reversed(below))
