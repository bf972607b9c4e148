"""gRPC options of the daemon's server and of the clients of its Unix socket (`serve_async`, the client library,
the benchmarks).

The daemon carries many small long-lived streams (a lease stream per cooperative client, 1000 of them on one
daemon in bench/lease_load.py) over a local socket, through one asyncio loop that also runs the relay and the
engine. gRPC's defaults suit a few short calls over a network instead; two of them lost streams or time here:

- Unrequested calls. grpc.aio takes new calls from gRPC core one at a time, each after a few turns of the
  event loop, so when the loop is busy (a burst of clients registering while others renew: ~30 new streams/s
  on the 2-core machine) calls queue in core. Core cancels a call that waited there longer than
  `grpc.server_max_unrequested_time_in_server` (default 30 s): the client sees CANCELLED before its first
  answer. That is how 200-430 of the 1000 streams of the load benchmark were lost, all ~31 s after the
  clients started (bench/results/2026-11-30-cpu/README.md). Every call here comes from a local client on a
  connection the relay admitted (at most `MAX_CONNECTIONS`), so a call that waits is served late, not dropped.
  The pending-call bound (`grpc.server.max_pending_requests`, 1000 by default, with random early rejections
  above it) is raised to the same number for the same reason.
- BDP probing (`grpc.http2.bdp_probe`). On received data each side sends an HTTP/2 PING to estimate the
  bandwidth-delay product and size its flow-control window: with one small message a second per stream that
  is a PING and its ACK per renewal in each direction (measured at 1000 tenants: 41 k server and 31 k client
  pings for 75 k renewals), each through the relay and the loop twice more. Messages of tens of bytes never
  need a larger window, so both ends turn it off. The server's pings were also the only ones with a timeout:
  a client's keepalive is off by default, and then so is its ping timeout; the server's keepalive time is 2 h,
  which arms a 60 s timeout on every ping it sends (GOAWAY "ping_timeout" when no ACK comes).
"""

from __future__ import annotations

__all__ = ["CHANNEL_OPTIONS", "MAX_CONNECTIONS", "SERVER_OPTIONS", "UNREQUESTED_CALL_MAX_S"]

MAX_CONNECTIONS = 4096
"""Client connections the relay admits at most (fewer when the open-file limit says so)."""

UNREQUESTED_CALL_MAX_S = 600
"""How long a new call may wait in gRPC core for the server's event loop to take it (gRPC's default: 30 s)."""

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.bdp_probe", 0),
]
"""For clients of the daemon's Unix socket."""

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_MAX_S),
    ("grpc.server.max_pending_requests", MAX_CONNECTIONS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_CONNECTIONS),
]
"""For the daemon's gRPC server, with its message-size and stream limits."""
