"""The cooperative client: one lease stream to the daemon, one `Gate` per GPU engine.

The app's own thread only touches local state on the fast path (is my lease held, does my next unit of
work fit in the slice); a background thread reads the lease stream (grants, revokes, acks) and a second one
renews leases and reports measured GPU time ahead of need. No RPC per kernel launch or per frame.

The parts: `connection` (the socket and its frames), `gate` (one engine's lease and the rule for starting a
unit), `renewals` (when the renew thread speaks), `clock` (all timing, injected). This module is the facade:
registration, the reader thread, requests that wait for their ack.
The stream is a plain connection to the daemon's lease socket (unisched_wire.leasewire: $UNISCHED_LEASE_SOCKET,
else lease.sock beside the daemon's socket).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from unisched_client import renewals
from unisched_client.clock import Clock, SystemClock, wait_for
from unisched_client.connection import DEFAULT_SOCKET, Connection, dial, lease_socket_path, opening
from unisched_client.errors import CodecRefused, UnischedError, UnischedUnavailable
from unisched_client.gate import Gate
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import FrameError
from unisched_wire.tenantenv import process_env

if TYPE_CHECKING:
    from unisched_client.torch import TorchStep

__all__ = ["DEFAULT_SOCKET", "Client", "CodecRefused", "Gate", "UnischedError", "UnischedUnavailable"]

log = logging.getLogger("unisched_client")


def _apply_env(env: Mapping[str, str]) -> None:
    """The daemon's settings for this tenant's processes (how the GPU driver waits; MPS client priority and SM cap,
    `unisched serve --mps`), applied at the first registration. The drivers read them when the process first
    initializes them, so they take effect only where the Client is created before the process's first CUDA call
    (torch.cuda.is_available() is one); a program that cannot do that is started under `unisched run`, which sets
    them before it starts."""
    if not env:
        return
    torch = sys.modules.get("torch")
    for_cuda = sorted(k for k in env if k.startswith("CUDA_"))  # (the driver's wait setting is GL's, not CUDA's)
    late = bool(for_cuda) and torch is not None and torch.cuda.is_initialized()
    wanted = process_env(os.environ, env)
    for key in [k for k in os.environ if k not in wanted]:
        del os.environ[key]
    os.environ.update(wanted)
    if late:
        log.warning("CUDA was initialized before the unisched Client: its settings %s apply to child processes only; "
                    "create the Client first, or start the program under `unisched run`", for_cuda)

ENGINES = ("compute", "graphics", "decode", "encode")
_PRIORITIES = {None: pb.PRIORITY_UNSPECIFIED, "online": pb.PRIORITY_ONLINE, "offline": pb.PRIORITY_OFFLINE}
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 2.0
"""Reconnect back-off: doubling from a twentieth of a second (a daemon restart is back within a few) up to
two seconds (a daemon that is gone costs a connect attempt every two seconds)."""
CLOSE_JOIN_S = 2.0
"""close() waits this long (real time) for the daemon to end the session before breaking the connection."""


@dataclass
class _Waiter:
    """A request waiting for its ack (answered with reply None when the connection is lost)."""

    answered: bool = False
    reply: pb.LeaseReply | None = None


class Client:
    """Register with the daemon as `tenant` and gate GPU work on leases.

    >>> client = Client(tenant="sim", weight=300)           # doctest: +SKIP
    >>> with client.step():                                  # PyTorch: one training/inference step
    ...     loss = model(x).sum(); loss.backward()

    `fail_open=True` runs ungoverned (with a warning) when the daemon is unreachable at start; without it
    the constructor raises UnischedUnavailable. Unreachable means no connection within `connect_timeout`; a
    daemon that accepted the connection but is slow to answer (a thousand tenants registering at once) is
    waited for up to `register_timeout` more, with a warning. Once connected, a daemon restart is survived: the client
    reconnects and registers again, and runs ungoverned meanwhile. `clock` times everything the client waits
    for (tests pass a `unisched_client.clock.FakeClock`).
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
        clock: Clock | None = None,
    ) -> None:
        if priority not in _PRIORITIES:
            raise ValueError(f"priority must be 'online' or 'offline', got {priority!r}")
        bad = [e for e in engines if e not in ENGINES]
        if bad:
            raise ValueError(f"engines must be among {', '.join(ENGINES)}; got {bad}")
        self.tenant = tenant
        self.socket = lease_socket_path(socket)
        self.clock: Clock = clock or SystemClock()
        self._hello = pb.LeaseHello(tenant=tenant, weight=weight or 0, priority=_PRIORITIES[priority],
                                    engines=list(engines), gpu=gpu)
        self._cond = threading.Condition()
        self._gates: dict[str, Gate] = {}
        self._seq = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        self._conn: Connection | None = None
        """The connection while one is up (what requests are written to)."""
        self._retry_s = RETRY_FIRST_S
        self._connect_timeout = connect_timeout
        self._closing = False
        self._fatal: str | None = None
        self._answered = False
        """The daemon welcomed or refused us, or (before any connection) could not be reached: the constructor's
        wait is over."""
        self.governed = False
        self.session = 0
        self.slice_s = 0.05
        self.valid_s = 0.25
        self.connects = 0
        self.tenant_info: pb.Tenant | None = None
        self._renew_interval = renew_interval
        self._idle_release_s = idle_release_s
        self._stream_thread = threading.Thread(target=self._stream_loop, name="unisched-lease-stream", daemon=True)
        self._renew_thread = threading.Thread(target=self._renew_loop, name="unisched-lease-renew", daemon=True)
        self._stream_thread.start()
        self._register(fail_open, connect_timeout, register_timeout)
        self._renew_thread.start()

    def _register(self, fail_open: bool, connect_timeout: float, register_timeout: float) -> None:
        """Wait for the stream thread's first answer: the welcome, a refusal, or unreachable."""
        with self._cond:
            welcomed = wait_for(self.clock, self._cond, lambda: self._answered, connect_timeout)
            busy = not welcomed and not self._fatal and self._transport_up()
        if busy:
            # a daemon registering a thousand tenants at once answers late, but it is there: wait for it
            log.warning("connected to the unisched daemon at %s, but it has not answered the registration in %g s "
                        "(busy?); waiting up to %g s more", self.socket, connect_timeout, register_timeout)
            waited = f"connected, but no answer to the registration within {connect_timeout + register_timeout:g} s"
            with self._cond:
                welcomed = wait_for(self.clock, self._cond, lambda: self._answered, register_timeout)
        else:
            waited = f"no answer within {connect_timeout:g} s"
        if welcomed and not self._fatal:
            return
        why = self._fatal or waited
        if self._fatal and not self._fatal.startswith("unreachable"):
            self.close()
            raise UnischedError(f"the unisched daemon refused tenant {self.tenant!r}: {why}")
        if not fail_open:
            self.close()
            raise UnischedUnavailable(
                f"cannot reach the unisched daemon at {self.socket} ({why}). Is `unisched serve` running? "
                "Pass fail_open=True to run ungoverned when it is not."
            )
        log.warning("unisched daemon unreachable at %s (%s): running UNGOVERNED (fail_open=True); "
                    "will register when it appears", self.socket, why)

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
            g.last_use = self.clock.monotonic()
            req = g.report_locked()
        t0 = self.clock.monotonic()
        self._request(req, timeout)
        return self.clock.monotonic() - t0

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
                    g.flush_locked(release=True)
            self._closing = True
            conn = self._conn
            if conn is not None:
                conn.finish()
            self._cond.notify_all()
        if self._stream_thread.is_alive() and threading.current_thread() is not self._stream_thread:
            self._stream_thread.join(CLOSE_JOIN_S)
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
        w = _Waiter()
        with self._cond:
            if not self.governed:
                return None
            req.seq = next(self._seq)
            self._waiters[req.seq] = w
            self._send_locked(req)
            if not wait_for(self.clock, self._cond, lambda: w.answered, timeout):
                self._waiters.pop(req.seq, None)
                raise UnischedError(f"no answer from the daemon within {timeout:g} s")
        if self._fatal:
            raise UnischedError(self._fatal)
        return w.reply

    # --- the stream thread ------------------------------------------------------------------------------
    def _stream_loop(self) -> None:
        while not self._closing:
            why = self._stream_once()
            if why is None or self._closing:
                return
            self._disconnected(why)
            with self._cond:  # back off (close() ends the wait)
                wait_for(self.clock, self._cond, lambda: self._closing, self._retry_s)
            self._retry_s = min(RETRY_MAX_S, self._retry_s * 2)

    def _stream_once(self) -> str | None:
        """Connect, say hello (and want again what was wanted: after a reconnect), then read replies until the
        connection ends. Returns why it ended, or None when the daemon refused us (fatal) or we are closing."""
        try:
            conn = dial(self.socket, self._connect_timeout)
        except OSError as e:
            return f"unreachable: {e.strerror or e}"
        try:
            with self._cond:
                if self._closing:
                    return None
                self._conn = conn
                conn.write(opening(self._hello, [g.engine for g in self._gates.values() if g.wanting]))
            for reply in conn.replies():
                if reply.HasField("error"):
                    self._set_fatal(f"{reply.error.code}: {reply.error.details}")
                    return None
                self._on_reply(reply)
                self._retry_s = RETRY_FIRST_S
            return "the daemon closed the stream"
        except (OSError, FrameError, DecodeError) as e:
            return f"lost the connection: {e}"
        finally:
            with self._cond:
                self._conn = None
            conn.close()

    def _transport_up(self) -> bool:
        """Whether the socket accepted us, whatever the daemon answered so far."""
        return self._conn is not None

    def _set_fatal(self, why: str) -> None:
        with self._cond:
            self._fatal = why
            self._disconnected_locked()
            self._answered = True
        if self.connects:
            log.error("unisched daemon ended the lease session: %s; running UNGOVERNED", why)

    def _disconnected(self, why: str) -> None:
        with self._cond:
            was = self.governed
            self._disconnected_locked()
            if not self.connects:
                self._fatal = why  # for the constructor's message
                self._answered = True
        if was:
            log.warning("lost the unisched daemon (%s): running UNGOVERNED until it is back", why)

    def _disconnected_locked(self) -> None:
        self.governed = False
        for g in self._gates.values():
            g.lost_locked()
        for w in self._waiters.values():
            w.answered = True
        self._waiters.clear()
        self._cond.notify_all()

    def _on_reply(self, reply: pb.LeaseReply) -> None:
        kind = reply.WhichOneof("kind")
        now = self.clock.monotonic()
        with self._cond:
            if kind == "welcome":
                self._welcomed_locked(reply.welcome)
            elif kind == "grant":
                g = self._gates.get(reply.grant.engine)
                if g is not None:
                    g.granted(reply.grant, now)
            elif kind == "revoke":
                g = self._gates.get(reply.revoke.engine)
                if g is not None:
                    g.revoked(reply.revoke)
            elif kind == "ack":
                waiter = self._waiters.pop(reply.seq, None)
                if waiter is not None:
                    waiter.reply = reply
                    waiter.answered = True
            self._cond.notify_all()

    def _welcomed_locked(self, w: pb.LeaseWelcome) -> None:
        self.session, self.slice_s, self.valid_s = w.session, w.slice_s, w.valid_s
        self.tenant_info = w.tenant
        if self.connects == 0:
            _apply_env(w.tenant.env)
        self.governed = True
        self._fatal = None
        self.connects += 1
        if self.connects > 1:
            log.warning("re-registered with the unisched daemon as %s (session %d)", self.tenant, w.session)
        self._answered = True

    # --- the renew thread -------------------------------------------------------------------------------
    def _renew_loop(self) -> None:
        """Renew held engines ahead of their expiry, with the usage measured since; release idle ones (see
        `renewals`). Any reply wakes it early (a grant's renewal carries the charges the next slice needs)."""
        while True:
            with self._cond:
                if self._closing:
                    return
                contended = any(g.lease and g.contended for g in self._gates.values())
                t = renewals.timing(self.slice_s, self.valid_s, contended, self._renew_interval, self._idle_release_s)
                if self.governed:
                    renewals.renew_locked(list(self._gates.values()), self.clock.monotonic(), t.idle_s)
                self.clock.wait(self._cond, t.interval_s)
