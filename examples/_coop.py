"""What the numbered examples share: the unisched options, the client, and the share line they print.

Without --tenant an example runs without unisched (the baseline the benchmarks compare against)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "clients", ROOT / "examples" / "workloads"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from unisched_client import Client  # noqa: E402

__all__ = ["ROOT", "add_unisched_args", "connect", "share_line", "share_report"]


def add_unisched_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("unisched (cooperative client)")
    g.add_argument("--tenant", default=None, help="register as this tenant and gate GPU work on leases "
                                                  "(default: run without unisched)")
    g.add_argument("--weight", type=int, default=None, help="the tenant's weight (1..10000; default: keep / 100)")
    g.add_argument("--priority", choices=["online", "offline"], default=None)
    g.add_argument("--socket", default=os.environ.get("UNISCHED_SOCKET", "/run/unisched/unisched.sock"),
                   help="the daemon's socket (default: $UNISCHED_SOCKET or /run/unisched/unisched.sock)")
    g.add_argument("--gpu", type=int, default=0, help="GPU index (default 0)")
    g.add_argument("--fail-open", action="store_true", help="run ungoverned if the daemon is unreachable")


def connect(args: argparse.Namespace, engines: tuple[str, ...]) -> Client | None:
    if args.tenant is None:
        return None
    return Client(args.tenant, args.weight, socket=args.socket, priority=args.priority, gpu=args.gpu,
                  engines=engines, fail_open=args.fail_open)


def share_report(client: Client | None, engine: str) -> dict[str, Any]:
    """The tenant's target and measured share as the daemon sees it, and what the gate saw."""
    if client is None:
        return {"unisched": False}
    from unisched.transport.client import DaemonClient, DaemonError

    gate = client.gate(engine)
    out: dict[str, Any] = {"unisched": True, "tenant": client.tenant, "governed": client.governed,
                           "gpu_seconds_reported": round(gate.used_s, 3), "lease_wait_s": round(gate.waited_s, 3),
                           "revokes": gate.revokes, "lease_jumps": gate.jumps}
    try:
        with DaemonClient(client.socket, timeout=5) as d:
            me = next((t for t in d.tenants() if t.name == client.tenant), None)
    except DaemonError as e:
        out["share_error"] = str(e)
        return out
    if me is not None:
        out.update(weight=me.weight, target_share=round(me.target_share, 4), measured_share=round(me.measured_share, 4),
                   unit_ms=round(me.unit_ms, 2), turn_ms=round(me.turn_ms, 1))  # the turns its steps earned
    return out


def share_line(info: dict[str, Any]) -> str:
    if not info.get("unisched"):
        return "without unisched"
    if "measured_share" not in info:
        return f"tenant {info['tenant']} ({info.get('share_error', 'share unknown')})"
    return (f"tenant {info['tenant']} weight {info['weight']}: share {100 * info['measured_share']:.1f}% measured, "
            f"{100 * info['target_share']:.1f}% target")
