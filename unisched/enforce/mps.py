"""MPS, the mechanism that lets the GPU's block dispatcher put one tenant's kernels before another's.

One small Protocol, `MpsControl` (start or join a control daemon, say how it is, quit it), with the real
`NvidiaMpsControl`, which drives `nvidia-cuda-mps-control` on a pipe directory of the daemon's own, and
`FakeMpsControl` beside it for engine logic tests. Which client gets what priority and SM cap is policy
(`unisched.policy.mps`); a client takes its settings from the environment it starts with, which `unisched run`
gets from the daemon's answer to its registration.

Lifetime: the MPS control daemon is a process of its own. It outlives a crashed unisched, and a restarted one joins
it on the same pipe directory (its clients keep running). On a clean stop unisched asks it to quit: it then takes no
new clients and exits once its current ones are done. MPS serves one user at a time: clients of another uid wait
until the running server's clients are done (NVIDIA's documented behaviour).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["MPS_CONTROL", "FakeMpsControl", "MpsControl", "MpsError", "MpsStatus", "NvidiaMpsControl",
           "mps_unavailable_reason"]

MPS_CONTROL = "nvidia-cuda-mps-control"
COMMAND_TIMEOUT_S = 10.0


class MpsError(RuntimeError):
    """The MPS control daemon could not be started or asked; the message carries its own words."""


@dataclass(frozen=True)
class MpsStatus:
    pipe_dir: str
    running: bool
    servers: tuple[int, ...] = ()
    """PIDs of the MPS servers (one per user with clients)."""
    joined: bool = False
    """Found running on the pipe directory at start (left by an earlier daemon), not started by this one."""


class MpsControl(Protocol):
    @property
    def pipe_dir(self) -> str:
        """CUDA_MPS_PIPE_DIRECTORY of the clients."""
        ...

    def start(self) -> MpsStatus:
        """Start the control daemon, or join the one already on the pipe directory. Raises MpsError."""
        ...

    def status(self) -> MpsStatus:
        ...

    def stop(self) -> None:
        """Ask the control daemon to quit (it lets its current clients finish). Never raises."""
        ...


def mps_unavailable_reason(binary: str = MPS_CONTROL) -> str | None:
    """Why MPS cannot be started here, or None when the control program is at hand."""
    if shutil.which(binary) is None:
        return f"{binary} not found on PATH (it ships with the NVIDIA driver's utilities, e.g. nvidia-utils)"
    return None


class NvidiaMpsControl:
    def __init__(self, pipe_dir: str | Path, log_dir: str | Path, binary: str = MPS_CONTROL) -> None:
        self._pipe = Path(pipe_dir)
        self._logs = Path(log_dir)
        self._binary = binary
        self._joined = False

    @property
    def pipe_dir(self) -> str:
        return str(self._pipe)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self._pipe), "CUDA_MPS_LOG_DIRECTORY": str(self._logs)}

    def _run(self, what: str, args: tuple[str, ...] = (), command: str | None = None) -> str:
        """The control program with `args`, or asked `command` on its stdin; its stdout. Raises MpsError with
        its own words (`what` names the call in them)."""
        try:
            done = subprocess.run([self._binary, *args], input=None if command is None else command + "\n",
                                  env=self._env(), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"{self._binary} {what}: {e}") from None
        if done.returncode != 0:
            raise MpsError(f"{self._binary} {what} exited {done.returncode}: {(done.stderr or done.stdout).strip()[-400:]}")
        return done.stdout

    def _ask(self, command: str) -> str:
        return self._run(f"({command})", command=command)

    def _servers(self) -> tuple[int, ...] | None:
        """The server PIDs, or None when no control daemon answers on the pipe directory."""
        if not (self._pipe / "control").exists():
            return None
        try:
            out = self._ask("get_server_list")
        except MpsError:
            return None
        return tuple(int(w) for w in out.split() if w.isdigit())

    def start(self) -> MpsStatus:
        reason = mps_unavailable_reason(self._binary)
        if reason is not None:
            raise MpsError(reason)
        if self._servers() is not None:
            self._joined = True
            return self.status()
        for d in (self._pipe, self._logs):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise MpsError(f"cannot create {d}: {e.strerror or e}") from None
        try:
            self._run("-d", ("-d",))
        except MpsError as e:
            raise MpsError(f"{e} (logs in {self._logs})") from None
        self._joined = False
        return self.status()

    def status(self) -> MpsStatus:
        servers = self._servers()
        return MpsStatus(str(self._pipe), servers is not None, servers or (), self._joined)

    def stop(self) -> None:
        if self._servers() is None:
            return
        with contextlib.suppress(MpsError):  # gone meanwhile: nothing to stop
            self._ask("quit")


class FakeMpsControl:
    def __init__(self, pipe_dir: str = "/run/fake-mps", fail: str | None = None) -> None:
        self._pipe = pipe_dir
        self.fail = fail
        """Set: start raises MpsError with this message."""
        self.running = False
        self.starts = 0
        self.stops = 0

    @property
    def pipe_dir(self) -> str:
        return self._pipe

    def start(self) -> MpsStatus:
        if self.fail is not None:
            raise MpsError(self.fail)
        self.running = True
        self.starts += 1
        return self.status()

    def status(self) -> MpsStatus:
        return MpsStatus(self._pipe, self.running)

    def stop(self) -> None:
        if self.running:
            self.stops += 1
        self.running = False
