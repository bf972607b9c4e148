"""The daemon's configuration against this host, after parsing and before anything starts: the groups, places,
GPUs and cgroups it names must exist and be usable, or the start stops with a ConfigError that names the key."""

from __future__ import annotations

import grp
import os
import posixpath
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from unisched.enforce.cgroups import CgroupDriver, CgroupError, adopt_refusal
from unisched.scheduler.config import ConfigError, DaemonConfig

__all__ = ["PATH_KEYS", "check_declared_cgroups", "check_gpus", "check_groups", "check_places"]


def check_groups(config: DaemonConfig) -> list[str]:
    """socket_group must exist (the socket could not be given to it). A missing admin_group only narrows who is
    admin to root, as deploy/unisched.toml documents: returned as a warning."""
    warnings = []
    for key in ("socket_group", "admin_group"):
        group = getattr(config, key)
        if group is None:
            continue
        try:
            grp.getgrnam(group)
        except KeyError:
            if key == "socket_group":
                raise ConfigError(f"config 'socket_group': group {group!r} does not exist (create it, e.g. with "
                                  "deploy/sysusers.d/unisched.conf, or unset socket_group)") from None
            warnings.append(f"admin_group {group!r} does not exist: only root will be admin")
    return warnings


PATH_KEYS: Final = ("socket", "lease_socket", "agent_socket", "runtime_agent_socket", "state_dir")
"""Where the daemon makes its sockets and keeps its state: absolute (systemd starts it in /), below a directory."""


def check_places(config: DaemonConfig) -> None:
    """Each of PATH_KEYS absolute, its nearest existing ancestor a directory; the metrics' and TCP listener's hosts
    resolvable. A start would otherwise fail half-way with a bare errno (exit 1: restarted by systemd for ever)."""
    for key in PATH_KEYS:
        path = Path(getattr(config, key))
        if not path.is_absolute():
            raise ConfigError(f"config {key!r}: must be an absolute path; got {str(path)!r}")
        start = path if key == "state_dir" else path.parent  # a socket's file may be there already (stale)
        above = next((p for p in (start, *start.parents) if p.exists()), Path("/"))
        if not above.is_dir():
            raise ConfigError(f"config {key!r}: {above} is not a directory, so {path} cannot be made")
    _check_runtime_directory(config)
    hosts = [("listen", config.listen.rpartition(":")[0])] if config.listen else []
    if config.metrics_port:
        hosts.append(("metrics_listen", config.metrics_listen))
    for key, host in hosts:
        try:
            socket.getaddrinfo(host.strip("[]"), None)
        except (OSError, UnicodeError) as e:
            raise ConfigError(f"config {key!r}: cannot resolve {host!r}: {getattr(e, 'strerror', None) or e}") from None


def _check_runtime_directory(config: DaemonConfig) -> None:
    """runtime_agent_socket's directory is made root's alone (0700) and must be in no pod, while every tenant
    reaches the other sockets' directories and pods get them mounted: the two may not nest either way, compared
    as the paths lead (links and '..' followed). Nor is it made at the filesystem's root, where a socket directly in
    /run or /tmp would put the directory beside its own (/run-runtime)."""
    own = _leads_to(Path(config.runtime_agent_socket).parent)
    for key in ("socket", "lease_socket", "agent_socket"):
        theirs = _leads_to(Path(getattr(config, key)).parent)
        if own == theirs or own in theirs.parents or theirs in own.parents:
            raise ConfigError(f"config 'runtime_agent_socket': its directory {own} nests with {theirs}, where {key} "
                              "is: it is made root's alone (0700) and kept out of pods, which get that one mounted; "
                              "give it a directory of its own")
    if own.parent == Path("/"):  # (so is "/" itself)
        raise ConfigError(f"config 'runtime_agent_socket': its directory {own} would be made at the filesystem's "
                          "root (a daemon given only --socket puts it beside the socket's directory); set "
                          "runtime_agent_socket to a path in a directory of its own, such as "
                          "/run/unisched-runtime/seccomp-agent.sock")


def _leads_to(directory: Path) -> Path:
    """Where `directory` is: its existing part with links resolved, the rest (and each '..') taken as written."""
    return Path(os.path.realpath(directory))


def check_gpus(config: DaemonConfig, seen: Sequence[int]) -> None:
    """Declared tenants' GPUs against those the daemon sees; with none (no NVML), GPU 0 stands for the host, as
    in the engine."""
    have = tuple(seen) or (0,)
    for i, t in enumerate(config.tenants):
        bad = [g for g in t.gpus or () if g not in have]
        if bad:
            shown = f"GPUs {list(seen)}" if seen else "no GPU the daemon can see (NVML off or none found; 0 stands for the host)"
            raise ConfigError(f"tenants[{i}] 'gpus': no GPU {bad[0]} on this host, which has {shown}")


def check_declared_cgroups(config: DaemonConfig, driver: CgroupDriver, daemon_pid: int) -> None:
    """Declared cgroups must exist and be adoptable (see cgroups.adopt_refusal), each apart from the others."""
    subtree = posixpath.dirname(driver.tenant_cgroup("x"))
    daemon_cgroup = driver.cgroup_of(daemon_pid)
    governed: list[tuple[str, str]] = []
    for i, t in enumerate(config.tenants):
        if t.cgroup is None:
            continue
        try:
            path = driver.normalize(t.cgroup)
        except CgroupError as e:
            raise ConfigError(f"tenants[{i}] 'cgroup': {e}") from None
        why = adopt_refusal(path, subtree, daemon_cgroup, governed)
        if why is not None:
            raise ConfigError(f"tenants[{i}] 'cgroup': {why}")
        governed.append((t.name, path))
