"""A cooperative client doing CPU stand-in work (tests run it as a child: registering moves the process
into the tenant's cgroup). Prints one JSON line of what it saw, at the end.

Modes: normal (gate every unit; --parts N: each unit in N parts with a pause point between them, as
TorchStep.pause_points makes them), --ignore-revokes (reports work it did without holding a lease),
--bad-requests (sends malformed lease messages on a raw lease stream and prints the daemon's answers)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from unisched_client import Client, UnischedError
from unisched_client._inflight import InFlight
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import MAGIC, MAX_REPLY_BYTES, FrameReader, frame, lease_socket_for

ap = argparse.ArgumentParser()
ap.add_argument("--socket", required=True)
ap.add_argument("--tenant", required=True)
ap.add_argument("--weight", type=int, default=100)
ap.add_argument("--seconds", type=float, default=3.0)
ap.add_argument("--unit-ms", type=float, default=2.0)
ap.add_argument("--parts", type=int, default=1, help="pause points: each unit in this many parts")
ap.add_argument("--fail-open", action="store_true")
ap.add_argument("--ignore-revokes", action="store_true")
ap.add_argument("--bad-requests", action="store_true")
ap.add_argument("--ready-file", help="touched once registered")
ap.add_argument("--cpu-time", action="store_true",
                help="units of CPU time, timed by this thread's CPU clock: where a CPU core stands in for the GPU "
                     "(serve --cpu-stand-in) the time a unit used it, however loaded the machine")
ap.add_argument("--beside-cgroup",
                help="with --cpu-time: report each unit as a CUDA event pair times a GPU step, its own time plus the "
                     "work of the tenant in this cgroup directory (pinned to the same CPU) that ran between its start "
                     "and its end; other load on the machine is left out, as a GPU runs no one else's work")
ap.add_argument("--stop-file", help="also stop once this file exists (a test that waits for a state stops it when seen)")
args = ap.parse_args()


CLOCK = time.thread_time if args.cpu_time else time.perf_counter


def beside_s() -> float:
    """CPU seconds the --beside-cgroup tenant has used (0 without one)."""
    if not args.beside_cgroup:
        return 0.0
    stat = os.path.join(args.beside_cgroup, "cpu.stat")
    if os.path.exists(stat):
        with open(stat) as f:
            return next(int(line.split()[1]) / 1e6 for line in f if line.startswith("usage_usec"))
    with open(os.path.join(args.beside_cgroup.replace("/freezer/", "/cpuacct/"), "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


def burn(seconds: float) -> None:
    end = CLOCK() + seconds
    while CLOCK() < end:
        pass


def lease_stream(reqs: list[pb.LeaseRequest]) -> dict[str, object]:
    """Send the requests on a raw lease stream, read until the daemon closes it: its error, or OK."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(lease_socket_for(args.socket, os.environ))
        s.sendall(MAGIC + b"".join(frame(r) for r in reqs))
        s.shutdown(socket.SHUT_WR)
        reader, replies = FrameReader(MAX_REPLY_BYTES), []
        while data := s.recv(1 << 16):
            replies += [pb.LeaseReply.FromString(p) for p in reader.feed(data)]
    errors = [r.error for r in replies if r.HasField("error")]
    if errors:
        return {"code": errors[0].code, "details": errors[0].details}
    return {"code": "OK", "replies": len(replies)}


def bad_requests() -> None:
    cases = {
        "want_before_hello": [pb.LeaseRequest(want=pb.LeaseWant(engine="compute"))],
        "empty": [pb.LeaseRequest()],
        "bad_engine": [pb.LeaseRequest(hello=pb.LeaseHello(tenant=args.tenant)),
                       pb.LeaseRequest(want=pb.LeaseWant(engine="warp"))],
        "nan_report": [pb.LeaseRequest(hello=pb.LeaseHello(tenant=args.tenant)),
                       pb.LeaseRequest(report=pb.LeaseReport(engine="compute", gpu_seconds=float("nan")))],
        "second_hello": [pb.LeaseRequest(hello=pb.LeaseHello(tenant=args.tenant))] * 2,
        "bad_tenant": [pb.LeaseRequest(hello=pb.LeaseHello(tenant="../etc"))],
        "bad_gpu": [pb.LeaseRequest(hello=pb.LeaseHello(tenant=args.tenant, gpu=7))],
    }
    print(json.dumps({name: lease_stream(reqs) for name, reqs in cases.items()}))


if args.bad_requests:
    bad_requests()
    sys.exit(0)

try:
    client = Client(args.tenant, args.weight, socket=args.socket, fail_open=args.fail_open, connect_timeout=3.0)
except UnischedError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(3)
if args.ready_file:
    open(args.ready_file, "w").close()
gate = client.gate("compute")
unit = args.unit_ms / 1000.0
end = time.monotonic() + args.seconds
units = 0
# CPU work is done when it returns: a part is "finished" at once and its marker is the seconds it took
flight: InFlight[float] = InFlight(gate, done=lambda s: True, wait=lambda s: None, elapsed_s=lambda s: s)


def unit_in_parts() -> None:
    gate.acquire()
    spent = 0.0
    for k in range(args.parts):
        t0 = CLOCK()
        burn(unit / args.parts)
        spent += CLOCK() - t0
        if k + 1 < args.parts and flight.split_wanted():
            flight.split(spent)
            spent = 0.0
    flight.add(spent)


while time.monotonic() < end and not (args.stop_file and os.path.exists(args.stop_file)):
    if args.parts > 1:
        unit_in_parts()
        units += 1
        continue
    if not args.ignore_revokes:
        gate.acquire()
    elif not gate.wanting:
        gate.acquire()  # wants once, then runs whatever it holds
    t0, o0 = CLOCK(), beside_s()
    burn(unit)
    gate.done(CLOCK() - t0 + beside_s() - o0)
    units += 1
client.close()
print(json.dumps({
    "units": units, "used_s": round(gate.used_s, 4), "waited_s": round(gate.waited_s, 4), "revokes": gate.revokes,
    "connects": client.connects, "governed_at_end": client.governed, "splits": flight.splits,
}))
