"""The cooperative client: one lease stream to the daemon, one `Gate` per GPU engine.

The app's own thread only touches local state on the fast path (is my lease held, does my next unit of
work fit in the slice); a background thread reads the lease stream (grants, revokes, acks) and a second one
renews leases and reports measured GPU time ahead of need. No RPC per kernel launch or per frame.

The stream is a plain connection to the daemon's lease socket (unisched_wire.leasewire: $UNISCHED_LEASE_SOCKET,
else lease.sock beside the daemon's socket): whichever thread
has something to say writes it to the socket itself, under the client's lock, and the reader thread is the
only other one a renewal's answer wakes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import MAGIC, MAX_REPLY_BYTES, FrameError, FrameReader, frame, lease_socket_for
from unisched_wire.tenantenv import process_env

if TYPE_CHECKING:
    from unisched_client.torch import TorchStep

__all__ = ["DEFAULT_SOCKET", "Client", "CodecRefused", "Gate", "UnischedError", "UnischedUnavailable"]

log = logging.getLogger("unisched_client")


def _apply_env(env: Mapping[str, str]) -> None:
    """The daemon's settings for this tenant's processes (MPS client priority and SM cap, `unisched serve --mps`),
    applied at the first registration. CUDA reads them when the process first initializes it, so they take effect
    only where the Client is created before the process's first CUDA call (torch.cuda.is_available() is one);
    a program that cannot do that is started under `unisched run`, which sets them before it starts."""
    if not env:
        return
    torch = sys.modules.get("torch")
    late = torch is not None and torch.cuda.is_initialized()
    wanted = process_env(os.environ, env)
    for key in [k for k in os.environ if k not in wanted]:
        del os.environ[key]
    os.environ.update(wanted)
    if late:
        log.warning("CUDA was initialized before the unisched Client: its settings %s apply to child processes only; "
                    "create the Client first, or start the program under `unisched run`", sorted(env))

DEFAULT_SOCKET = os.environ.get("UNISCHED_SOCKET", "/run/unisched/unisched.sock")
ENGINES = ("compute", "graphics", "decode", "encode")
_PRIORITIES = {None: pb.PRIORITY_UNSPECIFIED, "online": pb.PRIORITY_ONLINE, "offline": pb.PRIORITY_OFFLINE}
_RETRY_MAX_S = 2.0
IDLE_CAP_S = 30.0
"""A gate with a unit acquired but never reported done is released after this long without use."""
SEND_TIMEOUT_S = 5.0
"""A write the daemon leaves unread this long (its socket buffer full) ends the connection, which is then
made again: the app's threads, which write under the client's lock, never wait on a stuck daemon for longer."""


class UnischedError(Exception):
    """The daemon refused a request (bad input, permission); str() says why."""


class UnischedUnavailable(UnischedError):
    """The daemon could not be reached when the client started (and fail_open was not asked for)."""


class CodecRefused(UnischedError):
    """The daemon did not admit a hardware codec session (cap reached, no such engine on this GPU)."""


class _Connection:
    """One connection of the lease stream: its writes (made under the client's lock) and its end."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, req: pb.LeaseRequest) -> None:
        self.write(frame(req))

    def write(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            self.broken()  # a partial write leaves the stream unreadable: the reader reconnects

    def broken(self) -> None:
        """Wake the reader with an error or EOF so that it connects again."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


@dataclass
class _Waiter:
    event: threading.Event
    reply: pb.LeaseReply | None = None


class Gate:
    """Leases on one engine. `acquire()` before a unit of GPU work, `done(gpu_seconds)` after it.

    A unit starts only while the lease is held and, when others wait for the engine, before the slice ends
    (the daemon's next decision renews the lease or revokes it): a unit may run past the slice, never start
    after it, so the overrun is at most one unit however late a revocation arrives. When the lease is
    revoked, the gate says so (yield) once its units are done, or at once when the app already waits in
    `acquire()` for the next one: then its queued unit (one while contended, see `InFlight`) still runs beside
    the next holder's first (measured and charged to their owner). Each report counts the units it covers, and
    the daemon gives a compute tenant with long steps turns of several of them (engine.leases.RUN_UNITS), so
    that hand-overs, which two time-sliced CUDA contexts pay for, come once per several steps. Draining them before the yield
    was tried on the H200 and lost more (a ResNet-50 pair at 3:1: sum 0.89 against 0.94): the next holder then
    started late into a slice that ends at the daemon's tick (bench/results/2026-12-01-h200-d/README.md).
    """

    def __init__(self, client: Client, engine: str) -> None:
        self.client = client
        self.engine = engine
        self.lease = 0
        self.contended = False
        self.slice_end = 0.0
        """When the current slice ends: with others waiting, no unit starts after it until the lease is renewed."""
        self.wanting = False
        self.pending_s = 0.0
        self.pending_units = 0
        """Units done since the last report: the daemon learns their length from the two (see LeaseReport.units)."""
        self.used_s = 0.0
        self.last_use = 0.0
        self.waited_s = 0.0
        self.revokes = 0
        self.blocked = False
        """An app thread waits in acquire(): the engine is wanted even though no unit ran lately."""
        self.open_units = 0
        """Units acquired and not yet reported done (a first CUDA step can take seconds)."""
        self.owes_yield = False
        self.jump = False
        """The last grant said our wants are granted at once (preemptive mode, online, no other online tenant):
        after a release the next unit starts as it asks, without the want's round trip."""
        self.jumps = 0

    @property
    def held(self) -> bool:
        return self.lease != 0

    def acquire(self, timeout: float | None = None) -> bool:
        """Block until this engine may be used; False on timeout. Passes at once when ungoverned, and, after a
        release, when the last grant said our wants are granted at once (`jump`: the daemon then revokes the
        offline holder as the want arrives, and the grant follows)."""
        c = self.client
        deadline = None if timeout is None else time.monotonic() + timeout
        with c._cond:
            now = start = time.monotonic()
            self.last_use = now
            self.blocked = True
            try:
                while True:
                    if not self.wanting:
                        self.wanting = True
                        c._send_locked(pb.LeaseRequest(want=pb.LeaseWant(engine=self.engine)))
                        if self.jump and c.governed and not self.lease:
                            self.jump = False  # once per release: the grant (or its absence) says the rest
                            self.jumps += 1
                            self.open_units += 1
                            return True
                    if not c.governed:
                        self.open_units += 1
                        return True
                    if self.lease and (not self.contended or now < self.slice_end):
                        self.waited_s += now - start
                        self.open_units += 1
                        return True
                    if self.owes_yield:
                        c._yield_locked(self)
                    elif self.lease and self.pending_s > 0:
                        c._flush_locked(self)  # slice over: charge it before the daemon decides the next
                    wait = None if deadline is None else deadline - now
                    if wait is not None and wait <= 0:
                        return False
                    c._cond.wait(wait)
                    now = time.monotonic()
            finally:
                self.blocked = False
                self.last_use = time.monotonic()

    def done(self, gpu_seconds: float, units: int = 1) -> None:
        """Report the measured GPU time of the unit just finished (sent with the next renewal). `units=0` for a
        part of a unit that a pause point ended (see `InFlight.split`): timed and charged, not counted as a unit,
        so the daemon still learns the whole step's length."""
        with self.client._cond:
            g = max(0.0, gpu_seconds)
            self.open_units = max(0, self.open_units - 1)
            self.pending_s += g
            self.pending_units += units
            self.used_s += g
            self.last_use = time.monotonic()
            if self.owes_yield and not self.open_units:
                self.client._yield_locked(self)

    def ending(self) -> bool:
        """Whether the lease was revoked: drain in-flight work now so the next holder starts clean."""
        with self.client._cond:
            return self.client.governed and not self.lease

    def release(self) -> None:
        """No more work on this engine for now: hand it on at once."""
        with self.client._cond:
            if self.wanting:
                self.wanting = False
                self.client._flush_locked(self, release=True)  # also the yield of a revoked lease
                self.lease = 0
                self.owes_yield = False

    def __enter__(self) -> Gate:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Client:
    """Register with the daemon as `tenant` and gate GPU work on leases.

    >>> client = Client(tenant="sim", weight=300)           # doctest: +SKIP
    >>> with client.step():                                  # PyTorch: one training/inference step
    ...     loss = model(x).sum(); loss.backward()

    `fail_open=True` runs ungoverned (with a warning) when the daemon is unreachable at start; without it
    the constructor raises UnischedUnavailable. Unreachable means no connection within `connect_timeout`; a
    daemon that accepted the connection but is slow to answer (a thousand tenants registering at once) is
    waited for up to `register_timeout` more, with a warning. Once connected, a daemon restart is survived: the client
    reconnects and registers again, and runs ungoverned meanwhile.
    """

    def __init__(
        self,
        tenant: str,
        weight: int | None = None,
        *,
        socket: str | None = None,
        priority: str | None = None,
        gpu: int = 0,
        engines: tuple[str, ...] = ("compute",),
        fail_open: bool = False,
        connect_timeout: float = 5.0,
        register_timeout: float = 60.0,
        renew_interval: float | None = None,
        idle_release_s: float | None = None,
    ) -> None:
        if priority not in _PRIORITIES:
            raise ValueError(f"priority must be 'online' or 'offline', got {priority!r}")
        bad = [e for e in engines if e not in ENGINES]
        if bad:
            raise ValueError(f"engines must be among {', '.join(ENGINES)}; got {bad}")
        self.tenant = tenant
        self.socket = lease_socket_for(socket or DEFAULT_SOCKET, os.environ)
        """The lease socket this client connects to (found from the daemon's socket, `socket`)."""
        self._hello = pb.LeaseHello(tenant=tenant, weight=weight or 0, priority=_PRIORITIES[priority],
                                    engines=list(engines), gpu=gpu)
        self._cond = threading.Condition()
        self._gates: dict[str, Gate] = {}
        self._seq = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        self._conn: _Connection | None = None
        """The connection while one is up (what requests are written to)."""
        self._retry_s = 0.05
        self._connect_timeout = connect_timeout
        self._closing = False
        self._fatal: str | None = None
        self.governed = False
        self.session = 0
        self.slice_s = 0.05
        self.valid_s = 0.25
        self.connects = 0
        self.tenant_info: pb.Tenant | None = None
        self._renew_interval = renew_interval
        self._idle_release_s = idle_release_s
        self._welcomed = threading.Event()
        self._stream_thread = threading.Thread(target=self._stream_loop, name="unisched-lease-stream", daemon=True)
        self._renew_thread = threading.Thread(target=self._renew_loop, name="unisched-lease-renew", daemon=True)
        self._stream_thread.start()
        welcomed = self._welcomed.wait(connect_timeout)
        if not welcomed and not self._fatal and self._transport_up():
            # a daemon registering a thousand tenants at once answers late, but it is there: wait for it
            log.warning("connected to the unisched daemon at %s, but it has not answered the registration in %g s "
                        "(busy?); waiting up to %g s more", self.socket, connect_timeout, register_timeout)
            waited = f"connected, but no answer to the registration within {connect_timeout + register_timeout:g} s"
            welcomed = self._welcomed.wait(register_timeout)
        else:
            waited = f"no answer within {connect_timeout:g} s"
        if not welcomed or self._fatal:
            why = self._fatal or waited
            if self._fatal and not self._fatal.startswith("unreachable"):
                self.close()
                raise UnischedError(f"the unisched daemon refused tenant {tenant!r}: {why}")
            if not fail_open:
                self.close()
                raise UnischedUnavailable(
                    f"cannot reach the unisched daemon at {self.socket} ({why}). Is `unisched serve` running? "
                    "Pass fail_open=True to run ungoverned when it is not."
                )
            log.warning("unisched daemon unreachable at %s (%s): running UNGOVERNED (fail_open=True); "
                        "will register when it appears", self.socket, why)
        self._renew_thread.start()

    # --- public API ---------------------------------------------------------------------------------
    def gate(self, engine: str = "compute") -> Gate:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")
        with self._cond:
            g = self._gates.get(engine)
            if g is None:
                g = self._gates[engine] = Gate(self, engine)
            return g

    def step(self, engine: str = "compute", stream: object = None) -> TorchStep:
        """PyTorch: `with client.step(): ...` gates one training or inference step (see unisched_client.torch)."""
        from unisched_client.torch import TorchStep

        return TorchStep(self.gate(engine), stream=stream)

    def renew(self, engine: str = "compute", timeout: float = 5.0) -> float:
        """Send a renewal (with the usage pending) and wait for its ack; returns the round trip in seconds."""
        g = self.gate(engine)
        with self._cond:
            g.wanting = True
            g.last_use = time.monotonic()
            req = self._report_locked(g)
        t0 = time.perf_counter()
        self._request(req, timeout)
        return time.perf_counter() - t0

    def codec_session(self, kind: str, timeout: float = 5.0) -> None:
        """Ask the daemon to admit a hardware codec session (nvdec | nvenc); raises CodecRefused."""
        reply = self._request(pb.LeaseRequest(session=pb.CodecSession(kind=kind, open=True)), timeout)
        if reply is not None and not reply.ack.admitted:
            raise CodecRefused(reply.ack.reason)

    def codec_session_closed(self, kind: str) -> None:
        self._send(pb.LeaseRequest(session=pb.CodecSession(kind=kind, open=False)))

    def close(self) -> None:
        """Release every engine and end the session (the daemon hands the GPU on at once)."""
        with self._cond:
            if self._closing:
                return
            for g in self._gates.values():
                if g.wanting:
                    g.wanting = False
                    self._flush_locked(g, release=True)
            self._closing = True
            conn = self._conn
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_WR)  # the daemon reads what was sent, then ends the session
            self._cond.notify_all()
        if self._stream_thread.is_alive() and threading.current_thread() is not self._stream_thread:
            self._stream_thread.join(2.0)
            if conn is not None and self._stream_thread.is_alive():
                conn.broken()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- sending --------------------------------------------------------------------------------------
    def _send_locked(self, req: pb.LeaseRequest) -> None:
        if self._conn is not None:
            self._conn.send(req)

    def _send(self, req: pb.LeaseRequest) -> None:
        with self._cond:
            self._send_locked(req)

    def _request(self, req: pb.LeaseRequest, timeout: float) -> pb.LeaseReply | None:
        """Send and wait for the ack with the same seq; None when ungoverned."""
        w = _Waiter(threading.Event())
        with self._cond:
            if not self.governed:
                return None
            req.seq = next(self._seq)
            self._waiters[req.seq] = w
            self._send_locked(req)
        if not w.event.wait(timeout):
            with self._cond:
                self._waiters.pop(req.seq, None)
            raise UnischedError(f"no answer from the daemon within {timeout:g} s")
        if self._fatal:
            raise UnischedError(self._fatal)
        return w.reply

    @staticmethod
    def _report_locked(g: Gate, release: bool = False, yielded: bool = False) -> pb.LeaseRequest:
        """The gate's pending usage as a report (taken: the next report starts from zero)."""
        s, g.pending_s = g.pending_s, 0.0
        n, g.pending_units = g.pending_units, 0
        return pb.LeaseRequest(report=pb.LeaseReport(engine=g.engine, gpu_seconds=s, units=n, release=release,
                                                     yielded=yielded))

    def _flush_locked(self, g: Gate, release: bool = False, yielded: bool = False) -> None:
        self._send_locked(self._report_locked(g, release, yielded))

    def _yield_locked(self, g: Gate) -> None:
        """The revoked lease's last unit is done: report it, and let the daemon hand the engine on."""
        g.owes_yield = False
        self._flush_locked(g, yielded=True)

    # --- the stream thread ------------------------------------------------------------------------------
    def _stream_loop(self) -> None:
        while not self._closing:
            why = self._stream_once()
            if why is None or self._closing:
                return
            self._disconnected(why)
            time.sleep(self._retry_s)
            self._retry_s = min(_RETRY_MAX_S, self._retry_s * 2)

    def _stream_once(self) -> str | None:
        """Connect, say hello (and want again what was wanted: after a reconnect), then read replies until the
        connection ends. Returns why it ended, or None when the daemon refused us (fatal) or we are closing."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.05, self._connect_timeout))
            sock.connect(self.socket)
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))
        except OSError as e:
            sock.close()
            return f"unreachable: {e.strerror or e}"
        conn = _Connection(sock)
        try:
            with self._cond:
                if self._closing:
                    return None
                self._conn = conn
                wants = [frame(pb.LeaseRequest(want=pb.LeaseWant(engine=g.engine)))
                         for g in self._gates.values() if g.wanting]
                conn.write(MAGIC + frame(pb.LeaseRequest(hello=self._hello)) + b"".join(wants))
            reader = FrameReader(MAX_REPLY_BYTES)
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    return "the daemon closed the stream"
                for payload in reader.feed(data):
                    reply = pb.LeaseReply.FromString(payload)
                    if reply.HasField("error"):
                        self._set_fatal(f"{reply.error.code}: {reply.error.details}")
                        return None
                    self._on_reply(reply)
                    self._retry_s = 0.05
        except (OSError, FrameError, DecodeError) as e:
            return f"lost the connection: {e}"
        finally:
            with self._cond:
                self._conn = None
            sock.close()

    def _transport_up(self) -> bool:
        """Whether the socket accepted us, whatever the daemon answered so far."""
        return self._conn is not None

    def _set_fatal(self, why: str) -> None:
        with self._cond:
            self._fatal = why
            self._disconnected_locked()
        self._welcomed.set()
        if self.connects:
            log.error("unisched daemon ended the lease session: %s; running UNGOVERNED", why)

    def _disconnected(self, why: str) -> None:
        with self._cond:
            was = self.governed
            self._disconnected_locked()
            if not self.connects:
                self._fatal = why  # for the constructor's message
                self._welcomed.set()
        if was:
            log.warning("lost the unisched daemon (%s): running UNGOVERNED until it is back", why)

    def _disconnected_locked(self) -> None:
        self.governed = False
        for g in self._gates.values():
            g.lease = 0
            g.jump = False  # a restarted daemon may see other online tenants: ask, until a grant says otherwise
        for w in self._waiters.values():
            w.event.set()
        self._waiters.clear()
        self._cond.notify_all()

    def _on_reply(self, reply: pb.LeaseReply) -> None:
        kind = reply.WhichOneof("kind")
        now = time.monotonic()
        with self._cond:
            if kind == "welcome":
                w = reply.welcome
                self.session, self.slice_s, self.valid_s = w.session, w.slice_s, w.valid_s
                self.tenant_info = w.tenant
                if self.connects == 0:
                    _apply_env(w.tenant.env)
                self.governed = True
                self._fatal = None
                self.connects += 1
                if self.connects > 1:
                    log.warning("re-registered with the unisched daemon as %s (session %d)", self.tenant, w.session)
                self._welcomed.set()
            elif kind == "grant":
                g = self._gates.get(reply.grant.engine)
                if g is not None:  # (a grant that comes after a short unit's release still says if we may jump)
                    g.jump = reply.grant.jump
                if g is not None and g.wanting:
                    g.lease = reply.grant.lease
                    g.contended = reply.grant.contended
                    g.slice_end = now + reply.grant.slice_left_s
                    g.owes_yield = False  # held again: the daemon waits for no hand-over from us
            elif kind == "revoke":
                g = self._gates.get(reply.revoke.engine)
                # a released gate owes no yield: its release handed the engine on, and a yield would read
                # as a renewal (a want) to the daemon, which would grant the engine again to nobody using it
                if g is not None and g.wanting and g.lease in (reply.revoke.lease, 0):
                    g.jump = False  # revoked while wanted: someone outranks us, wants wait for grants again
                    g.lease = 0
                    g.revokes += 1
                    g.owes_yield = True
                    if not g.open_units:
                        self._yield_locked(g)
            elif kind == "ack":
                waiter = self._waiters.pop(reply.seq, None)
                if waiter is not None:
                    waiter.reply = reply
                    waiter.event.set()
            self._cond.notify_all()

    # --- the renew thread -------------------------------------------------------------------------------
    def _renew_loop(self) -> None:
        """Renew held engines ahead of their expiry, with the usage measured since; release idle ones."""
        while True:
            with self._cond:
                if self._closing:
                    return
                contended = any(g.lease and g.contended for g in self._gates.values())
                # contended holders report often (their charges decide the next slice); others just renew
                interval = self._renew_interval or (min(self.slice_s / 2, self.valid_s / 4) if contended
                                                    else self.valid_s / 3)
                idle_s = self._idle_release_s or max(4 * self.slice_s, self.valid_s / 2)
                now = time.monotonic()
                if self.governed:
                    for g in self._gates.values():
                        if not g.wanting:
                            continue
                        idle = now - g.last_use
                        if not g.blocked and ((idle > idle_s and not g.open_units) or idle > IDLE_CAP_S):
                            g.wanting = False
                            g.lease = 0
                            g.owes_yield = False
                            self._flush_locked(g, release=True)
                        elif g.lease or g.pending_s > 0:  # holders renew; a waiting gate stays silent
                            self._flush_locked(g)
                self._cond.wait(interval)
