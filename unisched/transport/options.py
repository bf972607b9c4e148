"""gRPC options of the daemon's server (`serve_async`).

The daemon carries many small long-lived streams (a lease stream per cooperative client, 1000 of them on one
daemon in bench/lease_load.py) over a local socket, through one asyncio loop that also runs the relay and the
engine. grpc.aio takes new calls from gRPC core one at a time, each after a few turns of that loop, so when the
loop or the CPUs are busy (a burst of clients registering while others renew: ~30 new streams/s on the 2-core
machine with another user's tests running) calls queue in core. Core cancels a call that waited there longer
than `grpc.server_max_unrequested_time_in_server` (default 30 s): the client sees CANCELLED before its first
answer. That is how 200-430 of the 1000 streams of the load benchmark were lost, all ~31 s after the clients
started (bench/results/2026-11-30-cpu/README.md). Every call here comes from a local client on a connection
the relay admitted (at most `MAX_CONNECTIONS`), so a call that waits is served late, not dropped; the bound on
pending calls (`grpc.server.max_pending_requests`, 1000 by default, with random early rejections above it) is
raised to the same number for the same reason.

BDP probing (`grpc.http2.bdp_probe`) stays on although it sends an HTTP/2 PING per burst of received data (about
one per renewal each way): turning it off saved no measurable daemon CPU at 1000 renewals/s, and those pings are
what ends a stalled connection (a ping not answered within 60 s closes it: "ping timeout" / GOAWAY
"ping_timeout"); without them a stalled stream stayed open for good.
"""

from __future__ import annotations

__all__ = [
    "ADMIN_RESERVE", "GRPC_IDLE_S", "MAX_CONNECTIONS", "MAX_CONNECTIONS_PER_UID", "MAX_PARTIAL_BYTES_PER_UID",
    "OPENING_DEADLINE_S", "PARTIAL_FRAME_S", "SERVER_OPTIONS", "TRIM_AFTER_CLOSED", "UNREQUESTED_CALL_MAX_S",
]

MAX_CONNECTIONS = 4096
"""Client connections the relay admits at most (fewer when the open-file limit says so)."""

ADMIN_RESERVE = 64
"""Connections of the global cap that only admins (host root, the admin group) may take: however many users
connect, root's `status`, `run` and `top` still get in. 64 covers an operator's shells and the device plugin."""

MAX_CONNECTIONS_PER_UID = 128
"""Connections one non-admin uid may hold. A user's cooperative apps hold one lease stream each and its CLI calls
one short gRPC connection each, so 128 is far above honest use, while 31 such users still cannot fill the
non-admin part of the cap (4096 - 64). Past it the user's new connections are closed at accept (cheaply: no
read, no task), so a flood of 4,200 idle connections costs the daemon 128 held sockets."""

OPENING_DEADLINE_S = 5.0
"""A connection must say what it is (a lease stream's hello, or gRPC's preface) within this; a silent one is
closed. Honest clients send their first bytes with connect()."""

PARTIAL_FRAME_S = 5.0
"""A lease frame that has begun must be complete within this (measured from its first byte, so a byte every
few seconds does not extend it). Frames are at most 64 KiB and come from a local process."""

MAX_PARTIAL_BYTES_PER_UID = 1 << 20
"""Bytes of unfinished lease frames one non-admin uid may make the daemon hold, over all its connections. A
renewal is tens of bytes, a hello well under 1 KiB, so honest streams hold almost nothing here; past it the
connection whose frame tipped it over is dropped. With 128 connections of 64 KiB each a uid could otherwise
pin 8 MiB; 4,200 such connections pushed the daemon's RSS to 730 MiB."""

GRPC_IDLE_S = 120.0
"""A relayed gRPC connection that carried no bytes either way for this long is closed. Every gRPC call is
unary and clients give each a deadline (10 s by default), so no call is in flight on such a connection; a
client that polls (`unisched top`) sends bytes every second, and an idle channel reconnects by itself on its
next call. Lease streams have no idle timeout: a session may wait silently for work, and closing it would end
its registration; the per-uid cap bounds how many a user holds."""

TRIM_AFTER_CLOSED = 64
"""After this many connections have closed (a burst), the relay asks glibc to return freed heap to the
system (malloc_trim): CPython keeps freed small buffers in its heap, so after a flood RSS stayed high."""

UNREQUESTED_CALL_MAX_S = 600
"""How long a new call may wait in gRPC core for the server's event loop to take it (gRPC's default: 30 s)."""

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_MAX_S),
    ("grpc.server.max_pending_requests", MAX_CONNECTIONS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_CONNECTIONS),
]
"""For the daemon's gRPC server, with its message-size and stream limits."""
