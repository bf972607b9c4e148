"""Who a book kept per caller counts a caller as: a uid, or the pod it runs in.

Root in a pod without a user namespace of its own keeps CAP_SETUID and may take any uid but 0, and uid 1000 in a
pod is the same number as the host's uid 1000. A book that bounds callers by uid would let one pod take many
users' room, or the room of the host user whose uid its process runs as. So every book kept per caller (the
front door's connections, the seccomp agent's hand-overs and hooked listeners, registration turns and cgroup
moves, lease overrun records, throttled log lines) keys on a `Caller`; the transport says which one a connection
is (transport.identity.PeerCred.caller)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Caller", "Pod", "named"]


@dataclass(frozen=True)
class Pod:
    """All the processes of one pod, counted as one caller whatever uids they run as."""

    pidns: int
    """The inode of the pid namespace just below the daemon's that holds them (0: a caller gone before it was read,
    all such callers counted as one)."""

    def __str__(self) -> str:
        return f"pod (pid namespace {self.pidns})"


Caller = int | Pod
"""A caller as the books count it: a uid (negative ones are the transport's: root outside the daemon's namespaces,
a caller without credentials), or a pod."""


def named(caller: Caller) -> str:
    """How a caller is named in refusals: its uid, or its pod; a negative uid stands for root outside the daemon's
    namespaces (root in a container), counted as one user."""
    if isinstance(caller, Pod):
        return str(caller)
    return f"uid {caller}" if caller >= 0 else "root in a container"
