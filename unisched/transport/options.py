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

__all__ = ["MAX_CONNECTIONS", "SERVER_OPTIONS", "UNREQUESTED_CALL_MAX_S"]

MAX_CONNECTIONS = 4096
"""Client connections the relay admits at most (fewer when the open-file limit says so)."""

UNREQUESTED_CALL_MAX_S = 600
"""How long a new call may wait in gRPC core for the server's event loop to take it (gRPC's default: 30 s)."""

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_MAX_S),
    ("grpc.server.max_pending_requests", MAX_CONNECTIONS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_CONNECTIONS),
]
"""For the daemon's gRPC server, with its message-size and stream limits."""
