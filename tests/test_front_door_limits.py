"""One user's flood of the daemon's sockets costs only that user (a real daemon with its default limits).

The attack: 4,200 idle connections from one non-root uid (more than the daemon's global cap of 4,096, which
alone would leave root's `status` with "cannot reach the daemon"), some of them sending a partial 64 KiB lease
frame and then nothing (which a daemon without deadlines would hold for good). With the defaults
(options.MAX_CONNECTIONS_PER_UID = 128, an admin reserve, OPENING_DEADLINE_S = 5, PARTIAL_FRAME_S = 5,
MAX_PARTIAL_BYTES_PER_UID = 1 MiB) the daemon holds at most 128 of them, closes the rest at accept and the held
ones at their deadline, root's status answers within 1 s throughout, and its RSS stays near idle: the same
numbers as the real attack, so the defaults themselves are what is tested. It runs in a few seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Daemon, child_env, wait_until

from unisched.transport.client import DaemonClient
from unisched.transport.options import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID, OPENING_DEADLINE_S

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")]

FLOOD = MAX_CONNECTIONS + 104
"""4,200: past the global cap, as in the reported attack."""
PARTIAL = 256
"""Connections that send a partial 64 KiB lease frame (more than one uid may hold)."""

# Raises its open-file limit, drops to nobody, opens FLOOD connections (the first PARTIAL to the lease socket,
# each sending MAGIC and most of a 64 KiB frame; the rest to the gRPC socket, silent), says "ready", then reports
# on stdin's command how many the daemon still holds open and waits
# for the next line to close everything.
ATTACKER = r"""
import os, resource, select, socket, struct, sys
path, lease_path, n, partial = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 100, max(n + 100, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
os.setgroups([]); os.setgid(65534); os.setuid(65534)
MAGIC = b"unisched-lease/1\n"
chunk = MAGIC + struct.pack(">I", 65536) + b"x" * 65000
conns = []
for i in range(n):
    c = socket.socket(socket.AF_UNIX)
    try:
        c.connect(lease_path if i < partial else path)  # blocking: waits while the backlog is full, as a patient attacker
    except OSError:
        c.close()
        continue
    conns.append(c)
    if i < partial:
        c.settimeout(10)
        try:
            c.sendall(chunk)
        except OSError:
            pass

def open_ones():
    p = select.poll()
    for c in conns:
        p.register(c, select.POLLIN)
    ready = {fd for fd, _ in p.poll(0)}
    alive = 0
    for c in conns:
        if c.fileno() not in ready:
            alive += 1
            continue
        try:
            if c.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                alive += 1
        except OSError:
            pass
    return alive

print("ready", len(conns), flush=True)
for line in sys.stdin:
    if line.strip() == "count":
        print(open_ones(), flush=True)
    else:
        break
for c in conns:
    c.close()
"""


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _status_s(socket: str) -> float:
    start = time.monotonic()
    with DaemonClient(socket, timeout=5) as c:
        c.status()
    return time.monotonic() - start


def test_a_connection_flood_costs_only_the_attacker(daemon: Daemon) -> None:
    pid = daemon.proc.pid
    _status_s(daemon.socket)
    idle = _rss_mib(pid)
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, daemon.socket, daemon.lease_socket, str(FLOOD),
                                 str(PARTIAL)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(), cwd="/tmp")
    assert attacker.stdin is not None and attacker.stdout is not None
    try:
        word, connected = attacker.stdout.readline().split()
        assert word == "ready" and int(connected) > MAX_CONNECTIONS_PER_UID
        during = [_status_s(daemon.socket) for _ in range(3)]
        rss_during = _rss_mib(pid)
        attacker.stdin.write("count\n")
        attacker.stdin.flush()
        held = int(attacker.stdout.readline())
        print(f"\nRSS MiB idle {idle:.0f}, during {rss_during:.0f}; status s {during}; held {held} of {connected}")
        assert max(during) < 1.0, f"root's status took {during} s during the flood"
        assert held <= MAX_CONNECTIONS_PER_UID, f"the daemon held {held} connections of one uid"

        def count() -> int:
            assert attacker.stdin is not None and attacker.stdout is not None
            attacker.stdin.write("count\n")
            attacker.stdin.flush()
            return int(attacker.stdout.readline())

        # the ones it held (silent, or with an unfinished frame) are closed at their deadline
        wait_until(lambda: count() == 0, 4 * OPENING_DEADLINE_S, "the daemon to close the silent connections")
        assert rss_during < idle + 32, f"RSS {rss_during:.0f} MiB during the flood (idle {idle:.0f} MiB)"
        attacker.stdin.write("close\n")
        attacker.stdin.flush()
        assert attacker.wait(timeout=30) == 0
        after = wait_until(lambda: (r := _rss_mib(pid)) < idle + 16 and r, 20, "RSS to return near idle")
        print(f"RSS MiB after {after:.0f}")
        assert _status_s(daemon.socket) < 1.0
    finally:
        attacker.kill()
        attacker.wait(timeout=10)
        for f in (attacker.stdin, attacker.stdout):
            f.close()
