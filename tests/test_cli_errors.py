"""Bad input gives a clear error and a non-zero exit, and a running daemon is unaffected."""

from __future__ import annotations

from pathlib import Path

from conftest import Daemon, cli


def test_bad_flags_fail_before_contacting_anything() -> None:
    for args, text in [
        (("run", "--tenant", "a", "--weight", "0", "--", "true"), "weight must be in 1..10000, got 0"),
        (("run", "--tenant", "a", "--weight", str(10**9), "--", "true"), "weight must be in 1..10000"),
        (("run", "--tenant", "a", "--weight", "x", "--", "true"), "weight must be an integer"),
        (("run", "--tenant", "a", "--engines", "warp", "--", "true"), "engines must be a comma list"),
        (("set-weight", "--tenant", "a"), "--weight"),
        (("serve", "--mode", "fast"), "invalid choice: 'fast'"),
    ]:
        out = cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert text in out.stderr, (args, out.stderr)


def test_missing_command(tmp_path: Path) -> None:
    out = cli("run", "--socket", str(tmp_path / "none.sock"), "--tenant", "a")
    assert out.returncode == 2 and "missing command" in out.stderr


def test_unreachable_daemon_is_named(tmp_path: Path) -> None:
    out = cli("tenants", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 1 and "cannot reach the unisched daemon" in out.stderr


def test_malformed_config_fails_serve_with_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[policy]\nslice_ms = -5\n")
    out = cli("serve", "--config", str(bad), "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path))
    assert out.returncode == 2
    assert "'slice_ms': must be a number in 1..10000; got -5" in out.stderr


def test_errors_against_a_running_daemon_leave_it_working(daemon: Daemon, tenant_prefix: str) -> None:
    name = f"{tenant_prefix}ok"
    assert daemon.cli("run", "--tenant", name, "--weight", "250", "--keep", "--", "true").returncode == 0
    for args, code, text in [
        (("set-weight", "--tenant", "ghost", "--weight", "5"), 1, "unknown tenant 'ghost'"),
        (("adopt", "--tenant", "x", "--cgroup", "../../etc"), 1, "must name a cgroup below"),
        (("adopt", "--tenant", "x", "--cgroup", "/no/such/cgroup"), 1, "does not exist"),
        (("remove", "--tenant", "ghost"), 1, "unknown tenant"),
        (("run", "--tenant", "bad name", "--", "true"), 1, "tenant name must be"),
        (("run", "--tenant", name, "--", "/no/such/binary"), 127, "command not found"),
    ]:
        out = daemon.cli(*args)
        assert out.returncode == code, (args, out.stderr)
        assert text in out.stderr, (args, out.stderr)
    assert daemon.proc.poll() is None
    assert [(t["name"], t["weight"]) for t in daemon.tenants()] == [(name, 250)]


def test_run_passes_the_exit_code_through(daemon: Daemon, tenant_prefix: str) -> None:
    out = daemon.cli("run", "--tenant", f"{tenant_prefix}rc", "--", "sh", "-c", "exit 7")
    assert out.returncode == 7


def test_adopt_an_existing_cgroup(daemon: Daemon, tenant_prefix: str) -> None:
    st = daemon.status()
    cg = Path(st["cgroup_root"]) / "unisched" / f"{tenant_prefix}ctr"
    cg.mkdir()
    out = daemon.cli("adopt", "--tenant", f"{tenant_prefix}ctr", "--weight", "400", "--cgroup", str(cg))
    assert out.returncode == 0, out.stderr
    assert "session admission" in out.stdout  # says what adopt cannot do
    t = next(t for t in daemon.tenants() if t["name"] == f"{tenant_prefix}ctr")
    assert t["adopted"] and t["weight"] == 400 and t["cgroup"] == f"/unisched/{tenant_prefix}ctr"
