"""deploy/grafana/unisched.json asks Prometheus only for what the daemon exports: every metric name and label in
its PromQL comes from transport.metric_names (the list the collector builds its families from, and which
test_exposition checks against a running daemon's /metrics)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from conftest import ROOT

from unisched.transport.metric_names import sample_names

DASHBOARD = ROOT / "deploy" / "grafana" / "unisched.json"
_METRIC = re.compile(r"\bunisched_[a-z0-9_]+\b")
_SELECTOR = re.compile(r"\{([^{}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-z0-9_]+)\s*,\s*([A-Za-z0-9_]+)\s*\)")
_LEGEND = re.compile(r"\{\{\s*([A-Za-z0-9_]+)\s*\}\}")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def _queries(dash: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(panel title, expr, legend) of every target, and (variable, query, "") of every query variable."""
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"], target.get("legendFormat", "")
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            yield f"${var['name']}", var["query"]["query"], ""


def problems(title: str, expr: str, legend: str) -> list[str]:
    """What in one query names a metric or label the daemon does not export."""
    exported = sample_names()
    names = _METRIC.findall(expr)
    out = [f"{title}: no unisched metric in {expr!r}"] if not names else []
    out += [f"{title}: {n} is not exported" for n in names if n not in exported]
    allowed = {label for n in names if n in exported for label in exported[n].labels}
    used = {m for sel in _SELECTOR.findall(expr) for m in _MATCHER.findall(sel)}
    grouped = {g.strip() for clause in _GROUPING.findall(expr) for g in clause.split(",") if g.strip()}
    used |= grouped | {label for _, label in _LABEL_VALUES.findall(expr)}
    out += [f"{title}: label {label} is not one of {sorted(allowed)}" for label in sorted(used - allowed)]
    shown = set(_LEGEND.findall(legend))
    out += [f"{title}: legend {{{{{label}}}}} is not in the result" for label in sorted(shown - (grouped or allowed))]
    return out


def test_every_query_names_only_exported_metrics_and_labels() -> None:
    dash = _dashboard()
    queries = list(_queries(dash))
    assert len(queries) >= 10
    assert [p for q in queries for p in problems(*q)] == []


def test_the_check_catches_names_and_labels_we_do_not_export() -> None:
    assert problems("t", 'unisched_tenant_frozen{tenant="a"}', "")[0] == "t: unisched_tenant_frozen is not exported"
    assert problems("t", 'unisched_gpu_utilization_ratio{uuid="x"}', "") == \
        ["t: label uuid is not one of ['UUID', 'engine', 'gpu']"]
    assert problems("t", "sum by (tenant) (unisched_tenant_weight)", "{{pod}}") == \
        ["t: legend {{pod}} is not in the result"]
    assert problems("t", "up", "") == ["t: no unisched metric in 'up'"]


def test_the_dashboard_shows_what_operators_asked_for() -> None:
    """Share against target per GPU engine domain, freezes, refusals, memory used and cap."""
    by_panel: dict[str, str] = {}
    for title, expr, _ in _queries(_dashboard()):
        by_panel[title] = by_panel.get(title, "") + expr + "\n"
    panels = by_panel.values()
    assert any("measured_share_ratio" in e and "target_share_ratio" in e and "domain" in e and "gpu" in e
               for e in panels)
    assert any('unisched_tenant_state{' in e and 'state="frozen"' in e for e in panels)
    assert any("unisched_tenant_session_refusals_total" in e for e in panels)
    assert any("unisched_tenant_memory_used_bytes" in e and "unisched_tenant_memory_cap_bytes" in e for e in panels)


def test_the_dashboard_is_importable_grafana_json() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    defined = {v["name"] for v in dash["templating"]["list"]}
    for panel in dash["panels"]:
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        text = json.dumps(panel)
        used = set(re.findall(r"\$\{?([a-z]+)\}?", text)) - {"__rate_interval"}
        assert used <= defined, f"{panel['title']}: {sorted(used - defined)} not defined"
