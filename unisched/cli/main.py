"""`unisched`: the daemon (`serve`) and the commands that talk to it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from unisched import __version__
from unisched.cli.service import DEFAULT_CONFIG_PATH, DEFAULT_UNIT_PATH
from unisched.enforce.governed import Orphans, thaw_orphans
from unisched.integrations.kubernetes.defaults import (
    CDI_KIND,
    CONFIG_KIND,
    DEFAULT_CDI_DIR,
    DEFAULT_KUBELET_DIR,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_POD_RESOURCES_SOCKET,
    DEFAULT_REGISTRY_DIR,
    DRIVER_NAME,
)
from unisched.policy import WEIGHT_MAX, WEIGHT_MIN, Engine
from unisched.scheduler.config import (
    DEFAULT_SOCKET,
    KNOBS,
    ConfigError,
    DaemonConfig,
    check_groups,
    check_listener,
    load_config,
    parse_size,
)
from unisched.scheduler.knobs import Knob
from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import LEASE_SOCKET_ENV
from unisched_wire.tenantenv import process_env

__all__ = ["main"]

_PRIORITY: dict[str, pb.Priority] = {"online": pb.PRIORITY_ONLINE, "offline": pb.PRIORITY_OFFLINE}
_PRIORITY_NAME: dict[int, str] = {pb.PRIORITY_ONLINE: "online", pb.PRIORITY_OFFLINE: "offline"}

def _int_in(what: str, lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: a whole number in lo..hi, with a message that names it."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer in {lo}..{hi}, got {text!r}") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"{what} must be in {lo}..{hi}, got {n}")
        return n

    return parse


_weight = _int_in("weight", WEIGHT_MIN, WEIGHT_MAX)


def _engines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    allowed = [e.value for e in Engine]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"engines must be a comma list of {', '.join(allowed)}; got {text!r}")
    return names


def _gpus(text: str) -> list[int]:
    try:
        return [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"gpus must be a comma list of GPU indices, got {text!r}") from None


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, or -1 to clear; got {text!r}") from None
    if n < -1:
        raise argparse.ArgumentTypeError(f"must be >= 0, or -1 to clear; got {n}")
    return n


def _size(text: str) -> int:
    if text.strip() == "-1":
        return -1
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        default=os.environ.get("UNISCHED_SOCKET", DEFAULT_SOCKET),
        help=f"daemon socket (default: $UNISCHED_SOCKET or {DEFAULT_SOCKET})",
    )


def _add_remote(p: argparse.ArgumentParser) -> None:
    """A read-only command may also reach the daemon's TCP listener (TLS with a client certificate)."""
    g = p.add_argument_group("remote daemon (its TCP listener; read-only calls)")
    g.add_argument("--target", metavar="HOST:PORT", help="the daemon's --listen address instead of --socket")
    g.add_argument("--tls-ca", metavar="PEM", help="CA certificate that signed the daemon's certificate")
    g.add_argument("--tls-cert", metavar="PEM", help="this client's certificate (signed by the daemon's tls_client_ca)")
    g.add_argument("--tls-key", metavar="PEM", help="this client's private key")


def _remote_error(args: argparse.Namespace) -> str | None:
    tls = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    if args.target is None:
        given = [k for k, v in tls.items() if v is not None]
        return f"{', '.join(given)} only apply with --target HOST:PORT" if given else None
    missing = [k for k, v in tls.items() if v is None]
    if missing:
        return f"--target needs {', '.join(missing)} (the daemon's TCP listener requires TLS with a client certificate)"
    host, _, port = args.target.rpartition(":")
    if not host or not port.isdigit():
        return f"--target must be HOST:PORT; got {args.target!r}"
    return None


def _client(args: argparse.Namespace, timeout: float = 10.0) -> DaemonClient:
    """The daemon on --socket, or on --target over TLS (checked by main before any command runs)."""
    if getattr(args, "target", None):
        return DaemonClient(target=args.target, timeout=timeout, tls=(args.tls_ca, args.tls_cert, args.tls_key))
    return DaemonClient(args.socket, timeout=timeout)


def _interval(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"interval must be a number of seconds, got {text!r}") from None
    if not 0.1 <= v <= 3600:
        raise argparse.ArgumentTypeError(f"interval must be in 0.1..3600 seconds, got {v:g}")
    return v


def _add_tenant_opts(p: argparse.ArgumentParser, weight_required: bool = False) -> None:
    p.add_argument("--tenant", required=True, help="tenant name (letters, digits, '_', '.', '-')")
    p.add_argument(
        "--weight",
        type=_weight,
        required=weight_required,
        help=f"share weight {WEIGHT_MIN}..{WEIGHT_MAX} (default 100 for a new tenant)",
    )
    p.add_argument("--priority", choices=["online", "offline"], help="online preempts offline in preemptive mode")
    p.add_argument(
        "--engines", type=_engines, default=[], help="engines it uses: compute,graphics,decode,encode (default compute)"
    )
    p.add_argument("--gpus", type=_gpus, default=[], help="GPU indices it may use (default all)")


def _knob_help(spec: Knob) -> str:
    """The knob's help with its range, unit and default, from the one table (scheduler.config.KNOBS); argparse
    expands %, so it is doubled."""
    if spec.kind == "bool":
        text = f"turn {'off' if spec.default else 'on'} {spec.name} ({'on' if spec.default else 'off'} by default): {spec.help}"
    else:
        said = " ".join(p for p in (spec.range_text if spec.bounds else "", spec.unit) if p)
        if spec.default_text:
            default = f"default: {spec.default_text}"
        else:
            default = "unset by default" if spec.default is None else f"default {spec.default_shown}"
        text = f"{spec.help} ({said + '; ' if said else ''}{default})"
    return text.replace("%", "%%")


_METAVARS = {"ms": "MS", "s": "S", "fraction": "U", "port": "PORT", "%": "P", "slices": "N"}


def _add_knob_flag(parser: argparse.ArgumentParser, spec: Knob) -> None:
    """One `serve` flag per config key; None when not given, so the file's value stands (with_overrides)."""
    common: dict[str, Any] = {"dest": spec.name, "default": None, "help": _knob_help(spec)}
    if spec.kind == "bool":
        parser.add_argument(spec.flag_name, action="store_const", const=not spec.default, **common)
    elif spec.kind == "choice":
        parser.add_argument(spec.flag_name, choices=spec.choices, **common)
    elif spec.kind == "str":
        parser.add_argument(spec.flag_name, **common)
    else:
        kind = int if spec.kind == "int" else float
        metavar = _METAVARS.get(spec.unit, "N" if kind is int else "X")
        parser.add_argument(spec.flag_name, type=kind, metavar=metavar, **common)


def knob_flags(args: argparse.Namespace) -> dict[str, Any]:
    """`serve`'s flags as DaemonConfig.with_overrides takes them (None: not given)."""
    return {spec.name: getattr(args, spec.name) for spec in KNOBS}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="unisched",
        description="Share NVIDIA GPUs between tenants by one weight each, over compute, rendering and video.",
    )
    ap.add_argument("--version", action="version", version=f"unisched {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve", help="run the daemon (as root)", description="Run the unisched daemon. Flags override the config file."
    )
    s.add_argument("--config", help="TOML config file ([daemon], [policy], [[tenants]], [[tidal]])")
    s.add_argument("--check-config", action="store_true",
                   help="check the config and flags against this host (GPUs, groups, declared cgroups), print a "
                        "summary and exit: 0 when good, 2 with the key at fault; starts and changes nothing")
    for spec in KNOBS:
        _add_knob_flag(s, spec)
    s.add_argument("--delegated", action="store_true",
                   help="run in a cgroup subtree systemd delegated (Delegate=yes): move the daemon into the leaf "
                        "<own cgroup>/daemon before it starts; tenants belong under <own cgroup>/tenants")

    i = sub.add_parser(
        "install-service", help="write the systemd unit for this installation (as root)",
        description="Write the systemd unit with ExecStart running this Python interpreter (`python -m unisched "
                    "serve`), so it works for a venv or a `pip install --user` as for a system install.",
    )
    i.add_argument("--unit-path", default=DEFAULT_UNIT_PATH, help=f"where to write the unit (default {DEFAULT_UNIT_PATH})")
    i.add_argument("--config", default=DEFAULT_CONFIG_PATH,
                   help=f"config the unit's daemon reads (default {DEFAULT_CONFIG_PATH})")

    r = sub.add_parser(
        "run",
        help="run a command as (part of) a tenant",
        description="Start CMD inside the tenant's cgroup, registered with the daemon; wait for it and exit with its exit code.",
    )
    _add_socket(r)
    _add_tenant_opts(r)
    r.add_argument("--no-session-hooks", action="store_true",
                   help="do not install the seccomp hook that lets the daemon admit and count GPU sessions")
    r.add_argument("--keep", action="store_true",
                   help="keep the tenant (weight, caps) after its last process exits; without it a tenant this run "
                        "creates is removed then, unless the config declares it")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    a = sub.add_parser("adopt", help="govern an existing cgroup (a container's) as a tenant (admin)")
    _add_socket(a)
    _add_tenant_opts(a)
    a.add_argument("--cgroup", required=True, help="cgroup path, absolute or relative to the cgroup root")

    t = sub.add_parser("tenants", help="list tenants and their shares")
    _add_socket(t)
    _add_remote(t)
    t.add_argument("--json", action="store_true", help="print a JSON list, one object per tenant")

    w = sub.add_parser("set-weight", help="change a tenant's weight (admin)")
    _add_socket(w)
    w.add_argument("--tenant", required=True)
    w.add_argument("--weight", type=_weight, required=True)

    lim = sub.add_parser("set-limit", help="cap a tenant's render/decode/encode sessions and GPU memory (admin)",
                         description="Caps on live sessions and GPU memory. -1 clears a cap back to the default "
                                     "(decode/encode: the weight share of the GPU's video engines; render, memory: none).")
    _add_socket(lim)
    lim.add_argument("--tenant", required=True)
    lim.add_argument("--render", type=_count, help="live render (3D/graphics) contexts")
    lim.add_argument("--decode", type=_count, help="live NVDEC sessions")
    lim.add_argument("--encode", type=_count, help="live NVENC sessions")
    lim.add_argument("--memory", type=_size, help="GPU memory per GPU, e.g. 8GiB (-1 clears); the allocation that "
                     "would cross it fails as out of memory (hooked tenants: `unisched run`, OCI agent)")
    lim.add_argument("--memory-reserve", type=_size, help="GPU memory kept for the tenant on each GPU it may use, "
                     "e.g. 4GiB (-1 clears); refused when the reserves on a GPU would exceed its memory")

    rm = sub.add_parser("remove", help="forget a tenant and thaw its cgroup (admin, or the tenant's owner)")
    _add_socket(rm)
    rm.add_argument("--tenant", required=True)

    st = sub.add_parser("status", help="daemon and GPU status; exit 0 when the daemon answers")
    _add_socket(st)
    _add_remote(st)
    st.add_argument("--json", action="store_true")

    top = sub.add_parser("top", help="live view of tenants, shares per engine domain, sessions and refusals",
                         description="Refreshes every --interval seconds; q quits (Ctrl-C when stdin is not a terminal).")
    _add_socket(top)
    _add_remote(top)
    top.add_argument("--interval", type=_interval, default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    _add_device_plugin(sub)
    _add_dra_driver(sub)
    _add_calibrate(sub)
    return ap


def _add_calibrate(sub: Any) -> None:
    from unisched.calibrate import QUICK, STANDARD, estimate_s

    c = sub.add_parser(
        "calibrate", help="measure how much CUDA and rendering slow each other on this GPU, for the daemon",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Measure on GPU 0 how much a CUDA load and a render load slow each other, and write it where the daemon reads it
(STATE_DIR/contention.json, merged under the GPU's name: one file serves several GPU models). The daemon reads the
file at start and picks how to schedule compute against graphics on that GPU model (docs/calibration.md):
  separate-graphics  both keep most of their solo rate together: not sliced against each other
  partial-overlap    together they do about as much as either alone: mixed slices
  shared-sm          they contend: sliced against each other as one domain (also without a calibration)

Run it once per GPU model, and again after a driver update, on an otherwise idle GPU, then restart the daemon.
Needs an NVIDIA GPU, PyTorch with CUDA and PyOpenGL.""",
        epilog=f"time: about {estimate_s(STANDARD):.0f} s ({STANDARD.seconds:g} s windows); --quick about "
               f"{estimate_s(QUICK):.0f} s. Progress goes to stderr.\n"
               "exit status: 0 written; 1 a measurement failed (nothing written); 2 refused before measuring "
               "(no GPU, missing workloads, a target it cannot write)",
    )
    c.add_argument("--config", help="the TOML config `unisched serve` reads, for its state_dir")
    state_dir = next(k for k in KNOBS if k.name == "state_dir")
    _add_knob_flag(c, state_dir)
    c.add_argument("--out", metavar="FILE", help="write (merge into) FILE instead of STATE_DIR/contention.json")
    c.add_argument("--quick", action="store_true",
                   help=f"{QUICK.seconds:g} s windows instead of {STANDARD.seconds:g} s: checks the set-up; the "
                        "fractions are noisier")
    c.add_argument("--seconds", type=_positive, help="measured window per run (overrides --quick's)")
    c.add_argument("--warmup", type=_positive, help="seconds from a workload's launch to its window")
    c.add_argument("--gpu-name", metavar="NAME", help="file the result under NAME instead of GPU 0's NVML name")
    c.add_argument("--render-iterations", type=_int_in("render iterations", 1, 1_000_000), metavar="N",
                   help="fixed shader iterations per frame; skips finding those that give ~36 frames/s")
    c.add_argument("--workload-cmd-cuda", metavar="CMD",
                   help="command replacing the CUDA load (shell words; the window arguments are appended)")
    c.add_argument("--workload-cmd-render", metavar="CMD", help="command replacing the render load (as above)")
    c.add_argument("--work-dir", metavar="DIR", help="workload logs and reports (default: a new folder in /tmp)")
    c.add_argument("--dry-run", action="store_true", help="print the plan and the time it takes; run nothing")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value < 3600.0:
        raise argparse.ArgumentTypeError(f"must be above 0 and under 3600 s, got {text}")
    return value


def _add_device_plugin(sub: Any) -> None:
    d = sub.add_parser(
        "device-plugin",
        help="Kubernetes device plugin: advertise GPU weight to the kubelet and adopt pods as tenants (as root)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Run beside `unisched serve` on a Kubernetes node (deploy/kubernetes/ has the DaemonSet; docs/kubernetes.md).

Advertises to the kubelet (device plugin API v1beta1, one socket and Register call per resource):
  unisched.io/gpu-weight       --units-per-gpu device IDs per GPU; a pod asks for its weight as a count and
                               gets that many units, all on one GPU (GetPreferredAllocation keeps them there;
                               Allocate refuses units that span GPUs)
  unisched.io/render-sessions  --render-sessions per GPU, only when given: a pod's count is its cap on live
  unisched.io/decode-sessions  render contexts / NVDEC sessions (a pod that asks for none gets cap 0)

Allocate gives the container UNISCHED_TENANT (derived from its units), UNISCHED_WEIGHT, UNISCHED_GPU,
UNISCHED_SOCKET, NVIDIA_VISIBLE_DEVICES, the daemon's socket directory (read-only) and the GPU's device nodes.
The kubelet's PodResources API then says which pod holds which units; the plugin adopts each such pod's cgroup
as a daemon tenant (weight = its units, pinned to its GPU; pod UID looked up in the API server with the pod's
service account), before its containers start (PreStartContainer), and removes the tenant when the pod is gone.
GPU health (NVML) reaches the kubelet through ListAndWatch; a kubelet restart is followed by a new registration.
""",
    )
    _add_socket(d)
    d.add_argument("--kubelet-dir", default=DEFAULT_KUBELET_DIR,
                   help=f"the kubelet's device-plugins directory, holding kubelet.sock (default {DEFAULT_KUBELET_DIR})")
    d.add_argument("--pod-resources-socket", default=DEFAULT_POD_RESOURCES_SOCKET,
                   help=f"the kubelet's PodResources socket (default {DEFAULT_POD_RESOURCES_SOCKET})")
    d.add_argument("--units-per-gpu", type=_int_in("units per GPU", 1, 1000), default=100,
                   help="unisched.io/gpu-weight device IDs per GPU (default 100: a pod's count is its weight)")
    d.add_argument("--beside-nvidia-plugin", action="store_true",
                   help="start even where NVIDIA's device plugin (nvidia-*.sock in --kubelet-dir) advertises some of "
                        "these GPUs; without it the plugin refuses to start there (exit 3) and says what to do")
    _add_node_agent_args(d, ("advertise", "advertised"), ("unisched.io/render-sessions", "unisched.io/decode-sessions"),
                         "kubelet, health and adoption checks")


def _add_node_agent_args(d: Any, verb: tuple[str, str], sessions: tuple[str, str], checks: str) -> None:
    """The flags `device-plugin` and `dra-driver` share."""
    d.add_argument("--render-sessions", type=_int_in("render sessions per GPU", 1, 1000),
                   help=f"{verb[0]} {sessions[0]}, this many per GPU (default: not {verb[1]})")
    d.add_argument("--decode-sessions", type=_int_in("decode sessions per GPU", 1, 1000),
                   help=f"{verb[0]} {sessions[1]}, this many per GPU (default: not {verb[1]})")
    d.add_argument("--gpus", type=_gpus, default=[], help=f"GPU indices to {verb[0]} (default: the GPUs the daemon serves)")
    d.add_argument("--cgroup-root", help="where pod cgroups are searched (default: the daemon's cgroup root)")
    d.add_argument("--interval", type=_interval, default=2.0, help=f"seconds between {checks} (default 2)")
    d.add_argument("--log-format", choices=["auto", "json", "console"], default="auto")


def _add_dra_driver(sub: Any) -> None:
    d = sub.add_parser(
        "dra-driver",
        help=f"Kubernetes DRA driver {DRIVER_NAME} (1.34+): publish GPUs, prepare claims as CDI devices (as root)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"""\
Run beside `unisched serve` on a Kubernetes 1.34+ node, instead of `unisched device-plugin`
(deploy/kubernetes/dra/ has the DaemonSet, DeviceClass and a sample claim; docs/kubernetes.md).

Registers with the kubelet through its plugins_registry directory (plugin registration API v1: GetInfo says
DRAPlugin {DRIVER_NAME}, v1beta1.DRAPlugin) and serves the DRA plugin API v1beta1 under --plugins-dir.
Publishes the node's ResourceSlice: one device per GPU (gpu0, gpu1, ...; attributes index, uuid, product,
renderSessions, decodeSessions) with capacity `weight` = --weight-per-gpu, shareable by consumable capacity.

NodePrepareResources reads each ResourceClaim from the API server, takes its {DRIVER_NAME} devices on this node
and its weight ({CONFIG_KIND} opaque config `weight`, else the weight capacity consumed, else the whole GPU's),
writes a CDI spec ({CDI_KIND}) into --cdi-dir that gives the containers UNISCHED_TENANT, UNISCHED_WEIGHT,
UNISCHED_GPU, UNISCHED_SOCKET, NVIDIA_VISIBLE_DEVICES, the daemon's socket directory and the GPUs' device nodes,
and adopts the pod's cgroup as that daemon tenant. NodeUnprepareResources removes both. A claim that cannot be
prepared fails alone, with the reason in the pod's events.
""",
    )
    _add_socket(d)
    d.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""),
                   help="this node's name: the ResourceSlice's pool and node (default: $NODE_NAME)")
    d.add_argument("--driver-name", default=DRIVER_NAME, help=f"the DRA driver name (default {DRIVER_NAME})")
    d.add_argument("--plugins-dir", default=DEFAULT_PLUGINS_DIR,
                   help=f"the kubelet's plugins directory; the driver serves <dir>/<driver-name>/dra.sock "
                        f"(default {DEFAULT_PLUGINS_DIR})")
    d.add_argument("--registry-dir", default=DEFAULT_REGISTRY_DIR,
                   help=f"the kubelet's plugins_registry directory (default {DEFAULT_REGISTRY_DIR})")
    d.add_argument("--cdi-dir", default=DEFAULT_CDI_DIR,
                   help=f"where CDI specs are written, read by the container runtime (default {DEFAULT_CDI_DIR})")
    d.add_argument("--weight-per-gpu", type=_int_in("weight per GPU", 1, 1000), default=100,
                   help="the weight capacity of each GPU, and a whole GPU's weight (default 100)")
    _add_node_agent_args(d, ("publish", "published"), ("attribute renderSessions", "attribute decodeSessions"),
                         "socket, health, ResourceSlice and adoption checks")


def tenant_to_dict(t: pb.Tenant) -> dict[str, Any]:
    return {
        "name": t.name,
        "weight": t.weight,
        "base_weight": t.base_weight,
        "priority": _PRIORITY_NAME.get(t.priority, "offline"),
        "pids": list(t.pids),
        "state": t.state,
        "target_share": round(t.target_share, 4),
        "measured_share": round(t.measured_share, 4),
        "gpu_seconds": round(t.gpu_seconds, 3),
        "cgroup": t.cgroup,
        "engines": list(t.engines),
        "shares": [
            {
                "gpu": s.gpu,
                "domain": s.domain,
                "target_share": round(s.target_share, 4),
                "measured_share": round(s.measured_share, 4),
            }
            for s in t.shares
        ],
        "slices": t.slices,
        "owner_uid": t.owner_uid,
        "adopted": t.adopted,
        "sessions": dict(t.sessions),
        "refusals": dict(t.refusals),
        "caps": {"render": t.caps.render, "decode": t.caps.decode, "encode": t.caps.encode,
                 "memory_bytes": t.caps.memory_bytes, "memory_reserve": t.caps.memory_reserve},
        "gpu_memory": [{"gpu": m.gpu, "used_bytes": m.used_bytes, "cap_bytes": m.cap_bytes,
                        "reserve_bytes": m.reserve_bytes, "refused": m.refused} for m in t.gpu_memory],
        "memory_bytes": t.memory_bytes,
        "over_memory": t.over_memory,
        "devices": t.devices or None,
        "cooperative": t.cooperative,
        "overrun_s": round(t.overrun_s, 4),
        "enforced": t.enforced,
        "unit_ms": round(t.unit_ms, 2) if t.unit_ms else None,
        "turn_ms": round(t.turn_ms, 1),
        "env": dict(t.env),
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _cmd_serve(args: argparse.Namespace) -> int:
    """Start order: what a dead daemon left frozen was thawed before this ran (main); then the config and flags
    (exit 2), and unisched.daemon does the rest: host checks (freezer, GPUs, declared cgroups), the socket lock
    (exit 1 while another daemon serves there), nice, --delegated, the record of what this one may freeze, and
    only then the cgroup driver, state and the engine. Its StartError carries the exit code (2: bad config)."""
    from unisched import daemon

    orphans: Orphans | None = getattr(args, "orphans", None)
    try:
        config = load_config(args.config).with_overrides(**knob_flags(args))
        check_listener(config)
        warnings = check_groups(config)
    except ConfigError as e:
        daemon.say_orphans(orphans)
        print(f"unisched serve: {e}", file=sys.stderr)
        return daemon.EXIT_BAD_CONFIG
    try:
        if args.check_config:
            gpus = daemon.check_host(config)
            for w in warnings:
                print(f"unisched serve: warning: {w}", file=sys.stderr)
            print(_config_summary(args.config, config, gpus))
            return 0
        daemon.run(config, delegated=args.delegated, orphans=orphans)
    except daemon.StartError as e:
        print(f"unisched serve: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import shlex
    from dataclasses import replace
    from pathlib import Path

    from unisched.calibrate import QUICK, STANDARD, Request, main
    from unisched.scheduler.contention_file import contention_path

    try:
        config = load_config(args.config).with_overrides(state_dir=args.state_dir)
    except ConfigError as e:
        print(f"unisched calibrate: {e}", file=sys.stderr)
        return 2
    timing = QUICK if args.quick else STANDARD
    timing = replace(timing, **{k: v for k, v in (("seconds", args.seconds), ("warmup", args.warmup)) if v is not None})

    def words(cmd: str | None) -> tuple[str, ...] | None:
        return tuple(shlex.split(cmd)) if cmd else None

    return main(Request(
        out=Path(args.out) if args.out else contention_path(config.state_dir), timing=timing, gpu_name=args.gpu_name,
        cuda_cmd=words(args.workload_cmd_cuda), render_cmd=words(args.workload_cmd_render),
        render_iterations=args.render_iterations, work_dir=Path(args.work_dir) if args.work_dir else None,
        dry_run=args.dry_run, command=shlex.join(["unisched", *sys.argv[1:]])))


def _cmd_install_service(args: argparse.Namespace) -> int:
    from unisched.cli.service import install_service

    try:
        print(install_service(args.unit_path, args.config))
    except (OSError, ValueError) as e:
        print(f"unisched install-service: {e}", file=sys.stderr)
        return 1
    return 0


def _config_summary(path: str | None, config: DaemonConfig, gpus: list[int]) -> str:
    declared = ", ".join(t.name for t in config.tenants) or "none"
    return (f"config OK: {path or 'built-in defaults'}: socket {config.socket}, mode {config.mode.value}, "
            f"slice {config.slice_ms:g} ms, cgroup {config.cgroup_driver} driver, subtree {config.cgroup_subtree}, "
            f"GPUs {gpus if gpus else 'none seen'}, declared tenants: {declared}")


def _register_request(args: argparse.Namespace) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        tenant=args.tenant,
        weight=args.weight or 0,
        priority=_PRIORITY.get(args.priority or "", pb.PRIORITY_UNSPECIFIED),
        engines=args.engines,
        gpus=args.gpus,
        keep=args.keep,
        session_hooks=not args.no_session_hooks,
    )


def _cmd_run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("unisched run: missing command; usage: unisched run --tenant NAME [--weight W] -- CMD ARGS...", file=sys.stderr)
        return 2
    with DaemonClient(args.socket) as client:
        tenant, sockets = client.register_for_run(_register_request(args))
    if sockets.agent and not args.no_session_hooks:
        # a fresh single-threaded process installs the session filter, hands it to the daemon, then execs CMD
        cmd = [sys.executable, "-m", "unisched.enforce.hooked_exec", "--agent", sockets.agent, "--", *cmd]
    # the command's own client library finds this daemon (its lease socket) whatever the caller's environment said
    env = {**os.environ, "UNISCHED_SOCKET": args.socket, **({LEASE_SOCKET_ENV: sockets.lease} if sockets.lease else {})}
    try:
        child = subprocess.Popen(cmd, env=process_env(env, tenant.env))
    except FileNotFoundError:
        print(f"unisched run: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"unisched run: permission denied: {cmd[0]}", file=sys.stderr)
        return 126

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    rc = child.wait()
    return 128 - rc if rc < 0 else rc


def _cmd_adopt(args: argparse.Namespace) -> int:
    with DaemonClient(args.socket) as client:
        t = client.adopt(
            pb.AdoptRequest(
                tenant=args.tenant,
                weight=args.weight or 0,
                priority=_PRIORITY.get(args.priority or "", pb.PRIORITY_UNSPECIFIED),
                cgroup=args.cgroup,
                engines=args.engines,
                gpus=args.gpus,
            )
        )
    print(f"adopted {t.cgroup} as tenant {t.name} (weight {t.weight})")
    print(
        "note: an adopted cgroup is governed by time slicing (and device admission where enabled); "
        "session admission by seccomp needs the process to be started by `unisched run` or an OCI "
        "runtime with the unisched seccomp profile"
    )
    return 0


def _cmd_tenants(args: argparse.Namespace) -> int:
    with _client(args) as client:
        tenants = client.tenants()
    if args.json:
        print(json.dumps([tenant_to_dict(t) for t in tenants], indent=1))
        return 0
    if not tenants:
        print("no tenants")
        return 0
    rows = [["NAME", "WEIGHT", "PRIORITY", "STATE", "TARGET", "MEASURED", "GPU-S", "ENGINES", "SESSIONS", "REFUSED", "PIDS"]]
    for t in tenants:
        pids = ",".join(map(str, t.pids[:6])) + ("..." if len(t.pids) > 6 else "")
        rows.append(
            [
                t.name,
                str(t.weight),
                _PRIORITY_NAME.get(t.priority, "offline"),
                t.state,
                f"{100 * t.target_share:.1f}%",
                f"{100 * t.measured_share:.1f}%",
                f"{t.gpu_seconds:.1f}",
                ",".join(t.engines) + (" (leases)" if t.cooperative else ""),
                ",".join(f"{k}:{v}" for k, v in sorted(t.sessions.items()) if v) or "-",
                ",".join(f"{k}:{v}" for k, v in sorted(t.refusals.items()) if v) or "-",
                pids or "-",
            ]
        )
    print(_table(rows))
    return 0


def _cmd_set_weight(args: argparse.Namespace) -> int:
    with DaemonClient(args.socket) as client:
        t = client.set_weight(args.tenant, args.weight)
    print(f"{t.name}: weight {t.weight}")
    return 0


def _cmd_set_limit(args: argparse.Namespace) -> int:
    req = pb.SetLimitRequest(tenant=args.tenant)
    for field in ("render", "decode", "encode"):
        if getattr(args, field) is not None:
            setattr(req, field, getattr(args, field))
    if args.memory is not None:
        req.memory_bytes = args.memory
    if args.memory_reserve is not None:
        req.memory_reserve = args.memory_reserve
    with DaemonClient(args.socket) as client:
        t = client.set_limit(req)
    caps = t.caps
    print(f"{t.name}: render {_fmt_cap(caps.render)}, decode {_fmt_cap(caps.decode)}, "
          f"encode {_fmt_cap(caps.encode)}, memory {_fmt_cap(caps.memory_bytes)}, "
          f"memory reserve {_fmt_cap(caps.memory_reserve)}")
    return 0


def _fmt_cap(v: int) -> str:
    return "unlimited" if v < 0 else str(v)


def _cmd_remove(args: argparse.Namespace) -> int:
    with DaemonClient(args.socket) as client:
        client.remove(args.tenant)
    print(f"removed {args.tenant}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    with _client(args, timeout=5.0) as client:
        s = client.status()
    info = {
        "version": s.version,
        "mode": s.mode,
        "slice_ms": s.slice_ms,
        "cgroup_driver": s.cgroup_driver,
        "cgroup_root": s.cgroup_root,
        "nvml": s.nvml,
        "tenants": s.tenants,
        "uptime_s": round(s.uptime_s, 1),
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "contention": g.contention,
                "sm_util": g.sm_util,
                "dec_util": g.dec_util,
                "enc_util": g.enc_util,
                "memory_used": g.memory_used,
                "memory_total": g.memory_total,
                "mix": {"together": g.mix.together, "compute_alone": g.mix.compute_alone,
                        "graphics_alone": g.mix.graphics_alone, "now": g.mix.now} if g.HasField("mix") else None,
            }
            for g in s.gpus
        ],
        "agent_socket": s.agent_socket,
        "session_hooks": s.session_hooks,
        "device_admission": s.device_admission,
        "mps": s.mps or "off",
        "mps_pipe_dir": s.mps_pipe_dir or None,
        "caller": {"pid": s.caller_pid, "uid": s.caller_uid, "admin": s.caller_is_admin, "tenant": s.caller_tenant or None},
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(
        f"unisched {s.version}: mode {s.mode}, slice {s.slice_ms:g} ms, {s.tenants} tenants, "
        f"cgroup {s.cgroup_driver} at {s.cgroup_root}, up {s.uptime_s:.0f} s"
    )
    if not s.nvml:
        print("no NVML: scheduling on CPU signals")
    print(f"session hooks (seccomp): {s.session_hooks}" + (f", agent socket {s.agent_socket}" if s.agent_socket else ""))
    print(f"device admission (cgroup eBPF): {s.device_admission}")
    print(f"MPS: {s.mps or 'off'}" + (f", pipe directory {s.mps_pipe_dir}" if s.mps_pipe_dir else ""))
    from unisched.cli.top import gpu_line

    for g in s.gpus:
        print(gpu_line(g))
    return 0


def _cmd_device_plugin(args: argparse.Namespace) -> int:
    from pathlib import Path

    from unisched.integrations.kubernetes.plugin import PluginConfig
    from unisched.integrations.kubernetes.run import serve_device_plugin
    from unisched.logs import configure_logging

    configure_logging(args.log_format)
    config = PluginConfig(
        gpus=tuple(args.gpus), units_per_gpu=args.units_per_gpu, render_sessions=args.render_sessions or 0,
        decode_sessions=args.decode_sessions or 0, kubelet_dir=Path(args.kubelet_dir), daemon_socket=args.socket,
        beside_nvidia_plugin=args.beside_nvidia_plugin,
    )
    return serve_device_plugin(config, args.pod_resources_socket, interval=args.interval,
                               cgroup_root=Path(args.cgroup_root) if args.cgroup_root else None)


def _cmd_dra_driver(args: argparse.Namespace) -> int:
    from pathlib import Path

    from unisched.integrations.kubernetes.dra import DraConfig
    from unisched.integrations.kubernetes.run import serve_dra_driver
    from unisched.logs import configure_logging

    if not args.node_name:
        print("unisched dra-driver: no node name: pass --node-name or set NODE_NAME (the DaemonSet sets it from "
              "spec.nodeName)", file=sys.stderr)
        return 2
    configure_logging(args.log_format)
    config = DraConfig(
        node_name=args.node_name, gpus=tuple(args.gpus), driver_name=args.driver_name,
        plugins_dir=Path(args.plugins_dir), registry_dir=Path(args.registry_dir), cdi_dir=Path(args.cdi_dir),
        daemon_socket=args.socket, weight_per_gpu=args.weight_per_gpu, render_sessions=args.render_sessions or 0,
        decode_sessions=args.decode_sessions or 0,
    )
    return serve_dra_driver(config, interval=args.interval,
                            cgroup_root=Path(args.cgroup_root) if args.cgroup_root else None)


def _cmd_top(args: argparse.Namespace) -> int:
    from unisched.cli.top import run_top

    with _client(args, timeout=5.0) as client:
        return run_top(client, interval=args.interval, once=args.once)


_COMMANDS = {
    "serve": _cmd_serve,
    "install-service": _cmd_install_service,
    "run": _cmd_run,
    "adopt": _cmd_adopt,
    "tenants": _cmd_tenants,
    "set-weight": _cmd_set_weight,
    "set-limit": _cmd_set_limit,
    "remove": _cmd_remove,
    "status": _cmd_status,
    "top": _cmd_top,
    "device-plugin": _cmd_device_plugin,
    "dra-driver": _cmd_dra_driver,
    "calibrate": _cmd_calibrate,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `serve` thaws what a dead daemon left frozen before anything else, so no later error (a bad flag or config,
    # a damaged state file) can leave a tenant frozen for good
    serving = argv[:1] == ["serve"] and "--check-config" not in argv
    orphans = thaw_orphans() if serving and os.geteuid() == 0 else None
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        if orphans is not None:
            from unisched.daemon import say_orphans

            say_orphans(orphans)
        raise
    args.orphans = orphans
    if hasattr(args, "target") and (problem := _remote_error(args)):
        parser.error(problem)
    try:
        return _COMMANDS[args.command](args)
    except DaemonError as e:
        print(f"unisched {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
