"""A/B of the seccomp answer path between two trees of this repository (e.g. main's and a branch's worktrees), on one
machine, the order alternating each round so that load hits both.

Each run is ../2026-12-06-cpu-3a21b5e-answer-floor/cmp.py's `product` run, in a process of its own importing the tree's
code: bench/hook_answer.py's tenant child makes 20 contexts of fake RM calls on /dev/null (CUDA and EGL in turn, 800 us
of busy time before each call) and the tree's SessionSupervisor answers them from a thread. Printed per run: the
tenant's mean time per call by context kind (as cmp.py prints it), the serving thread's CPU time per notification
(time.thread_time_ns around its serving) and its receipt-to-SEND time per notification (HookCounts.answer_s / calls).

--mode plain: the supervisor as cmp.py makes it (no ledger, no allowances, no pace, decide() on its thread);
--mode daemon: as hooks.SupervisedHooks makes one (a memory ledger, tenant and user allowances, a pace with a turnstile,
decide() on an event loop).

    python3 ab.py /work/wt-base /work/wt-answer --rounds 8 --mode plain     (as root)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any


def one(root: str, mode: str, gap_us: str) -> dict[str, Any]:
    """One run answered by `root`'s supervisor (in this process, which imported `root`'s code)."""
    import hook_answer as ha  # type: ignore[import-not-found]

    from unisched.enforce.seccomp.agent import recv_agent_message
    from unisched.enforce.seccomp.supervisor import SessionSupervisor

    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, ha.__file__, "--child", str(theirs.fileno()), "--contexts", "20",
                              "--plain", "20", "--gap-us", gap_us], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, pass_fds=[theirs.fileno()], cwd=root)
    theirs.close()
    fd, _ = recv_agent_message(ours)
    engine = ha.FakeEngine()
    if mode == "daemon":
        import asyncio

        from unisched.enforce.seccomp.allowance import Allowance
        from unisched.enforce.seccomp.budget import LISTENER_BURST, LISTENER_RATE, OWNER_BURST, OWNER_RATE, Pace, Rate, Turnstile
        from unisched.enforce.seccomp.hooks import TENANT_BOUNDS, USER_BOUNDS
        from unisched.enforce.seccomp.ledger import MemoryLedger

        lock = threading.Lock()
        pace = Pace(Rate(LISTENER_RATE, LISTENER_BURST), Rate(OWNER_RATE, OWNER_BURST), threading.Lock(), turnstile=Turnstile())
        sup = SessionSupervisor(fd, "bench", engine.decide, engine.on_event, memory=MemoryLedger(lambda: {}),
                                allowance=Allowance("bench", TENANT_BOUNDS, lock),
                                user_allowance=Allowance("user", USER_BOUNDS, lock), pace=pace)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        sup._loop = sup._events.loop = loop  # attach()'s, served from our own thread (for its CPU time)
        sup._serving = True
    else:
        sup = SessionSupervisor(fd, "bench", engine.decide, engine.on_event)
    cpu = [0]

    def serve() -> None:
        t = time.thread_time_ns()
        sup._serve() if mode == "daemon" else sup.serve_forever()
        cpu[0] = time.thread_time_ns() - t

    thread = threading.Thread(target=serve)
    thread.start()
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "ready"
    child.stdin.write("go\n")
    child.stdin.flush()
    out = json.loads(child.stdout.readline())
    child.stdin.close()
    child.wait()
    thread.join(10)
    per: dict[str, Any] = {k: statistics.mean(total / n for total, n in v) / 1000 for k, v in out["contexts"].items()}
    stats, counts = sup.stats(), sup.counts()
    per |= {"cpu": cpu[0] / stats.notifications / 1000, "lat": counts.answer_s / stats.notifications * 1e6,
            "n": stats.notifications, "errors": stats.errors}
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--mode", choices=("plain", "daemon"), default="plain")
    ap.add_argument("--gap-us", default="800")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        os.chdir(args.one)
        sys.path[:0] = [args.one, os.path.join(args.one, "bench")]
        import unisched

        assert unisched.__file__ is not None and unisched.__file__.startswith(args.one), unisched.__file__
        print(json.dumps(one(args.one, args.mode, args.gap_us)))
        return
    trees = {"old": args.old, "new": args.new}
    got: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for k in ("old", "new") if r % 2 == 0 else ("new", "old"):
            line = subprocess.run([sys.executable, __file__, args.old, args.new, "--mode", args.mode, "--gap-us", args.gap_us,
                                   "--one", trees[k]], capture_output=True, text=True, check=True).stdout.splitlines()[-1]
            d = json.loads(line)
            got[k].append(d)
            print(f"round {r + 1} {args.mode} {k}: us per call cuda {d['cuda']:.1f}, egl {d['egl']:.1f}; serving thread "
                  f"CPU {d['cpu']:.1f} us a notification, receipt to SEND {d['lat']:.1f} us; {d['n']} answered, "
                  f"{d['errors']} errors", flush=True)
    for k in trees:
        for f in ("cuda", "egl", "cpu", "lat"):
            xs = [d[f] for d in got[k]]
            print(f"{args.mode} {k} {f}: median {statistics.median(xs):.1f}, range {min(xs):.1f}-{max(xs):.1f}")


if __name__ == "__main__":
    main()
