"""The client library as its own distribution: protobuf only, the wire module only, and extras that say their name."""

from __future__ import annotations

import subprocess
import sys
import tomllib

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
    wire = {imp for imp in graph.find_modules_directly_imported_by("unisched_client.client") if imp.startswith("unisched_wire")}
    assert wire == {"unisched_wire.unisched_pb2", "unisched_wire.leasewire", "unisched_wire.tenantenv"}
