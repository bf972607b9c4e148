from __future__ import annotations

from pathlib import Path

from unisched.policy import Engine, Priority
from unisched.scheduler.state import SavedTenant, StateStore, parse_state

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


# --- a damaged file costs only its damaged entries -------------------------------------------------------------
def _three(store: StateStore) -> list[SavedTenant]:
    ts = [SavedTenant(n, 100 + i, Priority.OFFLINE, frozenset({Engine.COMPUTE}), None, f"/unisched/{n}", False, 0)
          for i, n in enumerate(("a", "b", "c"))]
    store.save(ts)
    return ts


def test_one_bad_line_keeps_every_other_entry(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    a, _, c = _three(store)
    lines = store.path.read_text().splitlines()
    lines[2] = lines[2].replace('"weight":101', '"weight":0')  # b's entry
    store.path.write_text("\n".join(lines) + "\n")
    assert store.load() == [a, c]
    assert len(list(tmp_path.glob("state.json.corrupt-*"))) == 1


def test_a_truncated_file_keeps_the_entries_before_the_cut(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    a, b, _ = _three(store)
    body = store.path.read_bytes()
    store.path.write_bytes(body[: body.index(b'"name":"c"') + 5])
    assert store.load() == [a, b]


def test_a_garbage_line_in_the_middle_keeps_the_rest(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    a, b, c = _three(store)
    lines = store.path.read_text().splitlines()
    lines.insert(2, "\x00\x01{{{ not json")
    store.path.write_text("\n".join(lines) + "\n")
    assert store.load() == [a, b, c]


def test_a_state_path_that_is_a_directory_is_kept_aside(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.path.mkdir()
    assert store.load() == []
    assert not store.path.exists() and [p.is_dir() for p in tmp_path.glob("state.json.corrupt-*")] == [True]
    store.save([T])
    assert store.load() == [T]


def test_deep_nesting_is_damage_not_a_crash(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    for depth in (100_000, 30_000):  # one longer than any entry may be, one that parses to RecursionError
        store.path.write_text("[" * depth)
        assert store.load() == []
    assert parse_state(b'{"version": 1, "tenants": [' + b"[" * 30_000 + b"]}")[0] == []


def test_another_version_is_not_read_line_by_line(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    _three(store)
    store.path.write_text(store.path.read_text().replace('"version": 1', '"version": 2')[:-3])
    assert store.load() == []


def test_the_subtree_decides_where_a_created_tenant_may_live(tmp_path: Path) -> None:
    store = StateStore(tmp_path, "unisched-test-x")
    mine = SavedTenant("m", 100, Priority.OFFLINE, frozenset({Engine.COMPUTE}), None, "/unisched-test-x/m", False, 0)
    store.save([mine, T])
    assert store.load() == [mine]  # T claims /unisched/a, outside this daemon's subtree


# --- the tick's saves encode only what changed ---------------------------------------------------------------
def _fields(t: SavedTenant) -> tuple[object, ...]:
    return (t.name, t.weight, t.priority, t.engines, t.gpus, t.cgroup, t.adopted, t.owner_uid, t.limits, t.ephemeral,
            t.labels)


def test_the_line_cache_writes_what_encode_writes_and_encodes_again_only_changed_tenants(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from unisched.scheduler import state

    ts = [replace(T, name=n, cgroup=f"/unisched/{n}") for n in ("a", "b", "c")]
    cache = state.LineCache()
    line, encoded = state._line, []

    def body(tenants: list[SavedTenant]) -> list[str]:
        encoded.clear()
        monkeypatch.setattr(state, "_line", lambda t: encoded.append(t.name) or line(t))
        got = cache.body(map(_fields, tenants))
        monkeypatch.setattr(state, "_line", line)
        assert got == StateStore.encode(tenants) and parse_state(got)[0] == tenants
        return encoded

    assert body(ts) == ["a", "b", "c"]
    assert body(ts) == []
    ts[1] = replace(ts[1], weight=300)
    assert body(ts) == ["b"]
    ts[2] = replace(ts[2], labels={"pod": "p"})
    assert body(ts) == ["c"]
    assert body(ts[1:]) == []  # a removed: forgotten
    assert body(ts) == ["a"]  # and made again when it is back
