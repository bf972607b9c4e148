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

from unisched.cli.main import build_parser
from unisched.engine.config import (
    DEFAULT_AGENT_SOCKET,
    DEFAULT_SOCKET,
    DEFAULT_STATE_DIR,
    ConfigError,
    DaemonConfig,
    load_config,
)
from unisched.policy import Engine, Mode, Priority

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
    assert argv == ["/usr/local/bin/unisched", "serve", "--config", "/etc/unisched/unisched.toml"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert Path(argv[0]).name in scripts
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.config == "/etc/unisched/unisched.toml"
    assert svc["Type"] == ["simple"]
    # the directories systemd creates are the ones the defaults use
    assert svc["RuntimeDirectory"] == ["unisched"]
    assert Path(DEFAULT_SOCKET).parent == Path(DEFAULT_AGENT_SOCKET).parent == Path("/run/unisched")
    assert svc["StateDirectory"] == ["unisched"] and DEFAULT_STATE_DIR == "/var/lib/unisched"
    assert svc["ConfigurationDirectory"] == ["unisched"]
    # a stop thaws every tenant: SIGTERM to the daemon, time to finish, restart on crashes but not on bad config
    assert svc["KillSignal"] == ["SIGTERM"] and svc["KillMode"] == ["mixed"]
    assert int(svc["TimeoutStopSec"][0]) >= 10
    assert svc["Restart"] == ["on-failure"] and svc["RestartPreventExitStatus"] == ["2"]
    assert svc["Delegate"] == ["yes"]
    assert "ProtectControlGroups" not in svc and "PrivateDevices" not in svc
    assert _unit()["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/unisched", shutil.which("true") or "/bin/true"))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
