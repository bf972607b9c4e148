"""Hostile hand-over messages on the seccomp agent socket (anyone's): reading one must cost the daemon's event loop
a chunk per turn, its fds must come once, and whatever a message holds is a refusal with a throttled log line,
never a crash with a traceback per connection. A pipe stands in for the listener where its check would stop the
read first (`any_fd_listens`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any, cast

import pytest
from structlog.testing import capture_logs

from unisched.enforce.seccomp import agent
from unisched.enforce.seccomp.abi import SeccompError
from unisched.enforce.seccomp.agent import MAX_AGENT_MESSAGE_BYTES, AgentMessageReader, parse_agent_message
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


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


# --- the reader --------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("any_fd_listens")
def test_a_message_split_anywhere_ends_exactly_at_its_last_byte(pipe: int) -> None:
    message = make_agent_message(42, metadata=TRICKY)
    rng = random.Random(7)
    splits = [list(range(1, len(message)))] + [[cut] for cut in range(1, len(message))]
    splits += [sorted(rng.sample(range(1, len(message)), 5)) for _ in range(50)]
    for cuts in splits:
        reader = AgentMessageReader()
        pieces = [message[a:b] for a, b in zip([0, *cuts], [*cuts, len(message)], strict=True)]
        try:
            assert all(reader.feed(p, [os.dup(pipe)] if i == 0 else []) is None for i, p in enumerate(pieces[:-1]))
            hello = reader.feed(pieces[-1] + b" trailing", [])
            assert hello is not None and (hello.pid, hello.metadata) == (42, TRICKY), cuts
        finally:
            reader.close()


@pytest.mark.usefixtures("any_fd_listens")
def test_fds_after_the_first_message_s_end_the_hand_over(pipe: int) -> None:
    """The extra fds of the first message are closed at once; any fd sent later is an error, not read on past
    (each message that carries fds ends a recvmsg, so a peer could make every byte cost one and its closes)."""
    first, extra, later = os.dup(pipe), os.dup(pipe), os.dup(pipe)
    reader = AgentMessageReader()
    try:
        assert reader.feed(b"{", [first, extra]) is None
        assert _closed(extra) and not _closed(first)
        with pytest.raises(SeccompError, match="file descriptors came after"):
            reader.feed(b" ", [later])
        assert _closed(later)
    finally:
        reader.close()
    assert _closed(first)


@pytest.mark.usefixtures("any_fd_listens")
@pytest.mark.parametrize("filler", [b"[],", b'"",', b"0,"])
def test_a_megabyte_of_values_is_refused_at_its_first_chunk(pipe: int, filler: bytes) -> None:
    """json's work is per value: a message with more than MAX_AGENT_MESSAGE_TOKENS is refused before json reads
    it, at the chunk where the count passes."""
    body = b'{"a":[' + filler * (MAX_AGENT_MESSAGE_BYTES // len(filler) - 4)
    reader = AgentMessageReader()
    try:
        with pytest.raises(SeccompError, match="too many JSON values"):
            reader.feed(body[:65536], [os.dup(pipe)])
    finally:
        reader.close()


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


# --- on the event loop ---------------------------------------------------------------------------------------------
@pytest.fixture
def counted_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The hand-over's chunks read (1 KiB each), counted in [0]: transport.agent's recv_agent_chunk wrapped."""
    monkeypatch.setattr(agent, "_AGENT_CHUNK", 1024)
    read = [0]
    recv = agent.recv_agent_chunk  # (what transport.agent imported)

    def counted(sock: socket.socket) -> tuple[bytes, list[int]]:
        read[0] += 1
        return recv(sock)

    monkeypatch.setattr(transport_agent, "recv_agent_chunk", counted)
    return read


def _queued_endless_string(a: socket.socket, fd: int) -> int:
    """Send an fd and the start of a string that never ends, then as much of it as the socket takes: the bytes
    queued."""
    a.setblocking(False)
    queued = socket.send_fds(a, [b'{"a":"'], [fd])
    with contextlib.suppress(BlockingIOError):
        while True:
            queued += a.send(b"x" * 1024)
    return queued


@pytest.mark.usefixtures("any_fd_listens")
def test_the_loop_runs_between_the_chunks_of_a_hand_over(pipe: int, counted_reads: list[int]) -> None:
    """While a peer's bytes keep its socket readable nothing else yields: a callback scheduled behind the read must
    run after its first chunk, not once all that was queued is consumed."""
    read = counted_reads
    a, b = socket.socketpair()
    with a, b:
        queued = _queued_endless_string(a, os.dup(pipe))
        assert queued > 8 * 1024, "the socket took too little to tell"
        b.setblocking(False)

        async def main() -> list[int]:
            loop = asyncio.get_running_loop()
            task = asyncio.create_task(transport_agent._receive(b, loop.time() + 60))
            seen: list[int] = []
            loop.call_soon(lambda: seen.append(read[0]))  # behind the task's first step
            await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return seen

        assert asyncio.run(main()) == [1]


@pytest.mark.usefixtures("any_fd_listens")
def test_a_hand_over_still_readable_at_its_deadline_stops_there(pipe: int, counted_reads: list[int]) -> None:
    """Past its deadline a hand-over that keeps coming is read no further than its first chunk."""
    a, b = socket.socketpair()
    with a, b:
        assert _queued_endless_string(a, os.dup(pipe)) > 8 * 1024, "the socket took too little to tell"
        b.setblocking(False)

        async def main() -> str:
            task = asyncio.create_task(transport_agent._receive(b, asyncio.get_running_loop().time()))
            done, _ = await asyncio.wait([task], timeout=10)  # (only a failing read takes this long)
            if not done:
                task.cancel()
                return "still reading"
            return repr(task.exception())

        assert asyncio.run(main()) == "TimeoutError()"
        assert counted_reads == [1], "read past the deadline"


@pytest.mark.usefixtures("any_fd_listens")
def test_a_hand_over_whole_in_the_socket_is_taken_when_the_loop_comes_to_it_late(pipe: int) -> None:
    """A runtime sends its hand-over in one sendmsg and never reads the answer: one already whole in the socket is
    taken even when the task first runs past its deadline (a loop late), not refused unread."""
    a, b = socket.socketpair()
    with a, b:
        socket.send_fds(a, [make_agent_message(os.getpid())], [os.dup(pipe)])
        b.setblocking(False)

        async def main() -> tuple[int, object]:
            return await transport_agent._receive(b, asyncio.get_running_loop().time() - 1)

        fd, hello = asyncio.run(main())
        os.close(fd)
        assert hello is not None


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
