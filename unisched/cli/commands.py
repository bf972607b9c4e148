"""What each `unisched` command does once its arguments are parsed: call the daemon or unisched.daemon, print."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from typing import Any

from unisched.cli.args import knob_flags
from unisched.enforce.governed import Orphans
from unisched.scheduler.config import ConfigError, DaemonConfig, check_listener, load_config
from unisched.scheduler.hostcheck import check_groups, check_places
from unisched.transport.client import DaemonClient
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import LEASE_SOCKET_ENV
from unisched_wire.tenantenv import process_env

_PRIORITY: dict[str, pb.Priority] = {"online": pb.PRIORITY_ONLINE, "offline": pb.PRIORITY_OFFLINE}
_PRIORITY_NAME: dict[int, str] = {pb.PRIORITY_ONLINE: "online", pb.PRIORITY_OFFLINE: "offline"}


def _client(args: argparse.Namespace, timeout: float = 10.0) -> DaemonClient:
    """The daemon on --socket, or on --target over TLS (checked by main before any command runs)."""
    if getattr(args, "target", None):
        return DaemonClient(target=args.target, timeout=timeout, tls=(args.tls_ca, args.tls_cert, args.tls_key))
    return DaemonClient(args.socket, timeout=timeout)


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
                "charges": [{"rule": x.rule, "source": x.source, "seconds": round(x.seconds, 4)} for x in s.charges],
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
        check_places(config)
        warnings = check_groups(config)
    except ConfigError as e:
        daemon.say_orphans(orphans)
        print(f"unisched serve: {e}", file=sys.stderr)
        return daemon.EXIT_BAD_CONFIG
    try:
        if args.check_config:
            gpus = daemon.check_host(config)
            if os.geteuid() != 0:
                warnings.append("checked as a user: the daemon itself must run as root")
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
    except PermissionError as e:
        print(f"unisched install-service: {e} (run it as root: sudo {sys.executable} -m unisched install-service)",
              file=sys.stderr)
        return 1
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
        memory_bytes=args.memory,
        memory_reserve=args.memory_reserve,
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
                memory_bytes=args.memory,
                memory_reserve=args.memory_reserve,
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
          f"encode {_fmt_cap(caps.encode)}, memory {_fmt_size(caps.memory_bytes)}, "
          f"memory reserve {_fmt_size(caps.memory_reserve)}")
    return 0


def _fmt_cap(v: int) -> str:
    return "unlimited" if v < 0 else str(v)


def _fmt_size(v: int) -> str:
    """A size as it was most likely given: 8 GiB, 512 MiB, else bytes."""
    if v < 0:
        return "unlimited"
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if v >= unit and v % unit == 0:
            return f"{v // unit} {name}"
    return f"{v} B"


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
        "runtime_agent_socket": s.runtime_agent_socket,
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
    sockets = "".join(f", {what} {path}" for what, path in (("agent socket", s.agent_socket),
                                                            ("runtime agent socket", s.runtime_agent_socket)) if path)
    print(f"session hooks (seccomp): {s.session_hooks}{sockets}")
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
        beside_nvidia_plugin=args.beside_nvidia_plugin, device_list=args.device_list,
        require_gpu_profile=args.require_gpu_profile, online_namespaces=args.online_namespaces,
    )
    return serve_device_plugin(config, args.pod_resources_socket, interval=args.interval,
                               cgroup_root=Path(args.cgroup_root) if args.cgroup_root else None)


def _cmd_dra_driver(args: argparse.Namespace) -> int:
    from pathlib import Path

    from unisched.integrations.kubernetes.dra_claims import DraConfig
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
        decode_sessions=args.decode_sessions or 0, device_list=args.device_list,
        online_namespaces=args.online_namespaces, require_gpu_profile=args.require_gpu_profile,
    )
    return serve_dra_driver(config, interval=args.interval,
                            cgroup_root=Path(args.cgroup_root) if args.cgroup_root else None)


def _cmd_top(args: argparse.Namespace) -> int:
    from unisched.cli.top import run_top

    with _client(args, timeout=5.0) as client:
        return run_top(client, interval=args.interval, once=args.once)


COMMANDS = {
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
