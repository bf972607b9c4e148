"""The lease stream's frame reader against hostile reads: frames split at any byte, many in one read, a length past
the limit. It cuts whole frames from the read itself and keeps only an unfinished one, so every way of splitting the
same bytes must give the same payloads and hold only the unfinished frame's bytes."""

from __future__ import annotations

import struct
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unisched_wire.leasewire import FrameError, FrameReader

LIMIT = 64


def framed(payloads: list[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(p)) + p for p in payloads)


@settings(deadline=None)  # a loaded machine's pauses are no failure of the framing
@given(st.lists(st.binary(max_size=LIMIT), max_size=8), st.lists(st.integers(0, 600), max_size=12), st.data())
def test_any_split_of_the_same_bytes_gives_the_same_frames(payloads: list[bytes], cuts: list[int],
                                                            data: st.DataObject) -> None:
    stream = framed(payloads)
    tail = data.draw(st.integers(0, len(stream)))  # a last frame cut short: held, not returned
    partial = framed([b"x" * LIMIT])[:tail % (LIMIT + 4)]
    stream += partial
    reader = FrameReader(LIMIT)
    got: list[bytes] = []
    edges = sorted({0, len(stream), *(c for c in cuts if c <= len(stream))})
    for a, b in pairwise(edges):
        got += reader.feed(stream[a:b])
    assert got == payloads
    assert reader.pending == len(partial)


@pytest.mark.parametrize(("split", "first_raises"), [(0, False), (2, False), (4, True), (5, True)])
def test_a_length_past_the_limit_is_refused_however_it_arrives(split: int, first_raises: bool) -> None:
    """Its length read whole in the first read (split 4 or more bytes into it) or only in the second."""
    ok = framed([b"ok"])
    stream = ok + struct.pack(">I", LIMIT + 1) + b"z"
    reader = FrameReader(LIMIT)
    if first_raises:
        with pytest.raises(FrameError):
            reader.feed(stream[:len(ok) + split])
        return
    assert reader.feed(stream[:len(ok) + split]) == [b"ok"]
    with pytest.raises(FrameError):
        reader.feed(stream[len(ok) + split:])
