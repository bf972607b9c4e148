"""Limits of the daemon's front door (transport/frontdoor.py) on what clients of its Unix sockets may cost, each
with the reason for its number. They hold for the gRPC socket and the lease socket together.
"""

from __future__ import annotations

__all__ = [
    "ADMIN_RESERVE", "CONTAINED_SHARE", "DROP_LOG_INTERVAL_S", "GRPC_CALLS_PER_CONNECTION", "GRPC_IDLE_S",
    "MAX_CONNECTIONS", "MAX_CONNECTIONS_PER_UID", "MAX_PARTIAL_BYTES_PER_UID", "OPENING_DEADLINE_S",
    "PARTIAL_FRAME_S", "TRIM_AFTER_CLOSED", "TRIM_EVERY_S"
]

MAX_CONNECTIONS = 4096
"""Client connections the front door admits at most, over both sockets (fewer when the open-file limit says so)."""

ADMIN_RESERVE = 64
"""Connections of the global cap that only admins (host root, the admin group) may take: however many users
connect, root's `status`, `run` and `top` still get in. 64 covers an operator's shells and the device plugin."""

MAX_CONNECTIONS_PER_UID = 128
"""Connections one non-admin uid may hold. A user's cooperative apps hold one lease stream each and its CLI calls
one short gRPC connection each, so 128 is far above honest use, while 31 such users still cannot fill the
non-admin part of the cap (4096 - 64). Past it the user's new connections are closed at accept (cheaply: no
read, no task), so a flood of 4,200 idle connections costs the daemon 128 held sockets."""

CONTAINED_SHARE = 0.5
"""The part of the non-admin connections (the cap less the admins' reserve) that callers outside the daemon's pid
namespace (pods, containers) may hold together. Each pod counts as one user (MAX_CONNECTIONS_PER_UID, by its pid
namespace, whatever uids root in it takes), and however many pods there are, host users keep the other half.
Half leaves 2,016 connections to pods: 15 pods flooding at once still leave room for a 16th."""

OPENING_DEADLINE_S = 5.0
"""A connection must open its socket's protocol (the lease stream's MAGIC and hello, or HTTP/2's preface) within
this; a silent one is closed. Honest clients send their first bytes with connect()."""

PARTIAL_FRAME_S = 5.0
"""A lease frame or a gRPC request that has begun must be complete within this (measured from its first byte, so
a byte every few seconds does not extend it). Requests are at most 64 KiB and come from a local process."""

MAX_PARTIAL_BYTES_PER_UID = 1 << 20
"""Bytes of unfinished lease frames and unanswered gRPC requests one non-admin uid may make the daemon hold, over
all its connections. A renewal is tens of bytes, a hello or a gRPC call well under 1 KiB, so honest clients hold
almost nothing here; past it the connection whose request tipped it over is dropped. With 128 connections of
64 KiB each a uid could otherwise pin 8 MiB; 4,200 such connections pushed the daemon's RSS to 730 MiB."""

GRPC_CALLS_PER_CONNECTION = 4
"""gRPC calls one non-admin connection may have in flight at once (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS, held
from the connection's first SETTINGS frame; admins keep h2's 100). A call's handler starts on the event loop as
soon as its request arrives, so 128 connections of 100 calls each sent together would start 12,800 handlers in a
turn of the loop and hold it for seconds (1600 held it for 220-240 ms on a 2-core VM); at 4, a uid starts at most
512 at once. Honest clients have one call in flight per connection, and a gRPC client queues its extra calls
itself; one that opens more streams than allowed has broken HTTP/2 and its connection is dropped."""

GRPC_IDLE_S = 120.0
"""A gRPC connection that carried no request and had no call in flight for this long is closed. Every gRPC call is
unary and clients give each a deadline (10 s by default), so no call is in flight on such a connection; a
client that polls (`unisched top`) sends bytes every second, and an idle channel reconnects by itself on its
next call. Lease streams have no idle timeout: a session may wait silently for work, and closing it would end
its registration; the per-uid cap bounds how many a user holds."""

TRIM_AFTER_CLOSED = 64
"""After this many connections have closed (a burst), the front door asks glibc to return freed heap to the
system (malloc_trim): CPython keeps freed small buffers in its heap, so after a flood RSS stayed high."""
TRIM_EVERY_S = 60.0
"""At most one such trim a minute: it walks the whole heap on the event loop, and any local user can open and close
64 connections a second."""


DROP_LOG_INTERVAL_S = 1.0
"""At most one 'grpc connection dropped' or 'lease stream dropped' line a second per kind of reason and caller (a
uid, or a pod whatever uids its processes take), saying how many were held back: a user opening connections only to
have them dropped (hundreds a second) must not flood the log."""
