"""Hostile hand-over messages on the seccomp agent socket (anyone's): whatever a message holds is a refusal with a
throttled log line, never a crash with a traceback per connection. A pipe stands in for the listener where its
check would stop the read first (`any_fd_listens`)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any, cast

import pytest
from structlog.testing import capture_logs

from unisched.enforce.seccomp import agent
from unisched.enforce.seccomp.abi import SeccompError
from unisched.enforce.seccomp.agent import AgentMessageReader, parse_agent_message
from unisched.enforce.seccomp.handover import make_agent_message
from unisched.enforce.seccomp.hooks import FakeSessionHooks
from unisched.scheduler.core import Scheduler
from unisched.transport import agent as transport_agent
from unisched.transport.agent import SeccompAgentServer
from unisched.transport.identity import PeerCred

NOBODY = 65534
NESTED = b'{"a":' + b"[" * 1500 + b"]" * 1500 + b"}"
"""Valid JSON nested deeper than json's recursion limit."""
TRICKY = 'tenant=a,"x}\\"{\\\\[]\\'
"""Metadata whose quotes, brackets and backslashes, escaped in the JSON, must not be taken for its structure."""


@pytest.fixture
def any_fd_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "is_listener_fd", lambda fd: True)


@pytest.fixture
def pipe() -> Iterator[int]:
    """A pipe's read end (for a reader to own: each test passes a dup); the pipe closes at the end."""
    r, w = os.pipe()
    yield r
    os.close(r)
    os.close(w)


# --- the reader --------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("any_fd_listens")
def test_json_nested_too_deep_is_a_refusal(pipe: int) -> None:
    with pytest.raises(SeccompError, match="not JSON"):
        parse_agent_message(NESTED)
    reader = AgentMessageReader()
    try:
        with pytest.raises(SeccompError, match="not JSON"):
            reader.feed(NESTED, [os.dup(pipe)])
    finally:
        reader.close()


def test_a_peer_s_values_are_never_turned_into_text_whole() -> None:
    """An array where a string or the pid belongs is refused, its quote in the error bounded (reprlib)."""
    deep = "[" * 900 + "]" * 900
    with pytest.raises(SeccompError, match="metadata must be a string"):
        parse_agent_message(f'{{"pid":5,"metadata":{deep}}}')
    with pytest.raises(SeccompError, match="bad or missing pid") as refused:
        parse_agent_message(json.dumps({"pid": ["x" * 1000] * 100}))
    assert len(str(refused.value)) < 300, "the peer's 100 KB are not quoted whole"


# --- the server's answers and log lines ----------------------------------------------------------------------------
def _hand_overs_as_nobody(path: Path, message: bytes, fd: int, count: int,
                          server: SeccompAgentServer) -> tuple[list[str], list[MutableMapping[str, Any]]]:
    """`count` hand-overs of `message` with `fd`, one after the other, from a peer taken for uid NOBODY: the
    replies ("" where the daemon hung up without one) and the log lines."""
    async def main() -> list[str]:
        await server.start()
        loop = asyncio.get_running_loop()
        replies = []
        try:
            for _ in range(count):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.setblocking(False)
                    await loop.sock_connect(c, str(path))
                    socket.send_fds(c, [message], [fd])
                    replies.append((await asyncio.wait_for(loop.sock_recv(c, 4096), 30)).decode().strip())
        finally:
            await server.close()
        return replies

    with capture_logs() as logs:
        replies = asyncio.run(main())
    return replies, logs


@pytest.fixture
def nobody_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SeccompAgentServer:
    """An agent (fake hooks, no engine) whose every peer is uid NOBODY."""
    monkeypatch.setattr(transport_agent, "peer_of", lambda conn: PeerCred(os.getpid(), NOBODY, NOBODY))
    return SeccompAgentServer(str(tmp_path / "agent.sock"), cast(Scheduler, object()), hooks=FakeSessionHooks())


@pytest.mark.usefixtures("any_fd_listens")
def test_nested_json_is_refused_with_one_log_line_per_interval(nobody_server: SeccompAgentServer, pipe: int) -> None:
    replies, logs = _hand_overs_as_nobody(Path(nobody_server.path), NESTED, pipe, 5, nobody_server)
    assert all(r.startswith("error seccomp agent message is not JSON") for r in replies), replies
    lines = [e for e in logs if e["event"] in ("seccomp hand-over failed", "seccomp agent connection failed")]
    assert len(lines) == 1, lines
    assert lines[0]["event"] == "seccomp hand-over failed" and "exc_info" not in lines[0]


@pytest.mark.usefixtures("any_fd_listens")
def test_an_unexpected_failure_is_logged_once_per_interval(nobody_server: SeccompAgentServer, pipe: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug a peer can trigger at will (here: reading its tenant raises) must not let it fill the journal with a
    traceback per connection: the line says how many were held back when it comes again."""
    def broken(*args: object) -> tuple[str | None, str | None]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(nobody_server, "_tenant_for", broken)
    _, logs = _hand_overs_as_nobody(Path(nobody_server.path), make_agent_message(os.getpid()), pipe, 5, nobody_server)
    lines = [e for e in logs if e["event"] == "seccomp agent connection failed"]
    assert len(lines) == 1, lines
    assert lines[0]["log_level"] == "error" and lines[0]["exc_info"] is True and lines[0]["peer_uid"] == NOBODY
