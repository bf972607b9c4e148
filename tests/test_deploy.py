"""deploy/: the default config loads and names every key the loader accepts; the systemd unit runs `unisched
serve` with that config, the directories the defaults use, and a stop that leaves time to thaw."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from conftest import ROOT

from unisched.cli.parser import build_parser
from unisched.policy import Engine, Mode, Priority
from unisched.scheduler.config import (
    DEFAULT_AGENT_SOCKET,
    DEFAULT_RUNTIME_AGENT_SOCKET,
    DEFAULT_SOCKET,
    DEFAULT_STATE_DIR,
    ConfigError,
    DaemonConfig,
    load_config,
)

CONFIG = ROOT / "deploy" / "unisched.toml"
UNIT = ROOT / "deploy" / "systemd" / "unisched.service"
SYSUSERS = ROOT / "deploy" / "sysusers.d" / "unisched.conf"
_SETTING = re.compile(r"^#?(\w+) = ")


def _allowed_keys(tmp_path: Path, toml: str) -> set[str]:
    """The keys the loader accepts, as its own error message for an unknown key lists them."""
    bad = tmp_path / "probe.toml"
    bad.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    return set(str(e.value).split("allowed keys: ", 1)[1].split(", "))


def _unit() -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_default_config_loads_and_states_the_defaults() -> None:
    assert load_config(CONFIG) == DaemonConfig()


def test_default_config_names_every_key_once(tmp_path: Path) -> None:
    daemon_keys = _allowed_keys(tmp_path, "[daemon]\nno_such_key = 1\n")
    tenant_keys = _allowed_keys(tmp_path, '[[tenants]]\nname = "a"\nno_such_key = 1\n')
    settings = [m.group(1) for line in CONFIG.read_text().splitlines() if (m := _SETTING.match(line))]
    twice = {k: n for k, n in Counter(settings).items() if n > 1}
    assert twice == {"weight": 2}  # in [[tenants]] and [[tidal]]; every other key once
    assert daemon_keys <= set(settings), f"not in {CONFIG.name}: {sorted(daemon_keys - set(settings))}"
    assert tenant_keys <= set(settings), f"not in {CONFIG.name}: {sorted(tenant_keys - set(settings))}"
    assert {"tenant", "start", "end"} <= set(settings)  # [[tidal]]


def test_default_config_with_everything_uncommented_loads(tmp_path: Path) -> None:
    text = "\n".join(
        line[1:] if line.startswith("#") and (_SETTING.match(line) or line.startswith("#[[")) else line
        for line in CONFIG.read_text().splitlines()
    )
    text = text.replace('mode = "shared"', 'mode = "tidal"')  # [[tidal]] windows need tidal mode
    full = tmp_path / "full.toml"
    full.write_text(text)
    cfg = load_config(full)
    assert cfg.mode is Mode.TIDAL
    assert cfg.listen and cfg.tls_cert and cfg.tls_key and cfg.tls_client_ca  # listener keys are spelled right
    assert (cfg.socket_group, cfg.admin_group) == ("unisched", "unisched-admin")
    (t,) = cfg.tenants
    assert (t.name, t.weight, t.priority, t.gpus) == ("inference", 400, Priority.ONLINE, (0,))
    assert t.engines == {Engine.COMPUTE, Engine.DECODE}
    assert (t.limits.render, t.limits.decode, t.limits.encode, t.limits.memory_bytes) == (2, 4, 0, 40 << 30)
    assert cfg.tidal.weight_at("inference", 400, 12 * 3600) == 800
    assert tomllib.loads(text)["daemon"]["metrics_port"] == 0


def test_sysusers_creates_the_groups_the_config_names() -> None:
    groups = {line.split()[1] for line in SYSUSERS.read_text().splitlines() if line.startswith("g ")}
    assert groups == {"unisched", "unisched-admin"}
    text = CONFIG.read_text()
    assert '#socket_group = "unisched"' in text and '#admin_group = "unisched-admin"' in text


def test_unit_runs_serve_with_the_default_config() -> None:
    svc = _unit()["Service"]
    (exec_start,) = svc["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv == ["/usr/local/bin/unisched", "serve", "--config", "/etc/unisched/unisched.toml", "--delegated"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert Path(argv[0]).name in scripts
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.config == "/etc/unisched/unisched.toml" and args.delegated
    # sd_notify: ready when the sockets answer, and a watchdog the slice loop feeds
    assert svc["Type"] == ["notify"] and svc["NotifyAccess"] == ["main"] and int(svc["WatchdogSec"][0]) >= 10
    # the directories systemd creates are the ones the defaults use
    assert svc["RuntimeDirectory"] == ["unisched unisched-runtime"]
    assert Path(DEFAULT_SOCKET).parent == Path(DEFAULT_AGENT_SOCKET).parent == Path("/run/unisched")
    assert Path(DEFAULT_RUNTIME_AGENT_SOCKET).parent == Path("/run/unisched-runtime")  # (the daemon narrows it to 0700)
    assert svc["StateDirectory"] == ["unisched"] and DEFAULT_STATE_DIR == "/var/lib/unisched"
    assert svc["ConfigurationDirectory"] == ["unisched"]
    # a stop thaws every tenant and leaves them running: SIGTERM to the daemon only, time to finish, restart on
    # crashes but not on bad config
    assert svc["KillSignal"] == ["SIGTERM"] and svc["KillMode"] == ["process"]
    assert int(svc["TimeoutStopSec"][0]) >= 10
    assert svc["Restart"] == ["on-failure"] and svc["RestartPreventExitStatus"] == ["2"]
    assert svc["Delegate"] == ["yes"]
    # it writes cgroups and opens /dev/nvidia*; tenants live in its cgroup, so no cgroup-level device or IP policy
    for kept_open in ("ProtectControlGroups", "PrivateDevices", "DeviceAllow", "ProtectClock", "IPAddressDeny", "MemoryMax"):
        assert kept_open not in svc, kept_open
    caps = set(svc["CapabilityBoundingSet"][0].split())
    assert {"CAP_SYS_ADMIN", "CAP_BPF", "CAP_SYS_PTRACE"} <= caps and not caps & {"CAP_SETUID", "CAP_SYS_MODULE"}
    assert _unit()["Install"]["WantedBy"] == ["multi-user.target"]
    assert svc["OOMScoreAdjust"] == ["-900"]  # the host's OOM killer picks a tenant first
    assert int(svc["FileDescriptorStoreMax"][0]) >= 256  # session hooks carried over a restart (transport/carry.py)
    # each setting said once: a second copy of a block would be read as the last one alone, silently
    assert not {k: v for k, v in svc.items() if len(v) > 1}


def test_package_ships_the_unit_and_the_config_install_service_writes() -> None:
    from unisched.cli.service import default_config, unit_template

    assert unit_template() == UNIT.read_text()
    assert default_config() == (ROOT / "deploy" / "unisched.toml").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/unisched", shutil.which("true") or "/bin/true"))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


SECURITY_EXPOSURE_MAX = 5.0
"""`systemd-analyze security`'s 0-10 scale: 5 and below is "OK" or better (the unit was 9.5, UNSAFE)."""


def _security_exposure(unit: Path) -> float | None:
    """The overall exposure systemd-analyze gives the unit file, or None when this systemd cannot rate files
    offline (--offline needs systemd 250)."""
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
                         capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
    return float(found.group(1)) if found else None


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_hardening_exposure_is_at_most_five(tmp_path: Path) -> None:
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text())
    exposure = _security_exposure(unit)
    if exposure is None:
        pytest.skip("this systemd-analyze cannot rate a unit file offline (needs systemd >= 250)")
    assert exposure <= SECURITY_EXPOSURE_MAX
    # the rating is of this file: the unit without its hardening block is rated worse
    bare = tmp_path / "bare" / UNIT.name
    bare.parent.mkdir()
    bare.write_text(UNIT.read_text().split("# Hardening:", 1)[0] + "[Install]\nWantedBy=multi-user.target\n")
    bare_exposure = _security_exposure(bare)
    assert bare_exposure is not None and bare_exposure > SECURITY_EXPOSURE_MAX
