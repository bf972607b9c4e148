"""bench/tenant_scale.py runs over fakes (no GPU, no root) and writes every case for every tenant count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_it_times_every_case_at_every_tenant_count(tmp_path: Path) -> None:
    out = tmp_path / "scale"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "tenant_scale.py"), "--tenants", "3,12", "--calls", "3",
                          "--repeat", "1", "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    res = json.loads((out / "results.json").read_text())
    assert set(res["us_a_call"]) == {"3", "12"}
    for n in ("3", "12"):
        assert set(res["us_a_call"][n]) == {"session decision", "memory charge", "caller's tenant"}
        assert all(v > 0 for v in res["us_a_call"][n].values())
    assert "| 12 |" in (out / "results.md").read_text()


def test_bad_counts_are_refused_with_a_reason(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "tenant_scale.py"), "--tenants", "2,x", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and "whole numbers" in run.stderr
