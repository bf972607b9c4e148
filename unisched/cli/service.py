"""`unisched install-service`: write the systemd unit with ExecStart running the interpreter that runs this
command (`python -m unisched serve`), so the unit works for a venv, a `pip install --user` or a system
install alike: no guess at where a console script went.

The unit's text is deploy/systemd/unisched.service (shipped in the package as unisched/cli/unisched.service), and
the config it names, where there is none, deploy/unisched.toml (shipped as unisched/cli/unisched.toml);
only the lines that depend on the install change: ExecStart, the PYTHONPATH that finds this package and its
wire package (unisched_wire, from the unisched-client distribution), and ProtectHome= (read-only instead of yes
when the interpreter or the package lives under /home or /root, which ProtectHome=yes would hide from the
daemon)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import unisched
import unisched_wire

__all__ = ["DEFAULT_CONFIG_PATH", "DEFAULT_UNIT_PATH", "Install", "render_unit", "unit_template"]

DEFAULT_UNIT_PATH = "/etc/systemd/system/unisched.service"
DEFAULT_CONFIG_PATH = "/etc/unisched/unisched.toml"
_HOMES = (Path("/home"), Path("/root"))


@dataclass(frozen=True)
class Install:
    """Where this unisched is installed, as the unit must name it."""

    python: str
    package_dir: str
    """The PYTHONPATH: the directories unisched and unisched_wire were imported from (one when they share it)."""
    config: str

    @classmethod
    def current(cls, config: str = DEFAULT_CONFIG_PATH) -> Install:
        # sys.executable as given, not resolved: a venv's python finds the venv through its own path
        dirs = (str(Path(pkg.__file__ or "").resolve().parent.parent) for pkg in (unisched, unisched_wire))
        return cls(sys.executable, os.pathsep.join(dict.fromkeys(dirs)), config)


def unit_template() -> str:
    return resources.files("unisched.cli").joinpath("unisched.service").read_text()


def default_config() -> str:
    """deploy/unisched.toml: every key with its default, as the package ships it."""
    return resources.files("unisched.cli").joinpath("unisched.toml").read_text()


def _write(target: Path, text: str) -> None:
    """`text` as `target`, mode 0644, atomically (a temporary file beside it, renamed over; removed on failure)."""
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _quote(value: str) -> str:
    """One systemd command-line word: '%' is a specifier, so doubled; quotes only where needed."""
    if any(c in value for c in '"\\\n\'') or not value:
        raise ValueError(f"path {value!r} cannot be written into a unit (quotes, backslashes or newlines)")
    value = value.replace("%", "%%")
    return f'"{value}"' if any(c.isspace() for c in value) else value


def _under_home(path: str) -> bool:
    p = Path(path)
    return any(p == h or h in p.parents for h in _HOMES)


def render_unit(template: str, install: Install) -> str:
    """The template with ExecStart, PYTHONPATH and ProtectHome= for `install`."""
    out = []
    for line in template.splitlines():
        if line.startswith("ExecStart="):
            rest = line.split(" serve ", 1)[1].split()
            rest[rest.index("--config") + 1] = _quote(install.config)
            line = f"ExecStart={_quote(install.python)} -m unisched serve {' '.join(rest)}"
        elif line == "Environment=PYTHONUNBUFFERED=1":
            line += "\n" + _quote(f"Environment=PYTHONPATH={install.package_dir}")
        elif line == "ProtectHome=yes" and (
            _under_home(install.python) or any(_under_home(d) for d in install.package_dir.split(os.pathsep))
        ):
            line = "# read-only, not yes: this interpreter or package lives under /home or /root\nProtectHome=read-only"
        out.append(line)
    return "\n".join(out) + "\n"


def install_service(unit_path: str, config: str) -> str:
    """Write the unit, and the config it names where there is none (each atomically, mode 0644); returns what to
    tell the operator. `config` is made absolute: systemd starts the daemon in /."""
    config = str(Path(config).absolute())
    text = render_unit(unit_template(), Install.current(config))
    target = Path(unit_path)
    if target.is_dir():
        raise OSError(f"{target} is a directory: name the unit file (e.g. {target / 'unisched.service'})")
    _write(target, text)
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    notes = [f"wrote {target} ({exec_start})"]
    if not Path(config).exists():
        _write(Path(config), default_config())
        notes.append(f"wrote {config}: every setting with its default (see docs/configuration.md)")
    notes.append("then: systemctl daemon-reload && systemctl enable --now unisched")
    return "\n".join(notes)
