"""What `Gate.acquire()` costs an online client alone in preemptive mode (it jumps: no wait for a grant).

400 requests at 20 a second, each 5 ms of CPU work then a release, against a real `unisched serve --mode
preemptive` on a private socket. Prints the acquire times, how long the client's socket writes took, and the
daemon's replies by kind and by milliseconds after the acquire. Usage: python3 acq.py WORK_DIR [WARM_S]
(WARM_S: spin this long before each acquire, to tell a slow first touch after idle from the call itself).
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "clients"))
from _daemon import start_daemon

import unisched_client.client as ucc
from unisched_client import Client

EVENTS: list[tuple[float, str]] = []
SENDS: list[float] = []
_on_reply, _send_locked = ucc.Client._on_reply, ucc.Client._send_locked


def spy_reply(self: Any, reply: Any) -> None:
    EVENTS.append((time.monotonic(), reply.WhichOneof("kind")))
    _on_reply(self, reply)


def timed_send(self: Any, req: Any) -> None:
    t = time.perf_counter()
    _send_locked(self, req)
    SENDS.append(time.perf_counter() - t)


def main() -> None:
    work, warm = Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    work.mkdir(parents=True, exist_ok=True)
    ucc.Client._on_reply, ucc.Client._send_locked = spy_reply, timed_send  # type: ignore[method-assign]
    daemon, sock = start_daemon(work, "--mode", "preemptive")
    try:
        client = Client("acqonline", socket=sock, priority="online", connect_timeout=5)
        gate = client.gate("compute")
        waits, asked = [], []
        next_at = time.monotonic() + 0.3
        for _ in range(400):
            time.sleep(max(0.0, next_at - time.monotonic()))  # pacing the requests, as arrivals would
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < warm:
                pass
            asked.append(time.monotonic())
            t0 = time.perf_counter()
            gate.acquire()
            waits.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            while time.perf_counter() - t1 < 0.005:
                pass
            gate.done(time.perf_counter() - t1)
            gate.release()
            next_at += 0.05
        client.close()
    finally:
        daemon.terminate()
        daemon.wait()
    after: collections.Counter[tuple[str, int]] = collections.Counter()
    for t, kind in EVENTS:
        prev = max((a for a in asked if a <= t), default=None)
        if prev is not None:
            after[(kind, int((t - prev) * 1000))] += 1
    waits.sort()
    SENDS.sort()
    print(json.dumps({"n": len(waits), "p50_us": round(1e6 * waits[len(waits) // 2], 1),
                      "p90_us": round(1e6 * waits[int(len(waits) * 0.9)], 1),
                      "p99_us": round(1e6 * waits[int(len(waits) * 0.99)], 1), "jumps": gate.jumps,
                      "send_p50_us": round(1e6 * SENDS[len(SENDS) // 2], 1), "sends": len(SENDS),
                      "replies_by_ms_after_acquire": [[k, ms, n] for (k, ms), n in after.most_common(8)]}))


if __name__ == "__main__":
    main()
