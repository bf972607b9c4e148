"""The client library as its own distribution: protobuf only, the wire module only, and extras that say their name."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT, child_env

CLIENTS = ROOT / "clients"
BLOCKED_BY_EXTRA = {"torch": "torch", "cuda": "pycuda", "gl": "OpenGL", "av": "av"}
"""Each integration module (named like its extra) and the library a machine without that extra lacks."""
DAEMON_ONLY = ("grpc", "rich", "prometheus_client", "structlog", "pynvml", "unisched")


def _import_without(module: str, blocked: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """Import `module` in a fresh interpreter where the `blocked` packages cannot be imported (None in sys.modules
    is the interpreter's own "not importable": the import fails with ModuleNotFoundError naming the package)."""
    code = f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\nimport {module}\n"
    return subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("extra", sorted(BLOCKED_BY_EXTRA))
def test_a_missing_extra_names_the_pip_command(extra: str) -> None:
    out = _import_without(f"unisched_client.{extra}", (BLOCKED_BY_EXTRA[extra],))
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last == (f"ModuleNotFoundError: unisched_client.{extra} needs {BLOCKED_BY_EXTRA[extra]}, which is not "
                     f"installed: pip install 'unisched-client[{extra}]'")


def test_the_core_imports_without_the_daemons_dependencies_or_any_extra() -> None:
    """An app container has protobuf and this distribution only: the client and the wire frames import there."""
    blocked = (*DAEMON_ONLY, *BLOCKED_BY_EXTRA.values())
    out = _import_without("unisched_client, unisched_wire.leasewire, unisched_wire.tenantenv", blocked)
    assert out.returncode == 0, out.stderr


def test_the_distribution_depends_on_protobuf_only_with_one_extra_per_integration() -> None:
    project = tomllib.loads((CLIENTS / "pyproject.toml").read_text())["project"]
    assert project["name"] == "unisched-client"
    assert [dep.split(">")[0].split("=")[0] for dep in project["dependencies"]] == ["protobuf"]
    assert set(project["optional-dependencies"]) == set(BLOCKED_BY_EXTRA)
    daemon = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"unisched-client=={project['version']}" in daemon["dependencies"]


def test_the_client_imports_only_the_standard_library_protobuf_the_wire_and_its_extras() -> None:
    """Beyond import-linter's forbidden list: an allow-list, so a new dependency cannot creep in unnamed."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the test extra)")
    sys.path[:0] = [str(CLIENTS)]
    try:
        graph = grimp.build_graph("unisched_client", "unisched_wire", include_external_packages=True)
    finally:
        del sys.path[0]
    imported = {imp.split(".")[0] for mod in graph.find_descendants("unisched_client") | {"unisched_client"}
                for imp in graph.find_modules_directly_imported_by(mod)}
    allowed = {"unisched_client", "unisched_wire", "google", *BLOCKED_BY_EXTRA.values(), *sys.stdlib_module_names}
    assert imported - allowed == set()
    wire = {imp for mod in graph.find_descendants("unisched_client")
            for imp in graph.find_modules_directly_imported_by(mod) if imp.startswith("unisched_wire")}
    assert wire == {"unisched_wire.unisched_pb2", "unisched_wire.leasewire", "unisched_wire.tenantenv"}


CLIENT_CONTRACT = "The client library imports only the wire module (and the standard library and protobuf) "


def _lint_a_copy(tmp_path: Path, added_import: str | None) -> subprocess.CompletedProcess[str]:
    """lint-imports with this checkout's contracts on a copy of the client package, `added_import` added to one of
    its modules (the daemon's package comes from this checkout)."""
    lint = shutil.which("lint-imports")
    if lint is None:
        pytest.skip("lint-imports is not installed (pip install -e '.[test]')")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for package in ("unisched_client", "unisched_wire"):
        shutil.copytree(CLIENTS / package, tmp_path / "clients" / package, ignore=shutil.ignore_patterns("__pycache__"))
    if added_import is not None:
        with (tmp_path / "clients" / "unisched_client" / "renewals.py").open("a") as f:
            f.write(f"\nimport {added_import}  # noqa: E402\n")
    env = {**child_env(), "PYTHONPATH": f"{tmp_path / 'clients'}:{ROOT}"}
    return subprocess.run([lint, "--config", str(tmp_path / "pyproject.toml"), "--no-cache"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("forbidden", ["grpc", "unisched.scheduler.clock", "unisched_wire.unisched_pb2_grpc"])
def test_the_import_contract_breaks_when_the_client_imports_grpc_or_the_daemon(tmp_path: Path, forbidden: str) -> None:
    out = _lint_a_copy(tmp_path, forbidden)
    assert out.returncode == 1, out.stdout[-3000:]
    report = " ".join(out.stdout.split())
    assert f"{CLIENT_CONTRACT}BROKEN" in report and re.search(r"Contracts: \d+ kept, 1 broken\.", report), report[-3000:]
    assert f"unisched_client.renewals -> {forbidden}" in report, report[-3000:]


def test_the_import_contract_holds_on_an_unchanged_copy(tmp_path: Path) -> None:
    """The control for the test above: the copy alone keeps every contract, so what broke it was the import."""
    out = _lint_a_copy(tmp_path, None)
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"{CLIENT_CONTRACT}KEPT" in " ".join(out.stdout.split())
