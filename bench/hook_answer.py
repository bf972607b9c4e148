#!/usr/bin/env python3
"""Per-answer cost of the seccomp session hooks without a GPU: the old answer path (every notification handled
on the daemon's asyncio loop) against the new one (a supervisor thread answers all but new sessions at once).

A child process installs the real filter, hands its listener over a socketpair (as runc does) and makes fake
NVIDIA RM calls on /dev/null (standing in for /dev/nvidiactl; a call let through fails there with ENOTTY, as in
tests/seccomp_child.py), timing every ioctl. It replays, --contexts times per run, what the driver allocated for
a context on the H200 (docs/design/memory.md and tests/test_gpu_hooks.py check them), alternately:

  cuda  a new RM client, device, subdevice, 8 x (channel 0xC86F, copy 0xC8B5, compute 0xCBC0), 12 more channels
        and copies, 8 TSGs 0xA06C, 71 memory objects 0x0040: 130 RM_ALLOCs, of which one asks `decide` (the
        first compute object; the other 7 join its session), then RM_FREE of the client
  egl   the RM calls an EGL app made on the H200 up to its last allocation (tests/data/h200_egl_rm_calls.jsonl,
        calls 1-125: 35 RM_ALLOCs, one of them the graphics object 0xCB97 that asks `decide`, 85 heap allocations
        RM_VID_HEAP_CONTROL and 5 RM_FREEs), its clients' handles moved to this context's, then RM_FREE of each
        client

Before each ioctl the tenant is busy for --gap-us (default 50 us; not timed): a driver does its own work between
two RM calls (a CUDA context start on the H200 spent ~2.6 ms per notified call), so the supervisor has gone
back to waiting when the next call comes, as it would there (with --gap-us 0 a tight loop of calls finds a
supervisor that is still awake, which flatters whichever path returns to waiting last). `decide` admits
everything and runs on the loop, like the engine's admit_session. The baseline is the same
ioctl with a request the filter does not notify (RM_CONTROL). The supervisor runs attached to an asyncio loop
in this process, which is idle or loaded (`--loads`):

  idle                nothing else on the loop
  blocking:MS/PERIOD  every PERIOD ms the loop blocks MS ms in a call that releases the GIL (as the engine's
                      tick does in NVML through ctypes and in cgroup file reads)
  cpu:MS/PERIOD       every PERIOD ms the loop runs MS ms of Python (holds the GIL)

"before" is unisched/enforce/seccomp.py at `--old-rev` (read with `git show`, loaded from a temp dir; the
filter and the examination code are the same), "after" is the working tree's seccomp/supervisor.py (a thread per listener, with
SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP where the kernel has it), "after, no sync wake-up" the same without that
flag. Writes results.json and results.md under --out.

  python3 bench/hook_answer.py --out bench/results/DATE-cpu/hook-answer
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime as dt
import functools
import importlib.util
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from _results import write  # noqa: E402

from unisched.enforce.nvclasses import (  # noqa: E402
    NVOS32_ALLOCS,
    NVOS32_SIZE,
    RM_ALLOC,
    RM_CONTROL,
    RM_FREE,
    RM_VID_HEAP_CONTROL,
)

OLD_REV = "c2c3ca1ba5addea81a651ea1dfe3843a5c93c90d"  # the last seccomp.py that answered on the asyncio loop
EGL_TRACE = ROOT / "tests" / "data" / "h200_egl_rm_calls.jsonl"
ROOT_CLASS, DEVICE, SUBDEVICE = 0x0041, 0x0080, 0x2080
CHANNEL, COPY, TSG, MEMORY = 0xC86F, 0xC8B5, 0xA06C, 0x0040
COMPUTE, GRAPHICS = 0xCBC0, 0xCB97
CATEGORIES = ("other alloc", "new session", "joined session object", "heap alloc", "free", "plain ioctl")
KINDS = ("cuda", "egl")


# --- the tenant ------------------------------------------------------------------------------------------------------
def iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


Call = tuple[str, int, tuple[int, ...], int]
"""(category, escape nr, the argument's leading 32-bit words, the argument's size) of one RM call."""


def context(kind: str, client: int) -> list[Call]:
    """Every RM call of one context, in the order made, ending with the free of its clients."""
    if kind == "egl":
        return egl_context(client)
    dev, sub = client + 1, client + 2
    calls: list[Call] = [("other alloc", RM_ALLOC, (client, client, client, ROOT_CLASS), 32),
                         ("other alloc", RM_ALLOC, (client, client, dev, DEVICE), 32),
                         ("other alloc", RM_ALLOC, (client, dev, sub, SUBDEVICE), 32)]
    h = client + 0x10

    def add(category: str, h_class: int, n: int) -> None:
        nonlocal h
        for _ in range(n):
            calls.append((category, RM_ALLOC, (client, sub, h, h_class), 32))
            h += 1

    for i in range(8):
        add("other alloc", CHANNEL, 1)
        add("other alloc", COPY, 1)
        add("new session" if i == 0 else "joined session object", COMPUTE, 1)
    add("other alloc", CHANNEL, 12)
    add("other alloc", COPY, 12)
    add("other alloc", TSG, 8)
    add("other alloc", MEMORY, 71)
    return [*calls, ("free", RM_FREE, (client, client, client), 16)]


@functools.cache
def egl_trace() -> tuple[dict[str, Any], ...]:
    """The trace's calls up to its last allocation (read once: every EGL context replays them)."""
    rows = [json.loads(line) for line in EGL_TRACE.read_text().splitlines() if line.strip()]
    last = max(i for i, r in enumerate(rows) if r["esc"] in ("0x2b", "0x4a"))
    return tuple(rows[:last + 1])


def egl_context(client: int) -> list[Call]:
    """The trace's calls up to its last allocation, each of its clients' handles (0xC1D0xxxx) moved to one of this
    context's (so that no two contexts share a session), heap allocations of video memory by size."""
    clients: dict[int, int] = {}

    def moved(handle: str) -> int:
        h = int(handle, 16)
        if h & 0xFFFFF000 != 0xC1D00000:
            return h
        return clients.setdefault(h, client + len(clients))

    calls: list[Call] = []
    for r in egl_trace():
        root = moved(r["root"])
        if r["esc"] == "0x2b":
            cls = int(r["cls"], 16)
            category = "new session" if cls == GRAPHICS else "other alloc"
            calls.append((category, RM_ALLOC, (root, moved(r["parent"]), moved(r["new"]), cls), 32))
        elif r["esc"] == "0x4a":  # hRoot, hObjectParent, function, ..., the size where that function keeps it
            function = int(r["function"])
            size_at = NVOS32_ALLOCS[function].size
            assert size_at is not None and size_at % 4 == 0
            words = [0] * (size_at // 4 + 2)
            words[0], words[1], words[2] = root, root, function
            words[size_at // 4], words[size_at // 4 + 1] = r["bytes"] & 0xFFFFFFFF, r["bytes"] >> 32
            calls.append(("heap alloc", RM_VID_HEAP_CONTROL, tuple(words), NVOS32_SIZE))
        else:
            calls.append(("free", RM_FREE, (root, root, moved(r["free"])), 16))
    return calls + [("free", RM_FREE, (c, c, c), 16) for c in sorted(clients.values())]


def rm_call(libc: ctypes.CDLL, dev: int, nr: int, words: tuple[int, ...], size: int, gap_ns: int) -> tuple[int, int]:
    """One RM call (escape `nr`, its argument's leading words, its size) on `dev`, after `gap_ns` of busy time (the
    driver's own work between two RM calls, not timed): the ioctl's return code and the ns it took."""
    buf = ctypes.create_string_buffer(size)
    ctypes.memmove(buf, (ctypes.c_uint32 * len(words))(*words), 4 * len(words))
    end = time.perf_counter_ns() + gap_ns
    while time.perf_counter_ns() < end:
        pass
    t0 = time.perf_counter_ns()
    rc = libc.ioctl(ctypes.c_int(dev), ctypes.c_ulong(iowr(nr, size)), buf)
    return rc, time.perf_counter_ns() - t0


def child(sock_fd: int, contexts: int, plain: int, gap_us: float) -> None:
    from unisched.enforce.seccomp.filter import install_filter
    from unisched.enforce.seccomp.handover import make_agent_message, send_fd

    libc = ctypes.CDLL(None, use_errno=True)
    listener = install_filter()
    with socket.socket(fileno=sock_fd) as sock:
        send_fd(sock, listener, make_agent_message(os.getpid(), metadata="bench"))
    os.close(listener)  # never keep our own listener
    dev = os.open("/dev/null", os.O_RDWR)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    if sys.stdin.readline().strip() != "go":
        return
    times: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    errnos: dict[str, dict[int, int]] = {c: {} for c in CATEGORIES}
    per_context: dict[str, list[list[int]]] = {k: [] for k in KINDS}  # [total ns, calls] per context
    gap_ns = int(gap_us * 1000)

    def call(category: str, nr: int, words: tuple[int, ...], size: int) -> int:
        rc, dt_ns = rm_call(libc, dev, nr, words, size, gap_ns)
        err = ctypes.get_errno() if rc < 0 else 0
        times[category].append(dt_ns)
        errnos[category][err] = errnos[category].get(err, 0) + 1
        return dt_ns

    for i in range(plain):
        call("plain ioctl", RM_CONTROL, (0xC1D00001, 0xC1D00001, 0x100 + i, MEMORY), 32)
    for c in range(contexts):
        kind = KINDS[c % len(KINDS)]
        client = 0xC1D00000 + (c << 12)
        total = 0
        calls = context(kind, client)
        for category, nr, words, size in calls:
            total += call(category, nr, words, size)
        per_context[kind].append([total, len(calls)])
    sys.stdout.write(json.dumps({"times": times, "errnos": errnos, "contexts": per_context}) + "\n")
    sys.stdout.flush()


# --- the daemon side -------------------------------------------------------------------------------------------------
def load_old(rev: str, tmp: Path) -> ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:unisched/enforce/seccomp.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = tmp / "seccomp_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("seccomp_before", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["seccomp_before"] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


class FakeEngine:
    """What the engine does for the hooks (admit_session / session_freed), and where it runs."""

    def __init__(self) -> None:
        self.sessions: dict[str, int] = {}
        self.decided = 0
        self.threads: set[str] = set()

    def decide(self, tenant: str, kind: Any, h_class: int) -> bool:
        self.decided += 1
        self.threads.add(threading.current_thread().name)
        self.sessions[str(kind)] = self.sessions.get(str(kind), 0) + 1
        return True

    def on_event(self, event: Any) -> None:
        if str(event.action) in ("aborted", "freed", "exited", "detached"):
            self.sessions[str(event.kind)] = max(0, self.sessions.get(str(event.kind), 0) - 1)


class Load:
    """Something else for the loop to do: "idle", "blocking:MS/PERIOD" (the loop blocks MS milliseconds every
    PERIOD in a call that releases the GIL, as NVML through ctypes does) or "cpu:MS/PERIOD" (MS of Python)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, spec: str) -> None:
        self.loop = loop
        self.handle: asyncio.TimerHandle | None = None
        self.kind, _, times = spec.partition(":")
        if self.kind not in ("idle", "blocking", "cpu"):
            raise ValueError(f"unknown load {spec!r}")
        busy, _, period = (times or "0/1").partition("/")
        self.busy_s, self.period_s = float(busy) / 1000, float(period) / 1000
        self.ticks = 0
        if self.kind != "idle":
            loop.call_soon_threadsafe(self._tick)

    def _tick(self) -> None:
        if self.kind == "stopped":
            return
        self.ticks += 1
        if self.kind == "blocking":
            time.sleep(self.busy_s)
        else:
            end = time.perf_counter() + self.busy_s
            while time.perf_counter() < end:
                sum(range(100))
        self.handle = self.loop.call_later(self.period_s - self.busy_s, self._tick)

    def stop(self) -> None:
        def cancel() -> None:
            if self.handle is not None:
                self.handle.cancel()
            self.kind = "stopped"

        on_loop(self.loop, cancel)


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> Any:
    async def run() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(run(), loop).result(30)


def one_run(mod: ModuleType, load: str, contexts: int, plain: int, gap_us: float, **options: Any) -> dict[str, Any]:
    from unisched.enforce.seccomp.agent import recv_agent_message

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, name="event-loop", daemon=True)
    runner.start()
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(theirs.fileno()), "--contexts", str(contexts),
                             "--plain", str(plain), "--gap-us", str(gap_us)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, pass_fds=[theirs.fileno()], cwd=ROOT)
    theirs.close()
    engine = FakeEngine()
    sup = None
    try:
        with ours:
            fd, _ = recv_agent_message(ours)
        sup = mod.SessionSupervisor(fd, "bench", engine.decide, engine.on_event, **options)
        on_loop(loop, lambda: sup.attach(loop))
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the tenant child did not start")
        busy = Load(loop, load)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        busy.stop()
        if not line:
            raise RuntimeError(f"the tenant child failed (exit {proc.wait(10)})")
        out: dict[str, Any] = json.loads(line)
        stats = sup.stats()
        out["supervisor"] = {"p50_us": stats.latency_p50_us, "p99_us": stats.latency_p99_us,
                             "notifications": stats.notifications, "errors": stats.errors,
                             "asked_loop": getattr(stats, "asked_loop", None),
                             "sync_wake_up": getattr(stats, "sync_wake_up", None)}
        out["engine"] = {"decided": engine.decided, "threads": sorted(engine.threads), "load_ticks": busy.ticks}
        out["loadavg_1m"] = os.getloadavg()[0]
        return out
    finally:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
        if sup is not None:
            on_loop(loop, sup.close)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(30)
        loop.close()


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    times: dict[str, list[float]] = {c: [] for c in CATEGORIES}
    errnos: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
    for r in runs:
        for c in CATEGORIES:
            times[c] += [ns / 1000.0 for ns in r["times"][c]]
            for e, n in r["errnos"][c].items():
                errnos[c][e] = errnos[c].get(e, 0) + n
    plain = statistics.median(times["plain ioctl"])
    cats = {}
    for c in CATEGORIES:
        xs = times[c]
        cats[c] = {"n": len(xs), "p50_us": pct(xs, 0.5), "p99_us": pct(xs, 0.99), "mean_us": statistics.fmean(xs),
                   "errnos": errnos[c]}
    per_kind = {}
    for kind in KINDS:
        added = [(total / 1000.0 - n * plain) / 1000.0 for r in runs for total, n in r["contexts"][kind]]
        calls = runs[0]["contexts"][kind][0][1] if runs[0]["contexts"][kind] else 0
        per_kind[kind] = {"contexts": len(added), "calls": calls, "added_ms_mean": statistics.fmean(added),
                          "added_ms_p50": pct(added, 0.5), "added_ms_p90": pct(added, 0.9), "added_ms_max": max(added)}
    return {"categories": cats, "plain_p50_us": plain, "contexts": per_kind,
            "supervisor": [r["supervisor"] for r in runs], "engine": [r["engine"] for r in runs],
            "loadavg_1m": [r["loadavg_1m"] for r in runs]}


def table(meta: dict[str, Any], results: dict[str, dict[str, Any]], loads: list[str]) -> list[str]:
    lines = [f"`{meta['command']}` on {meta['machine']}, {meta['date']}; before = seccomp.py at {meta['old_rev'][:12]}; "
             f"1-min load average during the runs {min(meta['loadavg'])}-{max(meta['loadavg'])}.", "",
             "Per ioctl as the tenant sees it, p50 / p99 (us); the plain ioctl (not notified) is the baseline.", "",
             "| loop load | path | other alloc | new session | joined session object | heap alloc | RM_FREE | plain |",
             "|---|---|---|---|---|---|---|---|"]
    for ld in loads:
        for impl, res in results.items():
            c = res[ld]["categories"]
            cells = " | ".join(f"{c[n]['p50_us']:.1f} / {c[n]['p99_us']:.1f}" for n in CATEGORIES)
            lines.append(f"| {ld} | {impl} | {cells} |")
    lines += ["", "Added per context (all its calls minus as many plain ioctls), ms: mean / p50 / p90 over the contexts.", "",
              "| loop load | path | " + " | ".join(f"{k} ({results['after'][loads[0]]['contexts'][k]['calls']} calls)"
                                                   for k in KINDS) + " |",
              "|---|---|" + "---|" * len(KINDS)]
    for ld in loads:
        for impl, res in results.items():
            k = res[ld]["contexts"]
            cells = " | ".join(f"{k[n]['added_ms_mean']:.2f} / {k[n]['added_ms_p50']:.2f} / {k[n]['added_ms_p90']:.2f}"
                               for n in KINDS)
            lines.append(f"| {ld} | {impl} | {cells} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--contexts", type=int, default=40, help="contexts per run (cuda and egl in turn)")
    ap.add_argument("--plain", type=int, default=2000, help="baseline ioctls per run")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gap-us", type=float, default=50.0,
                    help="busy time in the tenant before each ioctl (a real driver works between its RM calls)")
    ap.add_argument("--loads", default="idle,blocking:2/10,blocking:10/50,cpu:2/10")
    ap.add_argument("--old-rev", default=OLD_REV)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.contexts, args.plain, args.gap_us)
        return 0
    if args.out is None:
        ap.error("--out is required")
    from unisched.enforce.seccomp import supervisor as after
    from unisched.enforce.seccomp.abi import probe

    why = probe()
    if why is not None:
        print(f"hook_answer: seccomp user notification unavailable: {why}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="hook-answer-"))
    old = load_old(args.old_rev, tmp)
    impls: dict[str, tuple[ModuleType, dict[str, Any]]] = {
        "before": (old, {}),
        "after, no sync wake-up": (after, {"sync_wake_up": False}),
        "after": (after, {}),
    }
    loads = args.loads.split(",")
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {impl: {ld: [] for ld in loads} for impl in impls}
    for rep in range(args.repeat):
        for ld in loads:
            for impl, (mod, options) in impls.items():  # alternate, so drift hits them alike
                r = one_run(mod, ld, args.contexts, args.plain, args.gap_us, **options)
                raw[impl][ld].append(r)
                s = r["supervisor"]
                print(f"hook_answer: run {rep + 1}/{args.repeat} {ld} {impl}: {s['notifications']} answers, "
                      f"{r['engine']['decided']} decided on {r['engine']['threads']}, sync wake-up {s['sync_wake_up']}, "
                      f"load avg {r['loadavg_1m']:.2f}", file=sys.stderr)
    results = {impl: {ld: summarize(raw[impl][ld]) for ld in loads} for impl in impls}
    meta = {
        "command": shlex.join(["python3", "bench/hook_answer.py", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
                   f"Python {platform.python_version()}",
        "old_rev": args.old_rev,
        "contexts": args.contexts, "plain": args.plain, "repeat": args.repeat, "gap_us": args.gap_us,
        "loadavg": sorted({round(r["loadavg_1m"], 2) for i in raw.values() for rs in i.values() for r in rs}),
    }
    lines = table(meta, results, loads)
    write(args.out, {"meta": meta, "results": results}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
