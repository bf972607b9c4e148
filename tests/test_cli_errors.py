"""Bad input gives a clear error and a non-zero exit, and a running daemon is unaffected."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Daemon, child_env, cli, freezer_unavailable_reason


def test_bad_flags_fail_before_contacting_anything() -> None:
    for args, text in [
        (("run", "--tenant", "a", "--weight", "0", "--", "true"), "weight must be in 1..10000, got 0"),
        (("run", "--tenant", "a", "--weight", str(10**9), "--", "true"), "weight must be in 1..10000"),
        (("run", "--tenant", "a", "--weight", "x", "--", "true"), "weight must be an integer"),
        (("run", "--tenant", "a", "--engines", "warp", "--", "true"), "engines must be a comma list"),
        (("set-weight", "--tenant", "a"), "--weight"),
        (("serve", "--mode", "fast"), "invalid choice: 'fast'"),
        (("run", "--tenant", "a", "--gpus", "2147483648", "--", "true"), "gpus must be a comma list of GPU indices 0..255"),
        (("set-limit", "--tenant", "a", "--render", "2147483648"), "must be in 0..100000, or -1 to clear"),
        (("set-limit", "--tenant", "a", "--memory", "9223372036854775807"), "at most 1PiB"),
    ]:
        out = cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert text in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


@pytest.mark.parametrize(("flags", "text"), [
    (("--state-dir", "/etc/hostname/state"), "config 'state_dir': /etc/hostname is not a directory"),
    (("--socket", "relative.sock"), "config 'socket': must be an absolute path"),
    (("--metrics-port", "19999", "--metrics-listen", "bad host!"), "config 'metrics_listen': cannot resolve 'bad host!'"),
])
def test_check_config_refuses_places_the_daemon_could_not_start_on(tmp_path: Path, flags: tuple[str, ...],
                                                                    text: str) -> None:
    """What --check-config passes, a start passes too: these failed only half-way through a start, with a bare errno
    and exit 1, which systemd restarts for ever."""
    base = ("--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state"), "--no-nvml")
    for args in (("serve", "--check-config", *base, *flags), ("serve", *base, *flags)):
        out = cli(*args)
        assert out.returncode == 2 and text in out.stderr, (args, out.stderr)


def test_a_tls_file_that_is_not_pem_is_named(tmp_path: Path) -> None:
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82\x01\x0a not a PEM file")
    tls = ("--tls-ca", str(not_pem), "--tls-cert", str(not_pem), "--tls-key", str(not_pem))
    out = cli("status", "--target", "127.0.0.1:1", *tls)
    assert out.returncode == 1 and f"TLS file {not_pem} is not PEM" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the check as another uid")
def test_a_config_can_be_checked_by_a_user(short_dir: Path) -> None:
    """--check-config starts and changes nothing: an operator or a CI job may lint a config without root."""
    short_dir.chmod(0o755)
    config = short_dir / "u.toml"
    config.write_text((ROOT / "deploy" / "unisched.toml").read_text())
    config.chmod(0o644)
    out = subprocess.run([sys.executable, "-c", AS_NOBODY, "serve", "--config", str(config), "--check-config",
                          "--no-nvml"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=child_env())
    assert out.returncode == 0 and "config OK" in out.stdout, out.stderr
    assert "the daemon itself must run as root" in out.stderr


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
    cg = Path(st["cgroup_root"]) / f"{tenant_prefix}-ctr"  # a container's cgroup, outside the tenants' subtree
    cg.mkdir()
    try:
        out = daemon.cli("adopt", "--tenant", f"{tenant_prefix}ctr", "--weight", "400", "--cgroup", str(cg))
        assert out.returncode == 0, out.stderr
        assert "session admission" in out.stdout  # says what adopt cannot do
        t = next(t for t in daemon.tenants() if t["name"] == f"{tenant_prefix}ctr")
        assert t["adopted"] and t["weight"] == 400 and t["cgroup"] == f"/{tenant_prefix}-ctr"
    finally:
        daemon.cli("remove", "--tenant", f"{tenant_prefix}ctr")
        cg.rmdir()


# --- serve: every bad config value exits 2 before anything starts, naming the key --------------------------
def _serve(tmp_path: Path, config: Path | str, *extra: str) -> tuple[int, str, bool]:
    """(exit code, stderr, whether anything was started: the socket or the state directory)."""
    sock, state = tmp_path / "run" / "s.sock", tmp_path / "state"
    out = cli("serve", "--config", str(config), "--socket", str(sock), "--state-dir", str(state), "--no-nvml", *extra)
    return out.returncode, out.stderr, sock.exists() or state.exists() or sock.parent.exists()


@pytest.mark.parametrize(
    ("body", "key"),
    [
        (b"[daemon]\nsocket = '/tmp/\xe9.sock'\n", "is not UTF-8 text"),
        (b"[[tenants]]\nname = 'a'\nmemory = '1e400GiB'\n", "tenants[0] 'memory'"),
        (b"[[tenants]]\nname = 123\n", "tenants[0] 'name'"),
        (b"[daemon]\nmode = 'preemptive'\n", "[daemon] 'mode': belongs in [policy]"),
        (b"[[tenants]]\nname = 'a'\ncgroup = '/x/../../etc'\n", "tenants[0] 'cgroup'"),
        (b"[daemon]\nsocket_group = 'no-such-group-x'\n", "'socket_group': group 'no-such-group-x' does not exist"),
    ],
)
def test_bad_config_exits_2_naming_the_key_before_anything_starts(tmp_path: Path, body: bytes, key: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_bytes(body)
    rc, err, started = _serve(tmp_path, cfg)
    assert rc == 2 and key in err and "Traceback" not in err, err
    assert not started


def test_a_directory_as_the_config_exits_2(tmp_path: Path) -> None:
    rc, err, started = _serve(tmp_path, tmp_path)
    assert rc == 2 and "is a directory" in err and "Traceback" not in err, err
    assert not started


@pytest.mark.skipif(freezer_unavailable_reason() is not None, reason=str(freezer_unavailable_reason()))
@pytest.mark.parametrize(
    ("body", "key"),
    [
        ("[[tenants]]\nname = 'a'\ngpus = [5]\n", "tenants[0] 'gpus': no GPU 5 on this host"),
        ("[[tenants]]\nname = 'a'\ncgroup = '/no-such-cgroup-x'\n", "tenants[0] 'cgroup': cgroup '/no-such-cgroup-x' "
                                                                   "does not exist"),
        ("[[tenants]]\nname = 'a'\ncgroup = '/unisched'\n", "tenants[0] 'cgroup': cgroup /unisched holds every tenant"),
    ],
)
def test_config_checked_against_the_host_exits_2_before_anything_starts(tmp_path: Path, body: str, key: str) -> None:
    """GPUs and declared cgroups need the host (NVML, the cgroup mount): checked before the engine starts."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(body)
    for extra in ((), ("--check-config",)):
        rc, err, started = _serve(tmp_path, cfg, *extra)
        assert rc == 2 and key in err and "Traceback" not in err, (extra, err)
        assert not started


@pytest.mark.skipif(freezer_unavailable_reason() is not None, reason=str(freezer_unavailable_reason()))
def test_check_config_says_ok_and_starts_nothing(tmp_path: Path) -> None:
    cfg = tmp_path / "good.toml"
    cfg.write_text("[daemon]\nadmin_group = 'no-such-group-x'\n[policy]\nmode = 'preemptive'\n"
                   "[[tenants]]\nname = 'infer'\ngpus = [0]\n")
    out = cli("serve", "--check-config", "--config", str(cfg), "--socket", str(tmp_path / "run" / "s.sock"),
              "--state-dir", str(tmp_path / "state"), "--no-nvml")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("config OK: ") and "mode preemptive" in out.stdout and "infer" in out.stdout
    assert "admin_group 'no-such-group-x' does not exist: only root will be admin" in out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "state").exists()
    bad = tmp_path / "bad.toml"
    bad.write_text("[policy]\nslice_ms = 0\n")
    out = cli("serve", "--check-config", "--config", str(bad))
    assert out.returncode == 2 and "'slice_ms': must be a number in 1..10000" in out.stderr


def test_version() -> None:
    from unisched import __version__

    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"unisched {__version__}"


def test_a_reader_that_goes_away_ends_the_command_quietly(daemon: Daemon, tenant_prefix: str) -> None:
    """`unisched tenants --json | head -1`: the pipe closes early; no traceback, the shell's code for SIGPIPE."""
    for n in range(40):  # enough output to outgrow the pipe's buffer
        assert daemon.cli("run", "--tenant", f"{tenant_prefix}{n}", "--keep", "--", "true").returncode == 0
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes
    with open(w, "wb", closefd=True) as out:
        p = subprocess.run([sys.executable, "-m", "unisched", "tenants", "--json", "--socket", daemon.socket],
                           stdout=out, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT, timeout=60)
    assert p.returncode == 141 and "Traceback" not in p.stderr, p.stderr


def test_an_adopted_cgroup_s_processes_include_those_below_it(daemon: Daemon, tenant_prefix: str) -> None:
    """A pod's processes sit in its containers' cgroups below the pod's: the tenant's process list (and so its
    memory and whether NVML sees it on a GPU) counts them."""
    st = daemon.status()
    cg = Path(st["cgroup_root"]) / f"{tenant_prefix}-pod"
    ctr = cg / "ctr"
    ctr.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    name = f"{tenant_prefix}pod"
    try:
        (ctr / "cgroup.procs").write_text(str(sleeper.pid))
        out = daemon.cli("adopt", "--tenant", name, "--weight", "100", "--cgroup", str(cg))
        assert out.returncode == 0, out.stderr
        t = next(t for t in daemon.tenants() if t["name"] == name)
        assert t["pids"] == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait(10)
        daemon.cli("remove", "--tenant", name)
        ctr.rmdir()
        cg.rmdir()


AS_NOBODY = """
import os, sys
import grpc._channel, grpc._plugin_wrapping  # (grpc imports these lazily)
import unisched.daemon  # (imported lazily by serve)
from unisched.cli.main import main  # everything imported while still root (the interpreter may live in /root)
os.setgroups([]); os.setgid(65534); os.setuid(65534)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_a_socket_the_user_may_not_open_is_named_as_such_not_as_no_daemon(short_dir: Path) -> None:
    """A user outside the socket's group is told so, not sent off to check whether the daemon runs."""
    import socket

    short_dir.chmod(0o755)
    path = short_dir / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()
        path.chmod(0o600)  # root's alone, as a daemon's socket is to users outside socket_group
        out = subprocess.run([sys.executable, "-c", AS_NOBODY, "status", "--socket", str(path)], capture_output=True,
                             text=True, timeout=30, cwd=ROOT, env=child_env())
    assert out.returncode == 1, out.stderr
    assert "permission denied on the unisched daemon's socket" in out.stderr, out.stderr
    assert "is `unisched serve` running" not in out.stderr


def test_every_command_says_what_it_does_with_an_example_and_every_option_has_help() -> None:
    import argparse

    from unisched.cli.parser import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        assert p.description, f"`unisched {name} --help` has no description"
        assert "example: " in (p.epilog or "") and f"unisched {name}" in (p.epilog or ""), f"{name}: no example"
        bare = [a.dest for a in p._actions if not isinstance(a, argparse._HelpAction) and not a.help]
        assert not bare, f"unisched {name}: options without help: {bare}"


def test_set_limit_says_a_memory_cap_as_it_was_given() -> None:
    from unisched.cli.commands import _fmt_size

    assert [_fmt_size(v) for v in (-1, 8 << 30, 512 << 20, (3 << 30) + 1, 1 << 40, 1536)] == [
        "unlimited", "8 GiB", "512 MiB", "3221225473 B", "1 TiB", "1536 B"]
