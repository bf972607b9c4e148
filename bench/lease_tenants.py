"""The tenants of bench/lease_load.py, run in its worker processes: each speaks the lease stream on a connection of
its own (or is the client library's `Client`, --client library) and times its renewals within the shared `Window`.

Apart from lease_load.py, which starts the daemon and the workers, samples CPU and memory and writes the report:
this is the load itself, whose round trips are measured; the two share the `Window`, the limits below and what each
worker puts on the queue.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT

__all__ = ["CLOSE_S", "SLOW_KEPT", "SLOW_S", "STALL_S", "Window", "library_worker", "worker"]

STALL_S = 20.0
"""A write on a tenant's stream (hello, renewal, release, half-close) that takes longer counts it as STALLED."""
CLOSE_S = 120.0
"""After its half-close a tenant reads until the daemon ends the stream, this long at most (then STALLED)."""
SLOW_S = 0.1
"""A round trip this long is listed with when it was sent (the first SLOW_KEPT of each process): stalls that
every process sees at once are the daemon's, those one process sees alone are that client's."""
SLOW_KEPT = 100


class _Stalled(Exception):
    pass


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
