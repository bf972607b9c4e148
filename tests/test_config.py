from __future__ import annotations

from pathlib import Path

import pytest

from unisched.policy import Engine, Mode, Priority
from unisched.policy.caps import MAX_MEMORY_BYTES
from unisched.scheduler.config import (
    DEFAULT_RUNTIME_AGENT_SOCKET,
    DEFAULT_SOCKET,
    ConfigError,
    DaemonConfig,
    DeclaredTenant,
    load_config,
    parse_size,
    runtime_agent_socket_beside,
)
from unisched.scheduler.hostcheck import check_gpus, check_groups, check_places


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "unisched.toml"
    p.write_text(text)
    return p


def test_full_config_is_parsed(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, """
[daemon]
socket = "/tmp/x.sock"
admin_group = "gpuadmin"
[policy]
mode = "tidal"
slice_ms = 40
[[tenants]]
name = "render"
weight = 300
priority = "online"
engines = ["graphics", "encode"]
gpus = [0]
[[tidal]]
tenant = "render"
start = "20:00"
end = "06:00"
weight = 50
"""))
    assert cfg.socket == "/tmp/x.sock" and cfg.mode is Mode.TIDAL and cfg.slice_ms == 40.0
    t = cfg.tenants[0]
    assert (t.name, t.weight, t.priority, t.engines, t.gpus) == (
        "render", 300, Priority.ONLINE, frozenset({Engine.GRAPHICS, Engine.ENCODE}), (0,))
    assert cfg.tidal.weight_at("render", 300, 23 * 3600) == 50
    assert cfg.tidal.weight_at("render", 300, 12 * 3600) == 300


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[policy]\nmode = 'fast'", "'mode': must be one of shared, preemptive, timeshare, tidal; got 'fast'"),
        ("[policy]\nslice_ms = 0", "'slice_ms': must be a number in 1..10000"),
        ("[daemon]\nsockett = 'x'", "'sockett': unknown key"),
        ("[policy\nmode = 1", "not valid TOML"),
        ("[[tenants]]\nname = 'a'\nweight = 0", "tenants[0] 'weight': must be an integer in 1..10000; got 0"),
        ("[[tenants]]\nname = 'a'\nweight = 1000000000", "tenants[0] 'weight'"),
        ("[[tenants]]\nname = 'a b'", "tenants[0] 'name'"),
        ("[[tenants]]\nname = 'a'\nengines = ['gpu']", "'engines': each must be one of compute, graphics, decode, encode"),
        ("[[tenants]]\nname = 'a'\n[[tenants]]\nname = 'a'", "names must be unique"),
        ("[[tidal]]\ntenant = 'a'\nstart = '08:00'\nend = '09:00'\nweight = 5", "need mode = \"tidal\""),
        ("[policy]\nmode = 'tidal'\n[[tidal]]\ntenant = 'a'\nstart = '25:00'\nend = '09:00'\nweight = 5", "'HH:MM'"),
        ("[daemon]\nlisten = 'nohost'", "'listen': must be HOST:PORT"),
        ("[gpus]\nx = 1", "'gpus': unknown section"),
        ("[[tenants]]\nname = 'a'\ngpus = [false]", "tenants[0] 'gpus': must be a list of GPU indices 0..255"),
        ("[[tenants]]\nname = 'a'\ngpus = 0", "tenants[0] 'gpus': must be a list of GPU indices 0..255"),
        ("[[tenants]]\nname = 'a'\nmemory = '1025TiB'\nmemory_reserve = '1GiB'", "tenants[0] 'memory': size must be"),
        ("[[tenants]]\nname = 'a'\nmemory = '1GiB'\nmemory_reserve = '2GiB'", "tenants[0] 'memory_reserve'"),
    ],
)
def test_bad_config_names_the_key_and_allowed_values(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert message in str(e.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_flags_override_the_file_and_are_validated(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "[policy]\nslice_ms = 40\nmode = 'preemptive'"))
    out = cfg.with_overrides(slice_ms=20.0, mode=None, socket="/tmp/y.sock")
    assert out.slice_ms == 20.0 and out.mode is Mode.PREEMPTIVE and out.socket == "/tmp/y.sock"
    with pytest.raises(ConfigError, match="flag 'slice_ms'"):
        DaemonConfig().with_overrides(slice_ms=0.0)


def test_serve_help_names_the_defaults_the_daemon_runs_with() -> None:
    """Every `serve` option whose help says "default X" and that sets a DaemonConfig field names that field's value:
    the MPS cap's help said 30 after the default became 70."""
    import argparse
    import dataclasses
    import re

    from unisched.cli.parser import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    fields = {f.name for f in dataclasses.fields(DaemonConfig)}
    d = DaemonConfig()
    checked = []
    for action in sub.choices["serve"]._actions:
        m = re.search(r"\bdefault ([^\s;:)]+)", action.help or "")
        if m is None or action.dest not in fields:
            continue
        value = getattr(d, action.dest)
        said = m.group(1)
        if isinstance(value, bool | str):
            assert said == str(value), (action.dest, said, value)
        else:
            assert float(said) == float(value), (action.dest, said, value)
        checked.append(action.dest)
    # the options that name a default; one that stops saying it (or whose dest stops matching a field) fails here
    assert set(checked) >= {"socket", "metrics_port", "metrics_listen", "state_dir", "mode", "slice_ms", "saturated_util",
                            "lease_timeout_ms", "lease_max_run_ms", "mix_period_ms", "mps_offline_sm_percent",
                            "cgroup_driver", "contention", "log_format", "log_level"}, checked


# --- every bad value is a ConfigError naming its key (never a traceback, never accepted) ---------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[tenants]]\nname = 'a'\nmemory = '1e400GiB'", "tenants[0] 'memory': size must be"),
        ("[[tenants]]\nname = 'a'\nmemory = '-1GiB'", "tenants[0] 'memory': size must be"),
        ("[[tenants]]\nname = 'a'\nmemory = 'nanGiB'", "tenants[0] 'memory': size must be"),
        ("[[tenants]]\nname = 'a'\nmemory = 9999999999999999999999", "tenants[0] 'memory': size must be"),
        ("[[tenants]]\nname = 'a'\nmemory = '9999999999TiB'", "tenants[0] 'memory': size must be"),
        ("[[tenants]]\nname = 123", "tenants[0] 'name': must be a string"),
        ("[[tenants]]\nname = true", "tenants[0] 'name': must be a string"),
        ("[[tenants]]\nname = 'a'\nrender = -1", "tenants[0] 'render'"),
        ("[[tenants]]\nname = 'a'\ncgroup = '/a/../b'", "tenants[0] 'cgroup': must be a cgroup path without"),
        ("[[tenants]]\nname = 'a'\ncgroup = '..'", "tenants[0] 'cgroup'"),
        ("[[tenants]]\nname = 'a'\ncgroup = '/'", "tenants[0] 'cgroup'"),
        ("[[tenants]]\nname = 'a'\ncgroup = 5", "tenants[0] 'cgroup'"),
        ("[daemon]\nmode = 'shared'", "config [daemon] 'mode': belongs in [policy]"),
        ("[daemon]\nslice_ms = 20", "config [daemon] 'slice_ms': belongs in [policy]"),
        ("[policy]\nsocket = '/x.sock'", "config [policy] 'socket': belongs in [daemon]"),
        ("[policy]\nmode = 'tidal'\n[[tidal]]\ntenant = 123\nstart = '08:00'\nend = '09:00'\nweight = 5",
         "tidal[0] 'tenant'"),
        ("[policy]\nmode = 'tidal'\n[[tidal]]\ntenant = 'a'\nstart = '08:00'\nend = '09:00'\nweight = 'x'",
         "tidal[0] 'weight'"),
    ],
)
def test_bad_values_name_their_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert message in str(e.value)


def test_a_file_that_is_not_utf8_or_not_a_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"[daemon]\nsocket = '/tmp/\xe9.sock'\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(bad)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_sizes() -> None:
    assert parse_size("8GiB") == 8 << 30 and parse_size(512) == 512 and parse_size("1.5k") == 1536
    with pytest.raises(ValueError, match="size must be a whole number of bytes without a unit"):
        parse_size("1.5")  # became 1 byte
    assert parse_size("1PiB") == parse_size(str(MAX_MEMORY_BYTES)) == MAX_MEMORY_BYTES  # the most any cap takes
    for bad in ("1e400GiB", "inf", "-1", "8XB", "", True, None, "9223372036854775807", str(MAX_MEMORY_BYTES + 1),
                "2048TiB", 2.5e30):
        with pytest.raises(ValueError, match="size must be"):
            parse_size(bad)


def test_declared_gpus_are_checked_against_the_host() -> None:
    cfg = DaemonConfig(tenants=(DeclaredTenant("a", gpus=(1,)), DeclaredTenant("b", gpus=(5,))))
    with pytest.raises(ConfigError, match=r"tenants\[1\] 'gpus': no GPU 5 on this host, which has GPUs \[0, 1\]"):
        check_gpus(cfg, [0, 1])
    check_gpus(DaemonConfig(tenants=(DeclaredTenant("a", gpus=(0,)),)), [])  # no GPU seen: 0 is the host
    with pytest.raises(ConfigError, match=r"tenants\[0\] 'gpus': no GPU 1 .*no GPU the daemon can see"):
        check_gpus(DaemonConfig(tenants=(DeclaredTenant("a", gpus=(1,)),)), [])


def test_groups_socket_group_must_exist_admin_group_is_a_warning() -> None:
    assert check_groups(DaemonConfig(socket_group="root", admin_group="root")) == []
    with pytest.raises(ConfigError, match="'socket_group': group 'no-such-group-x' does not exist"):
        check_groups(DaemonConfig(socket_group="no-such-group-x"))
    (warning,) = check_groups(DaemonConfig(admin_group="no-such-group-x"))
    assert "only root will be admin" in warning


def test_a_daemon_on_its_own_socket_gets_its_runtime_agent_socket_beside_that_socket_s_directory() -> None:
    """Beside, not inside: the socket's directory is what pods get mounted, and the runtime agent socket must be
    in none of theirs. The default is the same rule applied to the default socket."""
    assert runtime_agent_socket_beside(DEFAULT_SOCKET) == DEFAULT_RUNTIME_AGENT_SOCKET
    assert DEFAULT_RUNTIME_AGENT_SOCKET == "/run/unisched-runtime/seccomp-agent.sock"
    own = DaemonConfig().with_overrides(socket="/run/second/d.sock")
    assert (own.agent_socket, own.runtime_agent_socket) == ("/run/second/seccomp-agent.sock",
                                                           "/run/second-runtime/seccomp-agent.sock")
    named = DaemonConfig().with_overrides(socket="/run/second/d.sock", runtime_agent_socket="/run/rt/a.sock")
    assert named.runtime_agent_socket == "/run/rt/a.sock"  # one given is kept


@pytest.mark.parametrize("runtime", ["/run/unisched/rt.sock", "/run/rt.sock", "/run/unisched/runtime/rt.sock",
                                     "/run/x/../unisched/rt.sock", "/run/unisched-runtime/../unisched/rt/rt.sock",
                                     "link"])
def test_the_runtime_agent_socket_s_directory_and_the_other_sockets_do_not_nest(runtime: str, tmp_path: Path) -> None:
    """The daemon makes that directory root's alone (0700), and it must be in no pod: the sockets everyone reaches
    would be unreachable below it, and above it would be the directory pods get mounted. Compared where the paths
    lead: a '..' or a link to the sockets' directory is that directory."""
    if runtime == "link":
        (tmp_path / "link").symlink_to("/run/unisched")
        runtime = str(tmp_path / "link" / "rt.sock")
    check_places(DaemonConfig())
    with pytest.raises(ConfigError, match=r"config 'runtime_agent_socket': its directory .* nests with /run/unisched"):
        check_places(DaemonConfig(runtime_agent_socket=runtime))


@pytest.mark.parametrize("socket", ["/run/d.sock", "/tmp/d.sock", "/srv/d.sock"])
def test_a_runtime_agent_socket_beside_a_top_level_directory_is_refused(socket: str) -> None:
    """A daemon given only --socket puts its runtime agent socket in "<socket's directory>-runtime": for a socket
    directly in /run or /tmp that would be a directory made at the filesystem's root (/run-runtime)."""
    config = DaemonConfig().with_overrides(socket=socket)
    assert Path(config.runtime_agent_socket).parent == Path(f"{Path(socket).parent}-runtime")
    with pytest.raises(ConfigError, match=r"config 'runtime_agent_socket': its directory /\w+-runtime would be made "
                                          r"at the filesystem's root.*set runtime_agent_socket"):
        check_places(config)
    check_places(DaemonConfig().with_overrides(socket=socket, runtime_agent_socket="/opt/unisched-runtime/rt.sock"))
