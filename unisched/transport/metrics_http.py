"""The metrics listener's HTTP server: a thread per connection, within bounds that keep the probes answering.

The port is unauthenticated (and listens on every pod of a node where metrics_listen is 0.0.0.0), so what one
client can hold is bounded: connections in all and per client address, each with deadlines, and a few slots kept
for /healthz and /readyz, so that a kubelet's probe is answered while other clients hold every other slot.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import ThreadingWSGIServer

if TYPE_CHECKING:
    from wsgiref.types import WSGIApplication as WSGIApp

__all__ = ["CONNECTION_DEADLINE_S", "LOOPBACK", "MAX_CONNECTIONS", "MAX_CONNECTIONS_PER_ADDRESS", "PROBE_PATHS", "PROBE_SLOTS",
           "READ_TIMEOUT_S", "Slots", "client_key", "serve"]

READ_TIMEOUT_S = 2.0
"""How long a metrics or probe connection may take to send its whole request (request line and headers) before it
is closed. Prometheus and the kubelet send theirs at once; a longer wait only lets idle connections hold slots."""
CONNECTION_DEADLINE_S = 60.0
"""How long a metrics or probe connection may last in all, its answer included: a client that reads its answer a
byte at a time must not hold its thread (and its slot) for ever either."""
MAX_CONNECTIONS = 64
"""Metrics and probe connections served at once (each is a thread), besides PROBE_SLOTS; past them a new one is
closed unanswered."""
MAX_CONNECTIONS_PER_ADDRESS = 8
"""Of those, from one client address: a scraper and a kubelet probe need one or two, and one address opening many
idle connections cannot take every slot. Every loopback address (127.0.0.0/8, ::1, ::ffff:127.x) counts as one:
any local user can bind any of them."""
PROBE_SLOTS = 4
"""Connections kept for /healthz and /readyz, taken only when the others are full (for everyone or for the client's
address); such a connection asking for anything else is answered 503. When they are full too, a new connection
takes the place of the one that has waited longest without sending its whole request, so idle connections
cannot keep a probe out."""
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
LOOPBACK = "loopback"


def client_key(address: str) -> str:
    """The address a connection counts against: every loopback address is one (a local user can bind any of
    127.0.0.0/8), and an IPv4-mapped IPv6 address is its IPv4 address (a dual-stack listener sees those)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return LOOPBACK if ip.is_loopback else str(ip)


@dataclass(eq=False)
class Slot:
    """One served connection: counted in the general slots, or holding a probe slot (`reserved`)."""

    key: str
    reserved: bool
    conn: socket.socket
    requested: bool = False
    """Its whole request has been read (a probe slot that has not may be given to a newer connection)."""
    evicted: bool = False


class Slots:
    """The connections served now: `most` in all, `per_address` from one client_key, and `probes` probe slots."""

    def __init__(self, most: int, per_address: int, probes: int) -> None:
        self.most, self.per_address, self.probes = most, per_address, probes
        self._lock = threading.Lock()
        self._by_key: dict[str, int] = {}
        self._general = 0
        self._reserved: list[Slot] = []  # oldest first

    def take(self, conn: socket.socket, address: str) -> Slot | None:
        """A slot for a new connection from `address`, or None (it is to be closed unanswered)."""
        key = client_key(address)
        with self._lock:
            n = self._by_key.get(key, 0)
            if n < self.per_address and self._general < self.most:
                self._by_key[key] = n + 1
                self._general += 1
                return Slot(key, False, conn)
            if len(self._reserved) >= self.probes:
                idle = next((s for s in self._reserved if not s.requested), None)
                if idle is None:
                    return None
                self._reserved.remove(idle)
                idle.evicted = True
                with contextlib.suppress(OSError):
                    idle.conn.shutdown(socket.SHUT_RDWR)  # its handler's read ends at once
            slot = Slot(key, True, conn)
            self._reserved.append(slot)
            return slot

    def requested(self, slot: Slot) -> bool:
        """Mark `slot`'s request as read; False if its connection was given up for a newer one meanwhile."""
        with self._lock:
            slot.requested = not slot.evicted
            return slot.requested

    def give(self, slot: Slot) -> None:
        with self._lock:
            if slot.reserved:
                if not slot.evicted:
                    self._reserved.remove(slot)
                return
            self._general -= 1
            n = self._by_key.pop(slot.key, 0) - 1
            if n > 0:
                self._by_key[slot.key] = n


class _Deadline:
    """A connection's deadlines: its whole request (request line and headers) within `request_s` of its start, a
    total of `total_s` for all of it. Each read's own timeout does not bound a client that sends a byte every few
    seconds; past a deadline the socket is shut down, which ends the handler's read or write at once."""

    def __init__(self, conn: socket.socket, request_s: float, total_s: float) -> None:
        self._read = threading.Event()
        self._done = threading.Event()
        threading.Thread(target=self._watch, args=(conn, request_s, total_s), name="unisched-metrics-deadline",
                         daemon=True).start()

    def request_read(self) -> None:
        self._read.set()

    def stop(self) -> None:
        self._done.set()

    def _watch(self, conn: socket.socket, request_s: float, total_s: float) -> None:
        if self._done.wait(request_s):
            return
        if self._read.is_set() and self._done.wait(max(0.0, total_s - request_s)):
            return
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes and probes every few seconds: not worth a log line each."""


def serve(address: str, port: int, family: socket.AddressFamily, app: WSGIApp, read_timeout_s: float) -> WSGIServer:
    """A WSGI server for `app` on ADDRESS:PORT (not yet serving), a thread per connection within the bounds
    above (read when called)."""
    slots = Slots(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS, PROBE_SLOTS)
    held: dict[Any, Slot] = {}

    class Handler(_QuietHandler):
        timeout = read_timeout_s
        _deadline: _Deadline
        _slot: Slot

        def setup(self) -> None:
            self._slot = held[self.request]
            super().setup()
            self._deadline = _Deadline(self.connection, read_timeout_s, max(read_timeout_s, CONNECTION_DEADLINE_S))

        def parse_request(self) -> bool:
            whole = super().parse_request()
            self._deadline.request_read()
            if not whole or not slots.requested(self._slot):
                return False
            if self._slot.reserved and urlsplit(self.path).path not in PROBE_PATHS:
                self.send_error(503, "Busy", "every metrics connection is taken; only /healthz and /readyz are served")
                return False
            return True

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                self._deadline.stop()

    class Server(ThreadingWSGIServer):
        """ThreadingWSGIServer with the address family of the address, serving at most the connections `slots`
        allow (the others closed at once)."""

        address_family = family

        def process_request(self, request: Any, client_address: Any) -> None:
            slot = slots.take(request, str(client_address[0]))
            if slot is None:
                self.shutdown_request(request)
                return
            held[request] = slot
            try:
                threading.Thread(target=self._serve, args=(request, client_address), daemon=True).start()
            except BaseException:
                self._release(request)
                raise

        def _serve(self, request: Any, client_address: Any) -> None:
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self._release(request)

        def _release(self, request: Any) -> None:
            slots.give(held.pop(request))
            self.shutdown_request(request)

    return make_server(address, port, app, Server, handler_class=Handler)
