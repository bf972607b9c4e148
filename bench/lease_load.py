#!/usr/bin/env python3
"""Lease load: N cooperative tenants renewing leases against one daemon; renewal round trips, daemon CPU and memory.

Each tenant is one lease stream (hello, want compute, then a renewal report every --renew-ms with a little GPU
time) on its own connection to the daemon's socket, spread over --procs worker processes running asyncio. A
renewal's round trip is from sending the report to receiving its ack (same seq). With --tenants 1 it is the idle
round trip lease enforcement's target is about (p99 <= 1 ms on the Unix socket). The daemon runs with --no-nvml
(CPU only) unless --nvml. With --client library the tenants are the client library's `Client` instead.

  python3 bench/lease_load.py --tenants 1 --seconds 10 --out bench/results/DATE-HOST/lease-rtt
  python3 bench/lease_load.py --tenants 1000 --seconds 60 --out bench/results/DATE-HOST/lease-load-1000

The measured window opens --warmup seconds after the last tenant was welcomed (a burst of a thousand
registrations is not the steady state measured; how long it took is reported), and only renewals sent within it
count (none is sent into the other tenants' teardown). After the window each tenant releases, half-closes and
keeps reading until the daemon ends its stream (CLOSE_S at most), so every stream is shut down cleanly. A
stream that ends before its tenant ends it is counted as lost, with why, when, and whether in the window or in the
shutdown after it; one whose writes stop completing (STALL_S) or that the daemon does not end in time is counted
as STALLED and cancelled, so a stall is reported instead of hanging the run.
The report also says how much CPU the clients and anything else on the machine used in the window (on 2 CPUs
another user's work skews it).

Writes results.json and results.md to --out and prints a summary; progress goes to stderr. For diagnosis:
LL_WORK=DIR keeps the daemon's socket, state and log in DIR; LL_LOG_LEVEL=info|debug sets the daemon's log level;
LL_SAMPLE=FILE.json runs the daemon under bench/stack_sampler.py (what blocked its event loop); LL_PROFILE=FILE.prof
under cProfile.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT, start_daemon
from _results import header, run_info, write

sys.path.insert(0, str(ROOT))
from unisched.scheduler.config import DaemonConfig

STALL_S = 20.0
"""A write on a tenant's stream (hello, renewal, release, half-close) that takes longer counts it as STALLED."""
CLOSE_S = 120.0
"""After its half-close a tenant reads until the daemon ends the stream, this long at most (then STALLED)."""
SLOW_S = 0.1
"""A round trip this long is listed with when it was sent (the first SLOW_KEPT of each process): stalls that
every process sees at once are the daemon's, those one process sees alone are that client's."""
SLOW_KEPT = 100
PROBE_RENEW_S = 0.025
REGISTER_S = 120.0
"""Every tenant must be welcomed within this long of the clients' start, or the run gives up."""
DAEMON_LOG_KEPT = 256 * 1024
"""The daemon log's last bytes kept beside the results (overruns, dropped streams: why a round trip was slow)."""


class _Stalled(Exception):
    pass


def lease_socket_of(sock: str) -> str:
    """Where the daemon on `sock` serves the lease stream: its lease socket beside it (a daemon of a checkout
    from before the lease stream had a socket of its own serves it on `sock` itself)."""
    from unisched_wire.leasewire import lease_socket_beside

    lease = lease_socket_beside(sock)
    return lease if os.path.exists(lease) else sock


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _tenant(sock: str, name: str, renew_s: float, window: Window,
                  rtts: list[float], counts: dict[str, int], lost: list[dict[str, Any]], t0: float,
                  slow: list[list[float]], before: list[float]) -> None:
    """One cooperative tenant on its own connection: hello, want, then a renewal report every renew_s (0: back to
    back), counted once the window opens (those sent before it but after the tenant's own welcome, while the others
    register, in `before`); after the window, release, half-close and read until the daemon ends the
    stream, then close. A stream that ends before the tenant ends it is recorded in `lost` (when, why, and whether
    in the window or in the shutdown after it)."""
    from unisched_wire import unisched_pb2 as pb
    from unisched_wire.leasewire import MAGIC, MAX_REPLY_BYTES, FrameReader, frame

    sent: dict[int, float] = {}
    acked = asyncio.Event()
    held = [False]  # usage is reported only while holding, as the client library does (else: overrun)
    welcomed_at = [math.inf]  # renewals sent before the tenant's own welcome waited for its registration
    ending = [False]

    def record(code: str, details: str) -> None:
        lost.append({"tenant": name, "at_s": round(time.monotonic() - t0, 3), "code": code, "details": details,
                     "phase": "shutdown" if ending[0] else "window", "debug": ""})

    try:
        reader, writer = await asyncio.open_unix_connection(sock)
    except OSError as e:
        record("CONNECT", repr(e))
        return

    async def op(data: bytes, what: str) -> None:
        """Every write is bounded: a stream whose writes stop completing is reported, not waited for."""
        writer.write(data)
        fut = asyncio.ensure_future(writer.drain())
        done, _ = await asyncio.wait([fut], timeout=STALL_S)
        if not done:
            record("STALLED", f"{what} not sent within {STALL_S:g} s")
            writer.transport.abort()
            fut.cancel()
            raise _Stalled
        fut.result()

    async def read_replies() -> None:
        """Reads every reply until the daemon ends the stream (also after the window)."""
        frames = FrameReader(MAX_REPLY_BYTES)
        while True:
            try:
                data = await reader.read(1 << 16)
            except OSError as e:
                record(type(e).__name__, str(e))
                acked.set()
                return
            if not data:
                if not ending[0]:
                    record("EOF", "the daemon ended the stream")
                acked.set()
                return
            for payload in frames.feed(data):
                reply = pb.LeaseReply.FromString(payload)
                kind = reply.WhichOneof("kind")
                if kind == "welcome":
                    welcomed_at[0] = time.monotonic()
                    window.welcomed()
                elif kind == "ack" and reply.seq in sent:
                    t = sent.pop(reply.seq)
                    rtt = time.monotonic() - t
                    if t >= window.start:
                        rtts.append(rtt)
                        if rtt >= SLOW_S and len(slow) < SLOW_KEPT:
                            slow.append([round(t - t0, 3), round(rtt * 1000, 1)])
                    elif t >= welcomed_at[0]:
                        before.append(rtt)
                    acked.set()
                elif kind == "grant":
                    counts["grants"] += 1
                    held[0] = True
                elif kind == "revoke":
                    counts["revokes"] += 1
                    held[0] = False
                elif kind == "error":
                    record(reply.error.code, reply.error.details)

    task: asyncio.Task[None] | None = None
    try:
        await op(MAGIC + frame(pb.LeaseRequest(hello=pb.LeaseHello(tenant=name, weight=100)))
                 + frame(pb.LeaseRequest(want=pb.LeaseWant(engine="compute"))), "hello")
        task = asyncio.create_task(read_replies())
        loop = asyncio.get_running_loop()
        next_at = loop.time() + renew_s * (hash(name) % 1000) / 1000.0  # spread the renewals
        seq = 0
        while time.monotonic() < window.end and not task.done():
            if renew_s > 0:
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                next_at += renew_s
                if time.monotonic() >= window.end:  # the window is over: none sent into the others' teardown
                    break
            seq += 1
            acked.clear()
            sent[seq] = time.monotonic()
            counts["sent"] += 1
            used = 0.001 if held[0] else 0.0
            await op(frame(pb.LeaseRequest(seq=seq, report=pb.LeaseReport(engine="compute", gpu_seconds=used))),
                     "renewal")
            if renew_s <= 0:  # back to back: the next renewal once this one's ack is in
                await acked.wait()
        if task.done():  # the stream ended under us (recorded by the reader)
            return
        ending[0] = True
        await op(frame(pb.LeaseRequest(report=pb.LeaseReport(engine="compute", release=True))), "release")
        writer.write_eof()  # the half-close: the daemon ends the session and then the stream
        done, _ = await asyncio.wait([task], timeout=CLOSE_S)
        if not done:
            record("STALLED", f"stream not ended by the daemon within {CLOSE_S:g} s of the half-close")
            task.cancel()
    except _Stalled:
        if task is not None:
            task.cancel()
    except OSError:  # a write after the stream ended: the reader records how
        if task is not None:
            await asyncio.wait([task], timeout=5)
            task.cancel()
    finally:
        writer.close()


class Window:
    """The measured window, shared by the main process and the workers: it opens --warmup seconds after the last
    tenant was welcomed (registration, a burst of cgroup creations, is not what is measured) and closes --seconds
    later. Times are time.monotonic(), one clock for every process of the machine."""

    def __init__(self, ctx: Any, seconds: float) -> None:
        self._start = ctx.Value("d", math.inf, lock=False)
        self._welcomed = ctx.Value("i", 0)
        self.seconds = seconds

    @property
    def start(self) -> float:
        return float(self._start.value)

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def open_at(self, t: float) -> None:
        self._start.value = t

    def welcomed(self) -> None:
        with self._welcomed.get_lock():
            self._welcomed.value += 1

    @property
    def registered(self) -> int:
        return int(self._welcomed.value)


def worker(names: list[str], sock: str, renew_s: float, start_at: float, window: Window, out: Any) -> None:
    async def main() -> None:
        rtts: list[float] = []
        before: list[float] = []
        slow: list[list[float]] = []
        lost: list[dict[str, Any]] = []
        counts = {"sent": 0, "grants": 0, "revokes": 0, "errors": 0, "lost": 0}
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(_tenant(sock, n, renew_s, window, rtts, counts, lost, t0, slow, before) for n in names),
            return_exceptions=True,
        )
        errors = [repr(r) for r in results if isinstance(r, BaseException)]
        counts["errors"] = len(errors)
        counts["lost"] = len(lost)
        out.put({"rtts": rtts, "before": before, "counts": counts, "errors": errors[:5], "lost": lost, "slow": slow,
                 "names": names})

    asyncio.run(main())


def library_worker(names: list[str], sock: str, renew_s: float, start_at: float, window: Window, out: Any) -> None:
    """--client library: each tenant is the client library's `Client` (its reader and renew threads), and a
    thread of this process calls `Client.renew()` every renew_s: the round trip an application sees."""
    import threading

    sys.path.insert(0, str(ROOT / "clients"))
    from unisched_client import Client, UnischedError

    rtts: list[float] = []
    before: list[float] = []
    lost: list[dict[str, Any]] = []
    counts = {"sent": 0, "grants": 0, "revokes": 0, "errors": 0, "lost": 0}
    errors: list[str] = []
    time.sleep(max(0.0, start_at - time.time()))
    clients = []
    for n in names:
        clients.append(Client(n, 100, socket=sock, register_timeout=120))
        window.welcomed()

    def run(client: Client) -> None:
        next_at = time.monotonic() + renew_s * (hash(client.tenant) % 1000) / 1000.0
        while True:
            if renew_s > 0:
                time.sleep(max(0.0, next_at - time.monotonic()))  # pacing the renewals, not waiting on a condition
                next_at += renew_s
            start = time.monotonic()
            if start >= window.end:
                break
            counts["sent"] += 1
            try:
                rtt = client.renew("compute")
            except UnischedError as e:
                errors.append(f"{client.tenant}: {e}")
                return
            (rtts if start >= window.start else before).append(rtt)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        counts["revokes"] += c.gate("compute").revokes
        c.close()
    counts["errors"] = len(errors)
    out.put({"rtts": rtts, "before": before, "counts": counts, "errors": errors[:5], "lost": lost, "slow": [],
             "names": names})


def wait_registered(window: Window, total: int, start_at: float, workers: list[Any]) -> float:
    """Seconds from the clients' start until every tenant was welcomed, with progress; exits when they are not
    all welcomed within REGISTER_S or a worker dies first."""
    last = -1
    while window.registered < total:
        if time.time() - start_at > REGISTER_S or any(w.exitcode is not None for w in workers):
            for w in workers:
                w.kill()
            raise SystemExit(f"lease_load: {window.registered} of {total} tenants registered within "
                             f"{time.time() - start_at:.0f} s; giving up")
        if window.registered // 100 != last:
            last = window.registered // 100
            print(f"lease_load: {window.registered}/{total} tenants registered", file=sys.stderr)
        time.sleep(0.05)  # polling a shared counter the workers raise
    return max(0.0, time.time() - start_at)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine spent busy (all CPUs; user, system, interrupts, steal), from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (f[0] + f[1] + f[2] + f[5] + f[6] + f[7]) / os.sysconf("SC_CLK_TCK")


def proc_stats(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and resident memory in bytes of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window (default 60)")
    ap.add_argument("--warmup", type=float, default=5.0,
                    help="unmeasured seconds after the last tenant registered (default 5)")
    ap.add_argument("--renew-ms", type=float, default=100.0,
                    help="each tenant renews this often (default 100); 0 = back to back, each after the last ack")
    ap.add_argument("--lease-timeout-ms", type=float, default=3000.0,
                    help="daemon --lease-timeout-ms; keep it well above --renew-ms (default 3000)")
    ap.add_argument("--slice-ms", type=float, default=DaemonConfig().slice_ms,
                    help="unisched serve --slice-ms (default: the daemon's, %(default)g)")
    ap.add_argument("--procs", type=int, default=0, help="client worker processes (default: 1 per 250 tenants, >= 1)")
    ap.add_argument("--client", choices=("protocol", "library"), default="protocol",
                    help="protocol: asyncio speaking the lease stream (default); library: unisched_client.Client, "
                         "renewals by Client.renew() from a thread per tenant (for a few tenants)")
    ap.add_argument("--nvml", action="store_true", help="let the daemon use NVML (default: --no-nvml)")
    ap.add_argument("--probe", action="store_true",
                    help="one more tenant in a process of its own, renewing every 25 ms: its round trip is reported "
                         "apart (a stall it shares with the load is the daemon's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.tenants < 1 or args.seconds <= 0 or args.renew_ms < 0:
        ap.error("--tenants and --seconds must be positive, --renew-ms not negative")
    procs = args.procs or max(1, (args.tenants + 249) // 250)
    work = Path(os.environ.get("LL_WORK") or tempfile.mkdtemp(prefix="lease-load-"))
    work.mkdir(parents=True, exist_ok=True)
    prefix = f"ll{os.getpid() % 10000}-"
    daemon, sock = start_daemon(
        work, "--slice-ms", f"{args.slice_ms:g}", "--lease-timeout-ms", f"{args.lease_timeout_ms:g}",
        "--log-level", os.environ.get("LL_LOG_LEVEL", "warning"), "--log-format", "json",
        *(() if args.nvml else ("--no-nvml",)),
        sample=Path(os.environ["LL_SAMPLE"]).resolve() if os.environ.get("LL_SAMPLE") else None,
        profile=Path(os.environ["LL_PROFILE"]).resolve() if os.environ.get("LL_PROFILE") else None,
    )
    print(f"lease_load: daemon pid {daemon.pid}; {args.tenants} tenants over {procs} processes, renew every "
          f"{args.renew_ms:g} ms, {args.warmup:g} s warm-up + {args.seconds:g} s", file=sys.stderr)
    names = [f"{prefix}{i}" for i in range(args.tenants)]
    ctx = mp.get_context("fork")
    q: Any = ctx.Queue()
    window = Window(ctx, args.seconds)
    start_at = time.time() + 1.0
    workers = [ctx.Process(
        target=worker if args.client == "protocol" else library_worker,
        args=(names[i::procs], sock if args.client == "library" else lease_socket_of(sock), args.renew_ms / 1000.0,
              start_at, window, q))
        for i in range(procs)]
    probe = f"{prefix}probe"
    if args.probe:
        workers.append(ctx.Process(target=worker, args=(
            [probe], lease_socket_of(sock), PROBE_RENEW_S, start_at, window, q)))
    for w in workers:
        w.start()
    pids = [w.pid for w in workers if w.pid is not None]  # every started process has one
    registration_s = wait_registered(window, args.tenants + args.probe, start_at, workers)
    window.open_at(time.monotonic() + args.warmup)
    time.sleep(args.warmup)
    cpu0, _ = proc_stats(daemon.pid)
    clients0, busy0, self0 = sum(proc_stats(pid)[0] for pid in pids), busy_cpu_s(), sum(os.times()[:2])
    t0 = time.monotonic()
    rss_max = 0
    while time.monotonic() - t0 < args.seconds:
        time.sleep(1.0)
        _, rss = proc_stats(daemon.pid)
        rss_max = max(rss_max, rss)
        done = int(time.monotonic() - t0)
        if done % 10 == 0:
            print(f"lease_load: {done:.0f}/{args.seconds:g} s, daemon RSS {rss / 2**20:.0f} MiB", file=sys.stderr)
    cpu1, _ = proc_stats(daemon.pid)
    clients1, busy1, self1 = sum(proc_stats(pid)[0] for pid in pids), busy_cpu_s(), sum(os.times()[:2])
    elapsed = time.monotonic() - t0
    parts = [q.get(timeout=120 + 2 * STALL_S + CLOSE_S) for _ in workers]
    for w in workers:
        w.join(30)
    import resource

    clients_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    clients_cpu_s = clients_cpu.ru_utime + clients_cpu.ru_stime  # the workers' whole run, registration included
    daemon.send_signal(signal.SIGTERM)
    daemon.wait(30)
    # remove the tenants' cgroups the daemon created
    subprocess.run([sys.executable, "-c", f"""
import sys; sys.path.insert(0, {str(ROOT)!r})
from unisched.enforce.cgroups import detect_driver
d = detect_driver('auto')
for cg in d.managed():
    if cg.rsplit('/', 1)[-1].startswith({prefix!r}) and not d.pids(cg):
        d.remove(cg)
"""], check=False)
    probed = [p for p in parts if p["names"] == [probe]]
    parts = [p for p in parts if p["names"] != [probe]]
    probe_rtts = [x for p in probed for x in p["rtts"]]
    before = [x for p in parts + probed for x in p["before"]]
    rtts = [x for p in parts for x in p["rtts"]]
    slow = sorted([x[0], x[1], i] for i, p in enumerate(parts) for x in p["slow"])
    counts = {k: sum(p["counts"][k] for p in parts) for k in parts[0]["counts"]}
    lost = sorted((x for p in parts for x in p["lost"]), key=lambda x: x["at_s"])
    reasons: dict[str, int] = {}
    for x in lost:
        key = f"{x['code']}: {x['details']} ({'in the window' if x['phase'] == 'window' else 'after the window'})"
        reasons[key] = reasons.get(key, 0) + 1
    lost_in_window = sum(1 for x in lost if x["phase"] == "window")
    res: dict[str, Any] = {
        **run_info(), "tenants": args.tenants, "client": args.client, "procs": procs, "registration_s": registration_s,
        "renew_ms": args.renew_ms, "seconds": args.seconds,
        "renewals": len(rtts), "renewals_per_s": len(rtts) / elapsed,
        "offered_per_s": args.tenants * 1000.0 / args.renew_ms if args.renew_ms else float("nan"),
        "rtt_ms": {"p50": 1000 * percentile(rtts, 0.5), "p99": 1000 * percentile(rtts, 0.99),
                   "max": 1000 * max(rtts, default=float("nan")),
                   "mean": 1000 * statistics.fmean(rtts) if rtts else float("nan")},
        "daemon_cpu_cores": (cpu1 - cpu0) / elapsed, "daemon_rss_mib_max": rss_max / 2**20,
        "clients_cpu_s_whole_run": clients_cpu_s, "clients_cpu_cores": (clients1 - clients0) / elapsed,
        # whatever else ran on the machine in the window (another user's tests skew a 2-CPU run)
        "other_cpu_cores": max(0.0, (busy1 - busy0) - (cpu1 - cpu0) - (clients1 - clients0) - (self1 - self0)) / elapsed,
        "counts": counts, "errors": [e for p in parts for e in p["errors"]][:10],
        "streams_lost": len(lost), "streams_lost_in_window": lost_in_window,
        "streams_lost_after_window": len(lost) - lost_in_window, "lost_by_reason": reasons,
        "lost_at_s": [min(x["at_s"] for x in lost), max(x["at_s"] for x in lost)] if lost else [],
        "lost_first": lost[:5],
        "slow": {"over_ms": SLOW_S * 1000, "count": sum(1 for x in rtts if x >= SLOW_S),
                 "processes": len({x[2] for x in slow}), "first_kept": slow[:SLOW_KEPT]},
        # renewals sent after the tenant's welcome and before the window (while the others registered, and in the
        # warm-up): what a burst of registrations costs the tenants already registered
        "rtt_before_window_ms": {"round_trips": len(before), "p99": 1000 * percentile(before, 0.99),
                                 "max": 1000 * max(before, default=float("nan"))},
        "probe_rtt_ms": None if not args.probe else {
            "every_ms": PROBE_RENEW_S * 1000, "round_trips": len(probe_rtts), "p50": 1000 * percentile(probe_rtts, 0.5),
            "p99": 1000 * percentile(probe_rtts, 0.99), "max": 1000 * max(probe_rtts, default=float("nan"))},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    log = (work / "daemon.log").read_bytes()  # at --log-level warning: what went wrong there, if anything
    (args.out / "daemon.log").write_bytes(log[-DAEMON_LOG_KEPT:])
    every = f"{args.renew_ms:g} ms" if args.renew_ms else "back to back"
    md = (header(res)
          + f"| tenants | renew every | renewals/s (offered) | RTT p50 | RTT p99 | RTT max | daemon CPU | daemon RSS |\n"
          f"|---|---|---|---|---|---|---|---|\n"
          f"| {args.tenants} | {every} | {res['renewals_per_s']:.0f} ({res['offered_per_s']:.0f}) | "
          f"{res['rtt_ms']['p50']:.3f} ms | {res['rtt_ms']['p99']:.3f} ms | {res['rtt_ms']['max']:.1f} ms | "
          f"{100 * res['daemon_cpu_cores']:.0f}% of a core | {res['daemon_rss_mib_max']:.0f} MiB |\n")
    bw = res["rtt_before_window_ms"]
    md += (f"\nEvery tenant registered {registration_s:.1f} s after the first was started; the window opened "
           f"{args.warmup:g} s later. Renewals of registered tenants before it, while the others registered: "
           f"{bw['round_trips']}, p99 {bw['p99']:.1f} ms, max {bw['max']:.1f} ms.\n")
    md += (f"\nIn the window: clients {res['clients_cpu_cores']:.2f} cores, anything else on the machine "
           f"{res['other_cpu_cores']:.2f} cores (of {os.cpu_count()}).\n")
    md += (f"\nStreams lost: {len(lost)} of {args.tenants} ({lost_in_window} in the window, "
           f"{len(lost) - lost_in_window} in the shutdown after it)")
    md += (" (" + "; ".join(f"{n} {r}" for r, n in reasons.items())
           + f"; at {res['lost_at_s'][0]:.1f}..{res['lost_at_s'][1]:.1f} s from the clients' start)\n" if lost else "\n")
    sl = res["slow"]
    if sl["count"]:
        md += (f"\nRound trips over {sl['over_ms']:g} ms: {sl['count']}, in {sl['processes']} of {procs} client "
               f"processes; the first at {slow[0][0]:.1f} s from the clients' start (results.json lists them).\n")
    if res["probe_rtt_ms"] is not None:
        pr = res["probe_rtt_ms"]
        md += (f"\nThe probe (one more tenant in a process of its own, every {pr['every_ms']:g} ms): "
               f"p50 {pr['p50']:.3f} ms, p99 {pr['p99']:.3f} ms, max {pr['max']:.1f} ms.\n")
    if res["errors"]:
        md += "\nErrors: " + "; ".join(res["errors"]) + "\n"
    write(args.out, res, md)
    print(md)
    return 0 if not res["errors"] and not lost else 1


if __name__ == "__main__":
    sys.exit(main())
