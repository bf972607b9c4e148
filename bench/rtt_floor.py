#!/usr/bin/env python3
"""The floor under a lease renewal's round trip: a gRPC aio echo of the same messages (LeaseRequest -> LeaseReply)
on one bidirectional stream, with no engine behind it, served directly on a Unix socket and through the daemon's
PeerCredRelay (Unix socket -> relay -> loopback TCP -> gRPC), each with the daemon's server options. Compare with
bench/lease_load.py --tenants 1 (the whole daemon) at the same spacing to see what the relay and the daemon add.

  python3 bench/rtt_floor.py --renew-ms 25 --out bench/results/DATE-HOST/rtt-floor

The echo server runs in its own process (spawned), as the daemon does; the client is grpc.aio in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from unisched.transport import unisched_pb2 as pb
from unisched.transport import unisched_pb2_grpc as pb_grpc
from unisched.transport.options import SERVER_OPTIONS
from unisched.transport.peercred import PeerCredRelay


class _Echo(pb_grpc.UnischedServicer):
    async def Lease(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]
        while (req := await context.read()) is not grpc.aio.EOF:
            await context.write(pb.LeaseReply(seq=req.seq, ack=pb.LeaseAck(engine="compute", held=True, lease=1)))


def _serve(path: str, relay: bool, ready: Any) -> None:
    async def main() -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_UnischedServicer_to_server(_Echo(), server)  # type: ignore[no-untyped-call]
        if relay:
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            await PeerCredRelay(path, port).start()
        else:
            server.add_insecure_port(f"unix:{path}")
            await server.start()
        ready.put(True)
        await asyncio.Event().wait()

    asyncio.run(main())


async def _client(path: str, gap_s: float, n: int, warm: int) -> list[float]:
    channel = grpc.aio.insecure_channel(f"unix:{path}")
    call = pb_grpc.UnischedStub(channel).Lease()
    rtts = []
    for i in range(n + warm):
        t = time.perf_counter()
        await call.write(pb.LeaseRequest(seq=i + 1, report=pb.LeaseReport(engine="compute", gpu_seconds=0.001)))
        await call.read()
        if i >= warm:
            rtts.append(time.perf_counter() - t)
        if gap_s:
            await asyncio.sleep(gap_s)
    await call.done_writing()
    await channel.close()
    return sorted(rtts)


def measure(relay: bool, gap_s: float, n: int) -> dict[str, float]:
    path = tempfile.mktemp(prefix="rtt-floor-", suffix=".sock")
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    server = ctx.Process(target=_serve, args=(path, relay, ready), daemon=True)
    server.start()
    try:
        ready.get(timeout=60)
        rtts = asyncio.run(_client(path, gap_s, n, warm=max(20, n // 20)))
    finally:
        server.kill()
        server.join(10)
        Path(path).unlink(missing_ok=True)
    return {"p50_ms": 1000 * rtts[len(rtts) // 2], "p99_ms": 1000 * rtts[int(0.99 * len(rtts))],
            "max_ms": 1000 * rtts[-1], "n": len(rtts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--renew-ms", type=float, default=25.0, help="spacing of the messages; 0 = back to back")
    ap.add_argument("--count", type=int, default=800, help="measured round trips per path (default 800)")
    ap.add_argument("--rounds", type=int, default=2, help="alternate the two paths this many times (default 2)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = []
    for _ in range(args.rounds):
        for relay in (False, True):
            r = measure(relay, args.renew_ms / 1000.0, args.count)
            runs.append({"path": "relay" if relay else "direct", **r})
            print(f"rtt_floor: {runs[-1]}", file=sys.stderr)
    res = {"command": "python3 bench/rtt_floor.py " + " ".join(sys.argv[1:]),
           "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname(),
           "renew_ms": args.renew_ms, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    every = f"{args.renew_ms:g} ms" if args.renew_ms else "back to back"
    md = (f"Command: `{res['command']}` | {res['date_utc']} UTC | host {res['host']}\n\n"
          f"gRPC aio echo of a lease report, one stream, every {every}, no engine:\n\n"
          "| path | RTT p50 | RTT p99 | RTT max |\n|---|---|---|---|\n")
    for r in runs:
        md += f"| {r['path']} | {r['p50_ms']:.3f} ms | {r['p99_ms']:.3f} ms | {r['max_ms']:.1f} ms |\n"
    (args.out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
