#!/usr/bin/env python3
"""The floor under a lease renewal's round trip, per candidate transport: the same messages (LeaseRequest ->
LeaseReply) echoed with no engine behind them, by a server in its own (spawned) process as the daemon is.

  direct      grpc.aio stream served directly on the Unix socket; client grpc.aio
  grpc-sync   the sync gRPC server (thread pool) directly on the Unix socket; client grpc.aio
  frame       length-framed protobuf on a Unix stream socket, served in an asyncio loop by a Protocol
              (SO_PEERCRED read on the accepted socket, no relay); client a blocking socket in its own thread
  frame-2t    the same server; the client sends from one thread and a reader thread receives the reply and wakes
              it (threading.Event), as a client library with pushed grants and revokes must
  frame-spin  as frame, but the client polls the socket (MSG_DONTWAIT) for up to --spin-us before blocking

Each is measured at --renew-ms spacing (0 = back to back), alternating the transports --rounds times.
Compare with bench/lease_load.py --tenants 1 (the whole daemon) at the same spacing.

  python3 bench/rtt_floor.py --renew-ms 25 --out bench/results/DATE-HOST/rtt-floor
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import os
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from unisched_wire import unisched_pb2 as pb

TRANSPORTS = ("direct", "grpc-sync", "frame", "frame-2t", "frame-spin")
_LEN = struct.Struct("<I")
_CRED = struct.Struct("3i")


def _ack(req: pb.LeaseRequest) -> pb.LeaseReply:
    return pb.LeaseReply(seq=req.seq, ack=pb.LeaseAck(engine="compute", held=True, lease=1))


_METHOD = "/unisched.bench.Echo/Lease"
"""The daemon's API has no gRPC lease call any more; the echo registers one of the same messages."""


async def _aio_echo(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
    while (req := await context.read()) is not grpc.aio.EOF:
        await context.write(_ack(req))


def _sync_echo(request_iterator: Any, context: grpc.ServicerContext) -> Any:
    for req in request_iterator:
        yield _ack(req)


def _echo_handler(fn: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("unisched.bench.Echo", {"Lease": grpc.stream_stream_rpc_method_handler(
        fn, request_deserializer=pb.LeaseRequest.FromString, response_serializer=pb.LeaseReply.SerializeToString)})


class _FrameEcho(asyncio.Protocol):
    """Length-prefixed LeaseRequest in, LeaseReply out, answered in data_received (one loop turn)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.t = transport
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= 4:
            (n,) = _LEN.unpack_from(self.buf)
            if len(self.buf) < 4 + n:
                return
            req = pb.LeaseRequest.FromString(bytes(self.buf[4:4 + n]))
            del self.buf[:4 + n]
            out = _ack(req).SerializeToString()
            self.t.write(_LEN.pack(len(out)) + out)


def _serve(transport: str, path: str, ready: Any) -> None:
    if transport == "grpc-sync":
        server = grpc.server(futures.ThreadPoolExecutor(4))
        server.add_generic_rpc_handlers((_echo_handler(_sync_echo),))
        server.add_insecure_port(f"unix:{path}")
        server.start()
        ready.put(os.getpid())
        server.wait_for_termination()
        return

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if transport.startswith("frame"):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(16)
            listener.setblocking(False)
            while True:
                conn, _ = await loop.sock_accept(listener)
                _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
                await loop.connect_accepted_socket(_FrameEcho, sock=conn)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_echo_handler(_aio_echo),))
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        ready.put(os.getpid())
        await asyncio.Event().wait()

    if transport.startswith("frame"):
        ready.put(os.getpid())  # the listener is bound before the first accept; the client retries connect
    asyncio.run(main())


def _request(i: int) -> pb.LeaseRequest:
    return pb.LeaseRequest(seq=i + 1, report=pb.LeaseReport(engine="compute", gpu_seconds=0.001))


async def _aio_client(path: str, gap_s: float, n: int, warm: int) -> list[float]:
    channel = grpc.aio.insecure_channel(f"unix:{path}")
    call = channel.stream_stream(_METHOD, request_serializer=pb.LeaseRequest.SerializeToString,
                                 response_deserializer=pb.LeaseReply.FromString)()
    rtts = []
    for i in range(n + warm):
        t = time.perf_counter()
        await call.write(_request(i))
        await call.read()
        if i >= warm:
            rtts.append(time.perf_counter() - t)
        if gap_s:
            await asyncio.sleep(gap_s)
    await call.done_writing()
    await channel.close()
    return rtts


def _connect(path: str) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _recv_frame(s: socket.socket, spin_s: float) -> bytes:
    """One framed reply; with spin_s > 0, poll without blocking that long before blocking."""
    buf = b""
    if spin_s:
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:
            try:
                buf = s.recv(65536, socket.MSG_DONTWAIT)
                break
            except BlockingIOError:
                continue
    while len(buf) < 4 or len(buf) < 4 + _LEN.unpack_from(buf)[0]:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf[4:]


def _frame_client(path: str, gap_s: float, n: int, warm: int, spin_s: float, two_threads: bool) -> list[float]:
    s = _connect(path)
    rtts = []
    got = threading.Event()
    if two_threads:
        def reader() -> None:
            try:
                while True:
                    pb.LeaseReply.FromString(_recv_frame(s, 0.0))
                    got.set()
            except (ConnectionError, OSError):
                return
        threading.Thread(target=reader, daemon=True).start()
    for i in range(n + warm):
        data = _request(i).SerializeToString()
        t = time.perf_counter()
        s.sendall(_LEN.pack(len(data)) + data)
        if two_threads:
            got.wait()
            got.clear()
        else:
            pb.LeaseReply.FromString(_recv_frame(s, spin_s))
        if i >= warm:
            rtts.append(time.perf_counter() - t)
        if gap_s:
            time.sleep(gap_s)
    s.close()
    return rtts


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine spent busy (all CPUs), from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (f[0] + f[1] + f[2] + f[5] + f[6] + f[7]) / os.sysconf("SC_CLK_TCK")


def measure(transport: str, gap_s: float, n: int, spin_s: float) -> dict[str, float]:
    path = tempfile.mktemp(prefix="rtt-floor-", suffix=".sock")
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    server = ctx.Process(target=_serve, args=(transport, path, ready), daemon=True)
    server.start()
    warm = max(20, n // 20)
    client: Callable[[], list[float]]
    if transport.startswith("frame"):
        client = lambda: _frame_client(path, gap_s, n, warm, spin_s if transport == "frame-spin" else 0.0,  # noqa: E731
                                       transport == "frame-2t")
    else:
        client = lambda: asyncio.run(_aio_client(path, gap_s, n, warm))  # noqa: E731
    try:
        pid = ready.get(timeout=60)
        cpu0, own0, busy0, t0 = _cpu_s(pid), time.process_time(), _busy_cpu_s(), time.perf_counter()
        rtts = sorted(client())
        wall = time.perf_counter() - t0
        server_cpu, client_cpu = _cpu_s(pid) - cpu0, time.process_time() - own0
        other_cpu = max(0.0, _busy_cpu_s() - busy0 - server_cpu - client_cpu)
    finally:
        server.kill()
        server.join(10)
        Path(path).unlink(missing_ok=True)
    return {"p50_ms": 1000 * rtts[len(rtts) // 2], "p99_ms": 1000 * rtts[int(0.99 * len(rtts))],
            "max_ms": 1000 * rtts[-1], "n": len(rtts),
            "server_cpu_pct": 100 * server_cpu / wall, "client_cpu_pct": 100 * client_cpu / wall,
            "other_cpu_pct": 100 * other_cpu / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--renew-ms", type=float, default=25.0, help="spacing of the messages; 0 = back to back")
    ap.add_argument("--count", type=int, default=800, help="measured round trips per transport and round (default 800)")
    ap.add_argument("--rounds", type=int, default=3, help="alternate the transports this many times (default 3)")
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma-separated, of {', '.join(TRANSPORTS)}")
    ap.add_argument("--spin-us", type=float, default=300.0, help="frame-spin: poll this long before blocking")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    chosen = args.transports.split(",")
    if bad := [t for t in chosen if t not in TRANSPORTS]:
        ap.error(f"unknown transports {bad}")
    runs = []
    for _ in range(args.rounds):
        for transport in chosen:
            r = measure(transport, args.renew_ms / 1000.0, args.count, args.spin_us / 1e6)
            runs.append({"path": transport, **r})
            print(f"rtt_floor: {runs[-1]}", file=sys.stderr)
    res = {"command": "python3 bench/rtt_floor.py " + " ".join(sys.argv[1:]),
           "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname(),
           "cpus": os.cpu_count(), "renew_ms": args.renew_ms, "spin_us": args.spin_us, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    every = f"{args.renew_ms:g} ms" if args.renew_ms else "back to back"
    md = (f"Command: `{res['command']}` | {res['date_utc']} UTC | host {res['host']} ({res['cpus']} CPUs)\n\n"
          f"Echo of a lease report, one connection, every {every}, no engine (CPU: % of one core over the run; "
          "anything else: the rest of the machine, other users' work):\n\n"
          "| transport | RTT p50 | RTT p99 | RTT max | server CPU | client CPU | anything else |\n"
          "|---|---|---|---|---|---|---|\n")
    for r in runs:
        md += (f"| {r['path']} | {r['p50_ms']:.3f} ms | {r['p99_ms']:.3f} ms | {r['max_ms']:.1f} ms | "
               f"{r['server_cpu_pct']:.0f} % | {r['client_cpu_pct']:.0f} % | {r['other_cpu_pct']:.0f} % |\n")
    (args.out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
