"""The derived scheduling constants live in one frozen value (policy.tuning) with one set of defaults: nothing
else defines them, and the daemon's saturation gate is built from them and its knobs."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from unisched.policy.plan import PlanConfig
from unisched.policy.saturation import SaturationConfig
from unisched.policy.tuning import TUNING, Tuning
from unisched.scheduler.config import KNOBS, DaemonConfig
from unisched.scheduler.configdoc import tuning_fields

PACKAGE = Path(__file__).resolve().parents[2] / "unisched"
FIELDS = [f.name for f in dataclasses.fields(Tuning)]


def test_the_gate_has_no_defaults_of_its_own() -> None:
    """Its numbers come from the knob table and the tuning value only: a default here would be a second set."""
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(SaturationConfig))


def test_the_daemons_gate_from_its_default_knobs_is_unchanged() -> None:
    """saturated_util 0.98 and 50 ms slices: a mean over 8 slices (0.4 s) to slice, 8 unused to open, held 40
    slices (2 s) doubling to 600 (30 s); while rationing, the cap lowered at most every 4 slices (0.2 s) and raised
    after 100 (5 s)."""
    config = DaemonConfig()
    gate = TUNING.gate(config.saturated_util, config.slice_ms)
    assert gate == SaturationConfig(high=0.98, low=0.98 - 0.3, enter_slices=8, leave_slices=8, hold_slices=40,
                                    max_hold_slices=600, reset_slices=40, cap_settle_slices=4, cap_release_slices=100)
    assert TUNING.gate(0.98, 1000.0).enter_slices == 2  # never a window of one sample
    assert TUNING.gate(0.2, 50.0).low == 0.0


def test_no_tuning_number_is_defined_twice() -> None:
    """No module of the daemon gives a number to a name of a tuning field (a module constant beside the tuning's
    field would let the two drift apart), no knob carries one, and the plan's default is the tuning value's."""
    twice = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "tuning.py" and path.parent.name == "policy":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Assign | ast.AnnAssign) or not isinstance(node.value, ast.Constant | ast.Tuple):
                continue  # a name given TUNING's value is a use, not a second definition
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            twice += [f"{path.relative_to(PACKAGE)}: {t.id}" for t in targets
                      if isinstance(t, ast.Name) and t.id.lower() in FIELDS]
    assert twice == []
    assert not {k.name for k in KNOBS} & set(FIELDS)
    assert PlanConfig.__dataclass_fields__["turn_cpu_cores"].default == TUNING.turn_cpu_cores


def test_every_tuning_field_gives_its_reason() -> None:
    listed = tuning_fields()
    assert [c.name for c in listed] == [f"Tuning.{f}" for f in FIELDS]
    assert all(len(c.reason) > 40 for c in listed), [c.name for c in listed if len(c.reason) <= 40]
