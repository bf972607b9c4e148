"""The client reaching the daemon: none there (fail clearly, or run ungoverned with fail_open), one that
accepts the connection but answers the registration late, and one that never answers."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, child_env
from test_client import WORKER

sys.path.insert(0, str(ROOT / "clients"))  # this checkout's client library, not an installed one

from unisched_client import Client, UnischedUnavailable
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import MAGIC, MAX_REQUEST_BYTES, FrameReader, frame, lease_socket_beside


def test_unreachable_daemon_fails_clearly_unless_fail_open(tmp_path: Path) -> None:
    sock = str(tmp_path / "nobody.sock")
    p = subprocess.run([sys.executable, WORKER, "--socket", sock, "--tenant", "x", "--seconds", "0.2"],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert p.returncode == 3
    assert "cannot reach the unisched daemon" in p.stderr and "fail_open=True" in p.stderr
    p = subprocess.run([sys.executable, WORKER, "--socket", sock, "--tenant", "x", "--seconds", "0.2", "--fail-open"],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert p.returncode == 0, p.stderr
    assert "UNGOVERNED" in p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["units"] > 0 and r["connects"] == 0


def _slow_lease_stream(conn: socket.socket, answer: threading.Event) -> None:
    """Reads the hello; answers it only once `answer` is set (a daemon busy registering); reads until EOF."""
    with conn:
        got = b""
        while not got.startswith(MAGIC) or not (hello := FrameReader(MAX_REQUEST_BYTES).feed(got[len(MAGIC):])):
            chunk = conn.recv(1 << 16)
            if not chunk:
                return
            got += chunk
        if not answer.wait(30):
            return
        name = pb.LeaseRequest.FromString(hello[0]).hello.tenant
        with contextlib.suppress(OSError):
            conn.sendall(frame(pb.LeaseReply(welcome=pb.LeaseWelcome(tenant=pb.Tenant(name=name), session=1,
                                                                     slice_s=0.05, valid_s=0.25))))
            while conn.recv(1 << 16):  # until the client closes
                pass


@contextlib.contextmanager
def slow_daemon(tmp_path: Path, answer: threading.Event) -> Iterator[str]:
    """Accepts lease connections at once and answers their hello late; yields the daemon's (gRPC) socket path,
    beside which the client finds this lease socket."""
    path = str(tmp_path / "slow.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(lease_socket_beside(path))
    listener.listen(8)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=_slow_lease_stream, args=(conn, answer), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield path
    finally:
        answer.set()  # lets a handler still waiting end
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()


class _Said(logging.Handler):
    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle, self.seen = needle, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.seen.set()


def test_a_connected_but_busy_daemon_is_waited_for_beyond_the_connect_timeout(tmp_path: Path) -> None:
    """1000 tenants registering at once took the daemon up to 30 s; their clients gave up after 5 s as if it
    were not running. Connected now means: wait (register_timeout), saying so."""
    answer = threading.Event()
    said = _Said("has not answered the registration")
    logging.getLogger("unisched_client").addHandler(said)
    try:
        with slow_daemon(tmp_path, answer) as path:
            got: list[Client | BaseException] = []

            def connect() -> None:
                try:
                    got.append(Client("busy", socket=path, connect_timeout=0.3, register_timeout=30))
                except BaseException as e:
                    got.append(e)
            t = threading.Thread(target=connect)
            t.start()
            assert said.seen.wait(30), "no warning that the daemon is slow"
            assert not got  # still waiting, not failed
            answer.set()
            t.join(30)
            client = got[0]
            assert isinstance(client, Client) and client.governed, client
            client.close()
    finally:
        logging.getLogger("unisched_client").removeHandler(said)


def test_a_daemon_that_never_answers_fails_with_a_message_saying_it_was_connected(tmp_path: Path) -> None:
    with slow_daemon(tmp_path, threading.Event()) as path, pytest.raises(UnischedUnavailable) as e:
        Client("mute", socket=path, connect_timeout=0.3, register_timeout=0.5)
    assert "connected, but no answer to the registration within 0.8 s" in str(e.value)


def test_no_daemon_at_all_still_fails_after_the_connect_timeout(tmp_path: Path) -> None:
    with pytest.raises(UnischedUnavailable) as e:
        Client("nobody", socket=str(tmp_path / "none.sock"), connect_timeout=0.3, register_timeout=60)
    assert "Is `unisched serve` running?" in str(e.value) and "connected" not in str(e.value)
