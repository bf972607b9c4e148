"""Daemon configuration: a TOML file for defaults, tenants declared ahead and schedules; flags override it.

Every bad value fails at start with a message that names the key and the allowed values.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from unisched.enforce.cgroups import DEFAULT_SUBTREE, check_subtree
from unisched.policy import (
    DEFAULT_WEIGHT,
    WEIGHT_MAX,
    WEIGHT_MIN,
    Engine,
    Mode,
    PolicyError,
    Priority,
    TidalSchedule,
    TidalWindow,
    parse_clock,
    validate_tenant_name,
)
from unisched.policy.caps import MAX_MEMORY_BYTES, MAX_SESSIONS, SessionLimits
from unisched.scheduler.knobs import Knob, KnobError, TableKey, knob, knobs_of
from unisched_wire.leasewire import LEASE_SOCKET_NAME, lease_socket_beside

__all__ = [
    "ConfigError",
    "DaemonConfig",
    "DeclaredTenant",
    "KNOBS",
    "METRICS_PORT",
    "TENANT_KEYS",
    "TIDAL_KEYS",
    "check_listener",
    "load_config",
    "MAX_GPU_INDEX",
    "is_gpu_index",
    "parse_size",
    "runtime_agent_socket_beside",
]

MAX_GPU_INDEX = 255
"""The highest GPU index a tenant may name (a host has at most a few dozen)."""

DEFAULT_SOCKET = "/run/unisched/unisched.sock"
DEFAULT_STATE_DIR = "/var/lib/unisched"
AGENT_SOCKET_NAME = "seccomp-agent.sock"
DEFAULT_AGENT_SOCKET = str(Path(DEFAULT_SOCKET).with_name(AGENT_SOCKET_NAME))
DEFAULT_LEASE_SOCKET = str(Path(DEFAULT_SOCKET).with_name(LEASE_SOCKET_NAME))
DEFAULT_METRICS_LISTEN = "127.0.0.1"


def runtime_agent_socket_beside(socket_path: str) -> str:
    """The runtime agent socket of a daemon on `socket_path`: in a directory beside the socket's (its name and
    `-runtime`), never inside it, since the socket's directory is mounted into pods. For a socket directly in a
    top-level directory (/run/d.sock) that is at the filesystem's root (/run-runtime), which hostcheck refuses."""
    where = Path(socket_path).parent
    return str(where.parent / f"{where.name or 'unisched'}-runtime" / AGENT_SOCKET_NAME)


DEFAULT_RUNTIME_AGENT_SOCKET = runtime_agent_socket_beside(DEFAULT_SOCKET)
METRICS_PORT = 19400
"""Our metrics port, where deploy/ turns metrics on: outside 9100-9999, which Prometheus' list of exporter ports
has given out (9400 is dcgm-exporter's, which runs on the same GPU nodes)."""
TLS_KEYS = ("tls_cert", "tls_key", "tls_client_ca")
DEFAULT_NICE = -10
"""The daemon's nice value (`nice`): every registration, freeze and thaw goes through the daemon, so a burst of
user processes (200 concurrent `unisched run` starting Python on 2 cores) must not leave it ~1% of the CPU while
their replies queue; -10 weighs it ~9x a nice-0 process (CFS), and the burst then finishes within the clients'
deadline. Not lower: the daemon's own CPU per call is small, it needs to be scheduled, not to starve the host."""


class ConfigError(ValueError):
    """Bad configuration; the message names the key and what is allowed."""


@dataclass(frozen=True)
class DeclaredTenant:
    name: str
    weight: int = DEFAULT_WEIGHT
    priority: Priority = Priority.OFFLINE
    engines: frozenset[Engine] = frozenset({Engine.COMPUTE})
    gpus: tuple[int, ...] | None = None
    cgroup: str | None = None
    """Adopt this existing cgroup at start (a container's)."""
    limits: SessionLimits = field(default_factory=SessionLimits)


TENANT_KEYS = (
    TableKey("name", "string", "1-63 letters, digits, '_', '.', '-'; not starting with a cgroup controller's name "
             "or 'cgroup' and a '.' (cpu.x)", "required", "the tenant's name"),
    TableKey("weight", "integer", f"{WEIGHT_MIN}..{WEIGHT_MAX}", str(DEFAULT_WEIGHT), "its share of each GPU engine, by weight"),
    TableKey("priority", "string", "online | offline", "offline", "online tenants go first in preemptive mode"),
    TableKey("engines", "list of strings", ", ".join(e.value for e in Engine), '["compute"]', "the GPU engines it uses"),
    TableKey("gpus", "list of integers", "GPU indices 0..255", "all", "pinned: it may open only these GPUs' device "
             "nodes (device admission)"),
    TableKey("cgroup", "string", "a cgroup path without '.' or '..'", "unset", "adopt this existing cgroup (a "
             "container's) at start instead of creating one below cgroup_subtree"),
    TableKey("render", "integer", f"0..{MAX_SESSIONS}", "unlimited", "cap on live render (3D/graphics) contexts"),
    TableKey("decode", "integer", f"0..{MAX_SESSIONS}", "weight share", "cap on live NVDEC sessions (default: the weight "
             "share of the GPU's video engines)"),
    TableKey("encode", "integer", f"0..{MAX_SESSIONS}", "weight share", "cap on live NVENC sessions (default: the weight "
             "share of the GPU's video engines)"),
    TableKey("memory", "size", "bytes or 8GiB, 512MiB, ...", "unlimited", "cap on GPU memory per GPU, enforced at "
             "each allocation by the session hooks"),
    TableKey("memory_reserve", "size", "bytes or 8GiB, 512MiB, ...; at most memory", "none", "GPU memory kept for "
             "the tenant on each GPU it may use: other tenants' allocations that would eat into it fail; the "
             "tenant is refused when the reserves on a GPU would exceed its memory"),
)
"""Keys of [[tenants]]: tenants declared ahead, created at start if not already known."""
TIDAL_KEYS = (
    TableKey("tenant", "string", "a tenant name", "required", "whose weight the window sets"),
    TableKey("start", "string", "HH:MM", "required", "local time the window starts"),
    TableKey("end", "string", "HH:MM", "required", "local time it ends; may wrap midnight"),
    TableKey("weight", "integer", f"{WEIGHT_MIN}..{WEIGHT_MAX}", "required", "the tenant's weight within the window"),
)
"""Keys of [[tidal]] (mode = "tidal" only), all required."""


def _check_listen(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be HOST:PORT; got {value!r}")
    return value


@dataclass(frozen=True)
class DaemonConfig:
    """Each knob is declared once here (scheduler.knobs): its TOML key, `serve` flag and docs/configuration.md row."""

    # [daemon]
    socket: str = knob(DEFAULT_SOCKET, "daemon", "Unix socket of the gRPC API (`unisched run`, `tenants`, ...); "
                       "callers are identified by the kernel (SO_PEERCRED), never by what they send")
    lease_socket: str = knob(
        DEFAULT_LEASE_SOCKET, "daemon", "Unix socket of the lease stream (cooperative apps using the client library, "
        "which looks for it beside socket unless UNISCHED_LEASE_SOCKET names it); same access as socket",
        default_text=f"{LEASE_SOCKET_NAME} beside socket")
    agent_socket: str = knob(
        DEFAULT_AGENT_SOCKET, "daemon", "seccomp agent socket of `unisched run` children (any user, mode 0666), each "
        "handing over its own GPU session filter; container runtimes use runtime_agent_socket",
        default_text=f"{AGENT_SOCKET_NAME} beside socket")
    runtime_agent_socket: str = knob(
        DEFAULT_RUNTIME_AGENT_SOCKET, "daemon", "seccomp agent socket of the host's OCI runtimes (runc, crun: the "
        "seccomp profile's listenerPath), root's alone: a runtime there may name the tenant and is believed though it "
        "exited before its hand-over was read. Its modes (0600, in a directory of its own the daemon keeps 0700) keep "
        "out the host's other users; only never mounting that directory into a pod keeps pods out",
        default_text=f"{AGENT_SOCKET_NAME} in <socket's directory>-runtime")
    socket_group: str | None = knob(None, "daemon", "only root and this group may connect to socket (mode 0660; "
                                    "unset: everyone, 0666); the group must exist")
    admin_group: str | None = knob(None, "daemon", "members may change weights and caps, adopt and remove tenants, "
                                   "besides root (a missing group leaves only root)")
    user_tenants: bool = knob(True, "daemon", "non-admins may create tenants (`unisched run --tenant NEW`)")
    user_leases: bool = knob(True, "daemon", "non-admins may open lease sessions (the client libraries); a client's "
                             "GPU time is what it reports, so set false where every app must be held to its weight")
    max_user_weight: int = knob(DEFAULT_WEIGHT, "daemon", "the highest weight a non-admin may ask for",
                                bounds=(WEIGHT_MIN, WEIGHT_MAX))
    state_dir: str = knob(DEFAULT_STATE_DIR, "daemon", "where tenants and weights are kept across restarts")
    cgroup_driver: str = knob("auto", "daemon", "freezer to use: auto (cgroup v2, else the v1 freezer on hybrid "
                              "hosts)", choices=("auto", "v2", "v1"))
    cgroup_subtree: str = knob(
        DEFAULT_SUBTREE, "daemon", "this daemon's part of each cgroup hierarchy, relative to its root: tenants' "
        "cgroups are created below it, and the daemon touches nothing else it did not adopt (two daemons on one "
        "host need two subtrees)", check=check_subtree)
    log_format: str = knob("auto", "daemon", "log lines as JSON or for a terminal (auto: JSON unless stderr is a "
                           "terminal)", choices=("auto", "json", "console"))
    log_level: str = knob("info", "daemon", "lowest level logged", choices=("debug", "info", "warning", "error"))
    nice: int = knob(DEFAULT_NICE, "daemon", "the daemon's nice value, set by `serve` on itself at start (every "
                     "thread; below 0 needs root): a burst of user processes must not starve the replies they wait on",
                     bounds=(-20, 19))
    nvml: bool = knob(True, "daemon", "read GPU utilization and memory with NVML; false ignores GPUs and schedules "
                      "on cgroup CPU time alone")
    cpu_stand_in: bool = knob(False, "daemon", "no GPU needed: one CPU core stands in for GPU 0, its busy fraction "
                              "being the CPU time all tenants used (pin them to one core so they contend as GPU work "
                              "does); for trying unisched and for tests, never for real GPU work")
    metrics_port: int = knob(0, "daemon", "serve Prometheus metrics on http://metrics_listen:metrics_port/metrics, "
                             f"and the /healthz and /readyz probes; 0 = off ({METRICS_PORT} is unisched's port)",
                             bounds=(0, 65535), unit="port")
    metrics_listen: str = knob(DEFAULT_METRICS_LISTEN, "daemon", "address for metrics_port; the metrics name every "
                               "tenant, so open it wider only behind a firewall")
    listen: str | None = knob(None, "daemon", "also serve read-only calls (tenants, status, top) on TCP HOST:PORT; "
                              "needs tls_cert, tls_key and tls_client_ca", check=_check_listen)
    tls_cert: str | None = knob(None, "daemon", "PEM certificate of the TCP listener")
    tls_key: str | None = knob(None, "daemon", "PEM private key of the TCP listener")
    tls_client_ca: str | None = knob(None, "daemon", "PEM CA certificate; TCP clients must present a certificate "
                                     "it signed")
    # [policy]
    mode: Mode = knob(  # noqa: RUF009 (a field(), as every knob() is)
        Mode.SHARED, "policy", "shared (weighted, work conserving), preemptive (online tenants first), "
        "timeshare (fixed windows in turn), tidal (weights by time of day from [[tidal]])",
        choices=tuple(m.value for m in Mode))
    slice_ms: float = knob(50.0, "policy", "slice length: how often the daemon measures, decides and freezes or "
                           "thaws", bounds=(1.0, 10_000.0), unit="ms")
    lag_limit_slices: float = knob(2.0, "policy", "credit an idle tenant may keep: stops a tenant banking idle time",
                                   bounds=(0.0, 100.0), unit="slices")
    timeshare_window_ms: float = knob(100.0, "policy", "timeshare mode: a tenant's window is this x weight / 100",
                                      bounds=(1.0, 600_000.0), unit="ms")
    share_window_s: float = knob(10.0, "policy", "window over which measured shares are reported",
                                 bounds=(0.1, 3600.0), unit="s")
    idle_slices: int = knob(2, "policy", "thawed slices without activity before a tenant counts as idle and lends "
                            "its share", bounds=(1, 1000), unit="slices")
    activity_threshold: float = knob(0.02, "policy", "fraction of a slice of CPU (or GPU busy) below which a tenant "
                                     "shows no work", bounds=(0.0, 1.0), unit="fraction")
    timer_slack_us: float = knob(
        0.0, "policy", "freezer enforcement: the timer slack the daemon gives every thread of the tenants that render "
        "(graphics declared, or render sessions seen) and whose CPU time it charges, once a second (0 = leave the "
        "kernel's, 50 us). A GL driver's sleeping wait for the GPU "
        "turns its loop about once a slack: a larger one makes waiting behind other tenants cost less CPU where "
        "dozens of paced tenants wait, but not nothing, and the split may then lean toward the heaviest weights "
        "instead (compare it on the load); every timer of those threads (sleeps, poll and timed waits) may then "
        "fire up to this much later", bounds=(0.0, 100_000.0),
        unit="us")
    lease_timeout_ms: float = knob(250.0, "policy", "a cooperative client's lease is revoked, and its demand dropped, "
                                   "when not renewed within this long", bounds=(10.0, 600_000.0), unit="ms")
    lease_max_run_ms: float = knob(
        500.0, "policy", "a cooperative compute tenant whose steps are long keeps its lease for 8 of them a turn "
        "(policy.tuning: run_units), at most this long: fewer hand-overs, at which its queued work runs beside the "
        "next holder's; 0 = one slice a turn", bounds=(0.0, 10_000.0), unit="ms")
    saturated_util: float = knob(
        0.98, "policy", "freezer enforcement: a GPU engine's tenants are sliced only while its mean busy fraction over 0.4 s "
        "is at least this (0 = always); near 1 because saturated means never idle (policy.tuning: saturation_*)",
        bounds=(0.0, 1.0), unit="fraction")
    ration_paced: bool = knob(
        True, "policy", "freezer enforcement: where paced tenants (games, streams) saturate a GPU engine only together, "
        "so that slicing leaves their turns unused and the engine is held open, those furthest ahead of their weight "
        "share sit out, a quarter of a slice at a time, while the rest keep it busy (policy.rationing); false: held "
        "open, they share it as without the daemon")
    contention: str = knob(
        "auto", "policy", "which engines contend. auto: measured per GPU model by `unisched calibrate` "
        "(compute and graphics that overlap partly get mixed slices, policy.overlap), without a calibration "
        "shared-sm (sliced as one); partial-overlap: mixed slices from the calibration's rates whatever their sum "
        "(it must exist)", choices=("auto", "shared-sm", "separate-graphics", "partial-overlap"))
    mix_period_ms: float = knob(
        1000.0, "policy", "where compute and graphics overlap partly: each kind of mixed slice (together, compute "
        "alone, graphics alone) runs for its part of a period this long at a stretch (policy.overlap.MixTurns); "
        "longer loses less to the frame a paused render finishes, shorter pauses each side for less",
        bounds=(1.0, 600_000.0), unit="ms")
    mps: bool = knob(
        False, "policy", "start (or join) an MPS control daemon (pipe directory 'mps' beside socket) and start compute "
        "tenants' processes as its clients, with client priority and SM cap by class (policy.mps): in preemptive "
        "mode offline ones run below normal priority on part of the SMs, so online requests' kernels go first. "
        "CUDA only; needs nvidia-cuda-mps-control")
    mps_offline_sm_percent: int = knob(
        70, "policy", "with mps in preemptive mode: the SMs an offline compute tenant's processes may use "
        "(100 = all, priority only)", bounds=(1, 100), unit="%")
    """70: an SM-bound trainer (ResNet-50 b128 on an H200) keeps most of its solo rate at 70 (~0.85) with an online
    request's p99 still near its alone latency, and about half at 30; a launch-bound one (b32) keeps its rate at
    either. The online suite (bench/run.py online) measures both sides."""
    tenants: tuple[DeclaredTenant, ...] = ()
    tidal: TidalSchedule = field(default_factory=TidalSchedule)

    def with_overrides(self, **overrides: Any) -> DaemonConfig:
        """Apply command-line flags (None = not given) and validate the result."""
        given = {k: v for k, v in overrides.items() if v is not None}
        raw = {k: (v.value if isinstance(v, Mode) else v) for k, v in given.items()}
        checked = _parse_daemon(raw, base=self, where="flag")
        out = replace(self, **{k: getattr(checked, k) for k in given})
        # a daemon on its own socket (tests, a second instance) gets its other sockets beside it
        moved: dict[str, Any] = {key: beside(out.socket) for key, default, beside in _BESIDE_SOCKET
                                 if "socket" in given and key not in given and getattr(self, key) == default}
        return replace(out, **moved)


_BESIDE_SOCKET: Final = (
    ("agent_socket", DEFAULT_AGENT_SOCKET, lambda s: str(Path(s).with_name(AGENT_SOCKET_NAME))),
    ("lease_socket", DEFAULT_LEASE_SOCKET, lease_socket_beside),
    ("runtime_agent_socket", DEFAULT_RUNTIME_AGENT_SOCKET, runtime_agent_socket_beside),
)
"""The sockets whose default follows `socket` when only it is given: (key, its default, where beside socket)."""


KNOBS = knobs_of(DaemonConfig)
"""Every [daemon] and [policy] key, in the order docs/configuration.md and `serve --help` show them."""
_BY_NAME: Mapping[str, Knob] = {k.name: k for k in KNOBS}
POLICY_KEYS = frozenset(k.name for k in KNOBS if k.section == "policy")
"""Keys of [policy] (how tenants are scheduled); every other key belongs in [daemon]. One section per key, so a key
written in the other one is an error that names the right section, not a silent second spelling."""


def _err(where: str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"{where} {key!r}: {msg}")


def _parse_daemon(raw: Mapping[str, Any], base: DaemonConfig, where: str) -> DaemonConfig:
    values: dict[str, Any] = {}
    for key, value in raw.items():
        spec = _BY_NAME.get(key)
        if spec is None:
            raise _err(where, key, f"unknown key; allowed keys: {', '.join(sorted(_BY_NAME))}")
        try:
            values[key] = spec.parse(value)
        except KnobError as e:
            raise _err(where, key, str(e)) from None
    return replace(base, **values)


def check_listener(config: DaemonConfig) -> None:
    """The TCP listener only with TLS and client certificates: all three files named and readable.

    Checked once flags are applied (a file may set `listen` and flags the certificates)."""
    if config.listen is None:
        return
    missing = [k for k in TLS_KEYS if getattr(config, k) is None]
    if missing:
        flags = ", ".join("--" + k.replace("_", "-") for k in missing)
        raise ConfigError(
            f"config 'listen': the TCP listener {config.listen} requires TLS with client certificates; "
            f"missing {', '.join(missing)} (flags {flags})"
        )
    for key in TLS_KEYS:
        path = Path(getattr(config, key))
        try:
            path.read_bytes()
        except OSError as e:
            raise ConfigError(f"config {key!r}: cannot read {path}: {e.strerror or e}") from None


def _parse_engines(value: Any, where: str) -> frozenset[Engine]:
    allowed = ", ".join(e.value for e in Engine)
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} 'engines': must be a non-empty list of {allowed}; got {value!r}")
    try:
        return frozenset(Engine(v) for v in value)
    except ValueError:
        raise ConfigError(f"{where} 'engines': each must be one of {allowed}; got {value!r}") from None


def _parse_tenant(raw: Any, i: int) -> DeclaredTenant:
    where = f"tenants[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a table")
    allowed = {k.name for k in TENANT_KEYS}
    for key in raw:
        if key not in allowed:
            raise ConfigError(f"{where} {key!r}: unknown key; allowed keys: {', '.join(sorted(allowed))}")
    name_raw = raw.get("name")
    if not isinstance(name_raw, str):
        raise ConfigError(f"{where} 'name': must be a string (a tenant name); got {name_raw!r}")
    try:
        name = validate_tenant_name(name_raw)
    except PolicyError as e:
        raise ConfigError(f"{where} 'name': {e}") from None
    weight = raw.get("weight", DEFAULT_WEIGHT)
    if isinstance(weight, bool) or not isinstance(weight, int) or not WEIGHT_MIN <= weight <= WEIGHT_MAX:
        raise ConfigError(f"{where} 'weight': must be an integer in {WEIGHT_MIN}..{WEIGHT_MAX}; got {weight!r}")
    prio = raw.get("priority", "offline")
    if prio not in ("online", "offline"):
        raise ConfigError(f"{where} 'priority': must be one of online, offline; got {prio!r}")
    engines = _parse_engines(raw["engines"], where) if "engines" in raw else frozenset({Engine.COMPUTE})
    gpus = raw.get("gpus")
    if gpus is not None and (not isinstance(gpus, list) or not all(map(is_gpu_index, gpus))):
        raise ConfigError(f"{where} 'gpus': must be a list of GPU indices 0..{MAX_GPU_INDEX}; got {gpus!r}")
    cgroup = raw.get("cgroup")
    if cgroup is not None:
        parts = cgroup.split("/") if isinstance(cgroup, str) else []
        if not isinstance(cgroup, str) or not cgroup.strip("/") or "\0" in cgroup or {".", ".."} & set(parts):
            raise ConfigError(f"{where} 'cgroup': must be a cgroup path without '.' or '..'; got {cgroup!r}")
    sizes: dict[str, int | None] = {}
    for key in ("memory", "memory_reserve"):
        try:
            sizes[key] = parse_size(raw[key]) if key in raw else None
        except ValueError as e:
            raise ConfigError(f"{where} {key!r}: {e}") from None
    memory = sizes["memory"]
    for key in ("render", "decode", "encode"):
        try:
            SessionLimits(**{key: raw.get(key)})
        except PolicyError as e:
            raise ConfigError(f"{where} {key!r}: {e}") from None
    try:
        limits = SessionLimits(render=raw.get("render"), decode=raw.get("decode"), encode=raw.get("encode"),
                               memory_bytes=memory, memory_reserve=sizes["memory_reserve"])
    except PolicyError as e:
        raise ConfigError(f"{where} 'memory_reserve': {e}") from None
    return DeclaredTenant(name, weight, Priority(prio), engines, tuple(gpus) if gpus else None, cgroup, limits)


def is_gpu_index(g: object) -> bool:
    """A GPU index a tenant may name: a whole number (not a boolean) in 0..MAX_GPU_INDEX."""
    return isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= MAX_GPU_INDEX


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
               "p": 1 << 50, "pb": 1 << 50, "pib": 1 << 50}


def parse_size(value: object) -> int:
    """'8GiB', '512M', 1073741824 -> bytes (binary units), 0..MAX_MEMORY_BYTES (1 PiB, the most any cap takes)."""
    bad = ValueError(f"size must be a number of bytes or like 8GiB, 512MiB (at most 1PiB, {MAX_MEMORY_BYTES}); "
                     f"got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise bad
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):]
    try:
        number = float(num) if num else math.nan
    except ValueError:
        raise bad from None
    if unit not in _SIZE_UNITS or not math.isfinite(number) or number < 0:
        raise bad
    if _SIZE_UNITS[unit] == 1 and not num.isdigit():  # "1.5": a fraction of a byte, surely not what was meant
        raise ValueError(f"size must be a whole number of bytes without a unit (or like 1.5GiB); got {value!r}")
    size = int(num) * _SIZE_UNITS[unit] if num.isdigit() else int(number * _SIZE_UNITS[unit])
    if size > MAX_MEMORY_BYTES:
        raise bad
    return size


def _parse_tidal(raw: Any, i: int) -> TidalWindow:
    where = f"tidal[{i}]"
    if not isinstance(raw, dict) or set(raw) != {k.name for k in TIDAL_KEYS}:
        raise ConfigError(f"{where}: must be a table with exactly tenant, start, end, weight")
    try:
        start = parse_clock(raw["start"])
    except PolicyError as e:
        raise ConfigError(f"{where} 'start': {e}") from None
    try:
        end = parse_clock(raw["end"])
    except PolicyError as e:
        raise ConfigError(f"{where} 'end': {e}") from None
    if not isinstance(raw["tenant"], str):
        raise ConfigError(f"{where} 'tenant': must be a string (a tenant name); got {raw['tenant']!r}")
    try:
        validate_tenant_name(raw["tenant"])
    except PolicyError as e:
        raise ConfigError(f"{where} 'tenant': {e}") from None
    try:
        return TidalWindow(raw["tenant"], start, end, raw["weight"])
    except PolicyError as e:
        raise ConfigError(f"{where} 'weight': {e}") from None


def load_config(path: str | Path | None) -> DaemonConfig:
    """Defaults, then the TOML file if given. Layout: [daemon], [policy], [[tenants]], [[tidal]]."""
    if path is None:
        return DaemonConfig()
    p = Path(path)
    try:
        data = tomllib.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {p} is a directory, not a TOML file") from None
    except OSError as e:
        raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start}): TOML files are UTF-8") from None
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise ConfigError(f"config file {p} is not valid TOML: {str(e) or 'nested too deeply'}") from None
    allowed = {"daemon", "policy", "tenants", "tidal"}
    for key in data:
        if key not in allowed:
            raise ConfigError(f"config {key!r}: unknown section; allowed: {', '.join(sorted(allowed))}")
    flat: dict[str, Any] = {}
    for section in ("daemon", "policy"):
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"config [{section}]: must be a table")
        for key, value in table.items():
            right = _BY_NAME[key].section if key in _BY_NAME else section
            if right != section:
                raise ConfigError(f"config [{section}] {key!r}: belongs in [{right}], not [{section}]")
            flat[key] = value
    cfg = _parse_daemon(flat, DaemonConfig(), where="config")
    tenants_raw = data.get("tenants", [])
    tidal_raw = data.get("tidal", [])
    if not isinstance(tenants_raw, list) or not isinstance(tidal_raw, list):
        raise ConfigError("config 'tenants' and 'tidal' must be arrays of tables ([[tenants]], [[tidal]])")
    tenants = tuple(_parse_tenant(t, i) for i, t in enumerate(tenants_raw))
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ConfigError(f"config 'tenants': names must be unique; got {names}")
    windows = tuple(_parse_tidal(w, i) for i, w in enumerate(tidal_raw))
    if windows and cfg.mode is not Mode.TIDAL:
        raise ConfigError('config [[tidal]] windows need mode = "tidal" in [policy]')
    return replace(cfg, tenants=tenants, tidal=TidalSchedule(windows))
