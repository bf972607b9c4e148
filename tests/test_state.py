from __future__ import annotations

from pathlib import Path

from unisched.engine.state import SavedTenant, StateStore
from unisched.policy import Engine, Priority

T = SavedTenant("a", 250, Priority.ONLINE, frozenset({Engine.GRAPHICS}), (0,), "/unisched/a", False, 1000)


def test_round_trip(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save([T])
    assert StateStore(tmp_path).load() == [T]
    assert not list(tmp_path.glob(".state.json.*.tmp")), "temporary file left behind"


def test_missing_file_means_no_tenants(tmp_path: Path) -> None:
    assert StateStore(tmp_path / "new").load() == []


def test_truncated_file_is_kept_aside_and_start_goes_on(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save([T])
    body = store.path.read_bytes()
    store.path.write_bytes(body[: len(body) // 2])
    assert store.load() == []
    copies = list(tmp_path.glob("state.json.corrupt-*"))
    assert len(copies) == 1 and copies[0].read_bytes() == body[: len(body) // 2]


def test_wrong_values_are_corrupt_too(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.path.write_text('{"version": 1, "tenants": [{"name": "a", "weight": 0}]}')
    assert store.load() == []
    assert list(tmp_path.glob("state.json.corrupt-*"))
