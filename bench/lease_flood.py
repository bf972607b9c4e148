#!/usr/bin/env python3
"""Lease flood: one local user's connection floods the daemon with wants and releases; how long do other tenants'
renewals wait meanwhile?

--tenants tenants hold lease sessions (each has wanted compute). A probe tenant renews every --renew-ms on a
connection of its own and times each renewal's ack. First the probe runs --warmup seconds alone, then for --seconds
an attacker (one more tenant, one connection) writes a burst a second, each --pairs want + release pairs in one
write (32 bytes a pair: 2000 pairs are 64 KiB, one read for the daemon). Each want and release changes demand, and
each change asks the daemon for a decision that walks every tenant. The report gives the probe's round trips when
quiet and during the flood. With --root DIR the daemon runs from another checkout (to compare with an older
commit). CPU only: the daemon runs with --no-nvml.

  python3 bench/lease_flood.py --out DIR
  python3 bench/lease_flood.py --root /tmp/old-checkout --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT, start_daemon, stop_daemon
from _results import header, run_info, write
from lease_load import lease_socket_of, percentile

sys.path.insert(0, str(ROOT / "clients"))

WELCOME_S = 60.0
"""Every tenant must be welcomed within this long, or the run gives up."""


async def _session(path: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
    """A tenant's lease session: hello and want, then its welcome read."""
    from unisched_wire import unisched_pb2 as pb
    from unisched_wire.leasewire import MAGIC, MAX_REPLY_BYTES, FrameReader, frame

    r, w = await asyncio.open_unix_connection(path)
    w.write(MAGIC + frame(pb.LeaseRequest(seq=1, hello=pb.LeaseHello(tenant=name, weight=100)))
            + frame(pb.LeaseRequest(want=pb.LeaseWant(engine="compute"))))
    await w.drain()
    frames = FrameReader(MAX_REPLY_BYTES)
    while True:
        data = await asyncio.wait_for(r.read(1 << 16), WELCOME_S)
        if not data:
            raise SystemExit(f"lease_flood: the daemon ended {name}'s stream before welcoming it")
        if any(pb.LeaseReply.FromString(p).WhichOneof("kind") == "welcome" for p in frames.feed(data)):
            return r, w, frames


async def _drain(r: asyncio.StreamReader) -> None:
    while await r.read(1 << 20):
        pass


async def _measure(path: str, args: argparse.Namespace) -> dict[str, Any]:
    from unisched_wire import unisched_pb2 as pb
    from unisched_wire.leasewire import frame

    sessions = [await _session(path, f"flood-t{i}") for i in range(args.tenants)]
    pr, pw, pframes = await _session(path, "flood-probe")
    ar, aw, _ = await _session(path, "flood-attacker")
    drains = [asyncio.ensure_future(_drain(r)) for r, _, _ in [*sessions, (ar, aw, None)]]
    pair = (frame(pb.LeaseRequest(want=pb.LeaseWant(engine="compute")))
            + frame(pb.LeaseRequest(report=pb.LeaseReport(engine="compute", release=True))))
    burst = pair * args.pairs
    quiet: list[float] = []
    flood: list[float] = []
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    flood_at = t0 + args.warmup
    bursts = max(1, round(args.seconds))
    end = flood_at + bursts
    bursts_sent = 0
    seq = 1
    while (now := loop.time()) < end:
        if now >= flood_at + bursts_sent and bursts_sent < bursts:
            aw.write(burst)  # not drained: the attacker does not wait for the daemon to read it
            bursts_sent += 1
        seq += 1
        sent = time.monotonic()
        pw.write(frame(pb.LeaseRequest(seq=seq, report=pb.LeaseReport(engine="compute"))))
        acked = False
        while not acked:
            data = await asyncio.wait_for(pr.read(1 << 16), WELCOME_S)
            if not data:
                raise SystemExit("lease_flood: the daemon ended the probe's stream")
            acked = any(pb.LeaseReply.FromString(p).seq == seq for p in pframes.feed(data))
        (quiet if now < flood_at else flood).append(time.monotonic() - sent)
        await asyncio.sleep(max(0.0, args.renew_ms / 1000.0 - (time.monotonic() - sent)))  # pacing the renewals
    for _, w, _ in [*sessions, (pr, pw, None), (ar, aw, None)]:
        w.close()
    for d in drains:
        d.cancel()
    return {"bursts": bursts_sent, "burst_bytes": len(burst),
            "quiet_ms": {"round_trips": len(quiet), "p99": 1000 * percentile(quiet, 0.99),
                         "max": 1000 * max(quiet, default=float("nan"))},
            "flood_ms": {"round_trips": len(flood), "p99": 1000 * percentile(flood, 0.99),
                         "max": 1000 * max(flood, default=float("nan"))}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=200, help="tenants holding lease sessions (default 200)")
    ap.add_argument("--pairs", type=int, default=2000, help="want + release pairs in one burst (default 2000)")
    ap.add_argument("--seconds", type=float, default=5.0, help="how long the flood lasts, a burst a second (default 5)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds the probe renews before the flood (default 3)")
    ap.add_argument("--renew-ms", type=float, default=10.0, help="the probe's renewal period (default 10 ms)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout the daemon runs from (default this one)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.tenants < 0 or args.pairs < 1 or args.seconds < 1 or args.warmup <= 0 or args.renew_ms <= 0:
        ap.error("--tenants must be >= 0; --pairs and --seconds >= 1; --warmup and --renew-ms positive")
    work = Path(tempfile.mkdtemp(prefix="lease-flood-"))
    print(f"lease_flood: {args.tenants} tenants, then {args.seconds:g} s of bursts of {args.pairs} pairs", file=sys.stderr)
    daemon, sock = start_daemon(work, "--no-nvml", "--log-level", "warning", root=args.root.resolve())
    try:
        res = asyncio.run(_measure(lease_socket_of(sock), args))
    finally:
        stop_daemon(daemon, work)
    res = {**run_info(), "tenants": args.tenants, "pairs": args.pairs, **res}
    q, f = res["quiet_ms"], res["flood_ms"]
    md = (header(res) + f"{args.tenants} tenants; {res['bursts']} bursts of {args.pairs} want + release pairs "
          f"({res['burst_bytes']} bytes each) on one connection.\n\n"
          f"| the probe's renewals | round trips | p99 | max |\n|---|---|---|---|\n"
          f"| quiet | {q['round_trips']} | {q['p99']:.2f} ms | {q['max']:.2f} ms |\n"
          f"| during the flood | {f['round_trips']} | {f['p99']:.2f} ms | {f['max']:.2f} ms |\n")
    write(args.out, res, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
