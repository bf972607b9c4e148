"""The tenant's side of the hand-over: give the filter's listener to the daemon's agent socket.

`unisched run`'s trampoline runs it in each new tenant process, so it imports the standard library only (no
structlog, asyncio or grpc): a burst of runs is paid in CPU time per import. The message is the OCI runtimes'
(runtime-spec ContainerProcessState), so the daemon reads runs' and containers' hand-overs alike (agent.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Final

from unisched.enforce.seccomp.abi import SeccompError

DEFAULT_LISTENER_PATH: Final = "/run/unisched/seccomp-agent.sock"
"""Where the daemon's agent socket for runs listens by default (`agent_socket`; container runtimes hand over on
`runtime_agent_socket`, which deploy/seccomp/unisched-gpu.json names)."""


def send_fd(sock: socket.socket, fd: int, payload: bytes) -> None:
    """Send `payload` with `fd` attached (SCM_RIGHTS on the first sendmsg, as the OCI runtimes do)."""
    if not payload:
        raise ValueError("send_fd needs a non-empty payload (an fd cannot travel alone)")
    sent = socket.send_fds(sock, [payload], [fd])
    if sent < len(payload):
        sock.sendall(payload[sent:])


def make_agent_message(pid: int, *, metadata: str = "", container_id: str = "", status: str = "running") -> bytes:
    """The same message shape for `unisched run`'s child as the OCI runtimes send, so one reader serves both."""
    return json.dumps(
        {
            "ociVersion": "1.1.0",
            "fds": ["seccompFd"],
            "pid": pid,
            "metadata": metadata,
            "state": {"ociVersion": "1.1.0", "id": container_id, "status": status, "pid": pid, "bundle": "", "annotations": {}},
        },
        separators=(",", ":"),
    ).encode()


HAND_OVER_TIMEOUT_S: Final = 30.0
"""How long `hand_over` keeps trying. The trampoline runs in its tenant's cgroup, which the daemon's time slicing
may freeze between its connect and its send: with a hundred tenants in demand its turn comes round every few
seconds, the daemon drops the late attempt at its own deadline and answers "busy", and the next attempt, once
thawed, takes microseconds. A dead daemon still fails at once (the connect is refused)."""
_BUSY_RETRY_S: Final = (0.02, 0.5)
"""`hand_over`'s pause after a "busy" reply: first, and the most it doubles to (a burst of runs by one user
clears in milliseconds; a flood by that user lasts until the deadline)."""


def hand_over(
    listener_fd: int, path: str = DEFAULT_LISTENER_PATH, *, metadata: str = "", timeout: float = HAND_OVER_TIMEOUT_S,
    close: bool = True,
) -> None:
    """`unisched run`'s child side: give the listener to the daemon's agent socket and wait for its "ok".

    Sends the OCI-shaped message (pid = this process) with the fd, then closes the fd here (`close`): the
    tenant must not keep its own listener, or a notified call would wait for itself, and the daemon's death
    would no longer fail calls with ENOSYS. A "busy" reply (too many of this uid's hand-overs in progress, or this
    one was not complete by the daemon's deadline: frozen or preempted in between) is tried again within
    `timeout`. Raises SeccompError when the daemon is unreachable or says no; the caller should then exit rather
    than exec (the tenant's GPU session calls would all fail with ENOSYS).
    """
    deadline = time.monotonic() + timeout
    pause = _BUSY_RETRY_S[0]
    try:
        while True:
            answer = _hand_over_once(listener_fd, path, metadata, max(0.01, deadline - time.monotonic()))
            if not answer.startswith("busy ") or time.monotonic() + pause >= deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, _BUSY_RETRY_S[1])
    finally:
        if close:
            os.close(listener_fd)
    if answer != "ok":
        raise SeccompError(f"the unisched daemon refused the GPU session hook: {answer or 'connection closed'}")


def _hand_over_once(listener_fd: int, path: str, metadata: str, timeout: float) -> str:
    message = make_agent_message(os.getpid(), metadata=metadata)  # before connecting: the daemon's deadline runs
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(path)
            except OSError as e:
                raise SeccompError(f"cannot reach the unisched agent socket {path}: {e.strerror}") from None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused at once: read its reply
                send_fd(sock, listener_fd, message)
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except TimeoutError:
        raise SeccompError(f"the unisched daemon did not answer on {path} within {timeout:.3g}s") from None
    except OSError as e:
        raise SeccompError(f"handing the GPU session hook to {path} failed: {e.strerror or e}") from None
    return reply.decode(errors="replace").strip()
