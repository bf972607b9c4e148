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
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT, start_daemon, stop_daemon
from _results import header, run_info, write
from lease_tenants import CLOSE_S, SLOW_KEPT, SLOW_S, STALL_S, Window, library_worker, worker

sys.path.insert(0, str(ROOT))
from unisched.scheduler.config import DaemonConfig

PROBE_RENEW_S = 0.025
REGISTER_S = 120.0
"""Every tenant must be welcomed within this long of the clients' start, or the run gives up."""
DAEMON_LOG_KEPT = 256 * 1024
"""The daemon log's last bytes kept beside the results (overruns, dropped streams: why a round trip was slow)."""


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
    stop_daemon(daemon, work)
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
