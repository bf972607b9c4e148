"""The exposition of a running daemon follows Prometheus conventions, and pod tenants carry dcgm-exporter's labels.

The lint reads the real /metrics text of a daemon started from the command line (root, real cgroups), with a
tenant, so every per-tenant family has samples; `promtool check metrics` lints it too where it is installed
(Debian: apt-get install prometheus).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import wait_until
from inproc import free_port, in_process_server
from prometheus_client.parser import text_string_to_metric_families

from unisched.scheduler.labels import MAX_LABEL_CHARS
from unisched.scheduler.state import StateStore
from unisched.transport.client import DaemonClient, DaemonError
from unisched.transport.metric_names import FAMILIES, sample_names
from unisched_wire import unisched_pb2 as pb

_NAME = re.compile(r"^unisched_[a-z0-9_]+$")
_UNITS = ("_seconds", "_bytes", "_ratio")
_NOT_UNITS = ("_milliseconds", "_ms", "_percent", "_kb", "_mb", "_gb", "_mib", "_gib")


def _text(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        assert r.status == 200
        return str(r.read().decode())


def lint(text: str) -> list[str]:
    """What breaks Prometheus' naming rules in an exposition (empty: nothing)."""
    problems: list[str] = []
    helps = {m.group(1) for m in re.finditer(r"^# HELP (\S+) \S", text, re.M)}
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for fam in text_string_to_metric_families(text):
        name = fam.name + ("_total" if fam.type == "counter" else "")
        if not _NAME.match(name):
            problems.append(f"{name}: not unisched_[a-z0-9_]+")
        if name not in helps or name not in types:
            problems.append(f"{name}: no HELP or TYPE line")
        if (fam.type == "counter") != name.endswith("_total"):
            problems.append(f"{name}: a {fam.type} {'without' if fam.type == 'counter' else 'with'} _total")
        if any(name.endswith(bad) or f"{bad}_" in name for bad in _NOT_UNITS):
            problems.append(f"{name}: not in a base unit with its unit last (seconds, bytes, ratio)")
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            if key in seen:
                problems.append(f"{s.name}{s.labels}: twice")
            seen.add(key)
    return problems


def test_lint_finds_what_it_looks_for() -> None:
    """The lint itself: each rule catches a line that breaks it."""
    bad = ("# HELP unisched_x_seconds_total x\n# TYPE unisched_x_seconds_total counter\nunisched_x_seconds_total 1\n"
           "# TYPE unisched_y_percent gauge\nunisched_y_percent 1\n"
           "# HELP unisched_z z\n# TYPE unisched_z gauge\nunisched_z{a=\"1\"} 1\nunisched_z{a=\"1\"} 2\n")
    problems = lint(bad)
    assert "unisched_y_percent: no HELP or TYPE line" in problems
    assert any(p.startswith("unisched_y_percent: not in a base unit") for p in problems)
    assert any("twice" in p for p in problems)
    assert not any(p.startswith("unisched_x_seconds_total") for p in problems)


def test_the_list_of_families_follows_the_conventions() -> None:
    for f in FAMILIES:
        assert _NAME.match(f.sample) and f.kind in ("gauge", "counter"), f
        assert not f.name.endswith("_total"), f"{f.name}: prometheus-client adds _total to a counter"
        assert f.help.strip(), f
        unit = next((u for u in _UNITS if u in f.sample), None)
        assert unit is None or f.sample.removesuffix("_total").endswith(unit), f"{f.sample}: unit not last"
    assert len(sample_names()) == len(FAMILIES)
    # dcgm-exporter's label names, for joins with its series
    per_gpu = [f for f in FAMILIES if "gpu" in f.labels]
    assert per_gpu and all("UUID" in f.labels for f in per_gpu)
    per_tenant = [f for f in FAMILIES if "tenant" in f.labels]
    assert per_tenant and all({"namespace", "pod", "container"} <= set(f.labels) for f in per_tenant)


def test_a_running_daemons_exposition_passes_the_lint(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    tenant = f"{d.prefix}lint"
    assert d.cli("run", "--tenant", tenant, "--weight", "200", "--keep", "--", "true").returncode == 0
    text = wait_until(lambda: t if f'tenant="{tenant}"' in (t := _text(port)) else None, 10, "the tenant in /metrics")
    assert lint(text) == []
    exposed = {fam.name + ("_total" if fam.type == "counter" else "") for fam in text_string_to_metric_families(text)}
    assert exposed == set(sample_names())  # every family of the list, and nothing else
    assert "unisched_tenant_frozen" not in text and "unisched_gpu_utilization{" not in text
    promtool = shutil.which("promtool")
    if promtool is not None:
        out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


def test_an_adopted_pods_labels_are_kept_and_exported(tmp_path: Path) -> None:
    port = free_port()
    labels = {"namespace": "render", "pod": "farm-0", "container": "main"}
    with in_process_server(tmp_path / "state", metrics_port=port) as srv, DaemonClient(srv.socket) as c:
        srv.driver.create("/kubepods/pod1")
        c.adopt(pb.AdoptRequest(tenant="k8s-g0-abc", weight=300, cgroup="/kubepods/pod1", labels=labels))
        text = wait_until(lambda: t if "k8s-g0-abc" in (t := _text(port)) else None, 10, "the tenant in /metrics")
        samples = [(x.name, x.labels, x.value) for f in text_string_to_metric_families(text) for x in f.samples]
        assert ("unisched_tenant_weight", {"tenant": "k8s-g0-abc", **labels}, 300.0) in samples
        share = {"tenant": "k8s-g0-abc", **labels, "gpu": "0", "UUID": "", "domain": "sm"}
        assert any(n == "unisched_tenant_target_share_ratio" and ls == share for n, ls, _ in samples)
    # kept in the state file: a restarted daemon exports them again
    (saved,) = StateStore(tmp_path / "state").load()
    assert saved.labels == labels


@pytest.mark.parametrize(("labels", "why"), [
    ({"namespace": "ns", "tenant": "x"}, "label 'tenant' is not one of namespace, pod, container"),
    ({"pod": "p" * (MAX_LABEL_CHARS + 1)}, f"label pod: must be 1..{MAX_LABEL_CHARS} lowercase letters"),
    ({"pod": 'a",evil="1'}, "label pod: must be"),
    ({"container": "Main"}, "label container: must be"),
    ({"namespace": ""}, "label namespace: must be"),
    ({"UUID": "GPU-1"}, "label 'UUID' is not one of"),
])
def test_hostile_labels_are_refused(tmp_path: Path, labels: dict[str, str], why: str) -> None:
    with in_process_server(tmp_path / "state") as srv, DaemonClient(srv.socket) as c:
        srv.driver.create("/kubepods/pod1")
        with pytest.raises(DaemonError) as e:
            c.adopt(pb.AdoptRequest(tenant="k8s-g0-abc", cgroup="/kubepods/pod1", labels=labels))
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and why in str(e.value)
        assert c.tenants() == []


def test_a_state_file_with_bad_labels_drops_that_entry(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text(
        '{"version": 1, "tenants": [\n'
        ' {"name":"a","weight":100,"priority":"offline","engines":[],"gpus":null,"cgroup":"/k/p1","adopted":true,'
        '"owner_uid":0,"labels":{"pod":"ok-1"}},\n'
        ' {"name":"b","weight":100,"priority":"offline","engines":[],"gpus":null,"cgroup":"/k/p2","adopted":true,'
        '"owner_uid":0,"labels":{"pod":"NOT OK"}}\n]}\n')
    (a,) = StateStore(tmp_path).load()
    assert (a.name, a.labels) == ("a", {"pod": "ok-1"})
