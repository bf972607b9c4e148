"""Verdicts that must not PASS with data missing: a target judged on every round it applies in (not the case's first
round only), expected cases that no round measured, pytest's summary line in the memory suite's log, and the
readers' notes where a script's internal repeats are not all read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchrig import bench_module, readers, suites, verdicts

PAIRS = suites.BY_NAME["pairs"].targets
CLOUD = suites.BY_NAME["cloud-gaming"].targets

# ------------------------------------------------------------------------------------------------ judge_all, per round


def contending(error: float, contends: bool = True) -> dict[str, Any]:
    """A pair's metrics in one round under the daemon (sum 0.99, guarantee kept, 0.01 over no scheduler's sum)."""
    return {"contending": contends, "error_pts": error, "sum": 0.99, "guarantee": True, "sum_vs_no_scheduler": 0.01}


DAEMON_FAILED = {"contending": True, "alone_a": 100.0, "alone_b": 90.0, "no_scheduler_sum": 1.0}
"""A pair's round whose run under the daemon failed: the reader has no error, sum or guarantee for it."""


def saturated(weight_error: float, is_saturated: bool = True) -> dict[str, Any]:
    return {"saturated": is_saturated, "host_bound": False, "weight_error": weight_error, "lows_vs_no_scheduler": 0.0}


def judged(targets: tuple[verdicts.Target, ...], rounds: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    return {(v.case, v.target): v.label() for v in verdicts.judge_all(targets, rounds)}


@pytest.mark.parametrize(("targets", "rounds", "want"), [
    pytest.param(PAIRS, [{"cuda+cuda 1:1": contending(0.5)}] * 3, {
        ("cuda+cuda 1:1", "error, median round"): "PASS", ("cuda+cuda 1:1", "error, worst round"): "PASS",
        ("cuda+cuda 1:1", "sum"): "PASS", ("cuda+cuda 1:1", "guarantee"): "PASS"}, id="every round contends"),
    pytest.param(PAIRS, [{"cuda+cuda 1:1": DAEMON_FAILED}, *[{"cuda+cuda 1:1": contending(9.0)}] * 2], {
        ("cuda+cuda 1:1", "error, median round"): "FAIL: 9 pts > 1 pts, by 8 pts",
        ("cuda+cuda 1:1", "error, worst round"): "FAIL: 9 pts > 2 pts, by 7 pts",
        ("cuda+cuda 1:1", "sum"): "FAIL: 1 of 3 rounds did not measure it",
        ("cuda+cuda 1:1", "guarantee"): "FAIL: missed in 1 of 3 rounds"}, id="(a) the daemon run failed in round 1"),
    pytest.param(PAIRS, [{"nvdec+nvdec 1:1": contending(0.5, contends=False)},
                         *[{"nvdec+nvdec 1:1": contending(9.0)}] * 2], {
        ("nvdec+nvdec 1:1", "error, median round"): "FAIL: 9 pts > 1 pts, by 8 pts; judged on 2 of 3 rounds "
                                                    "(the target did not apply in the others)",
        ("nvdec+nvdec 1:1", "error, worst round"): "FAIL: 9 pts > 2 pts, by 7 pts; judged on 2 of 3 rounds "
                                                   "(the target did not apply in the others)",
        ("nvdec+nvdec 1:1", "sum"): "PASS: judged on 2 of 3 rounds (the target did not apply in the others)",
        ("nvdec+nvdec 1:1", "guarantee"): "PASS",
        ("nvdec+nvdec 1:1", "sum vs no scheduler"): "PASS: judged on 1 of 3 rounds "
                                                    "(the target did not apply in the others)"},
        id="(b) contends from round 2 on"),
    pytest.param(CLOUD, [{"N=24": saturated(0.5, is_saturated=False)}, *[{"N=24": saturated(0.2)}] * 2], {
        ("N=24", "FPS by weight"): "FAIL: 20% > 5%, by 15%; judged on 2 of 3 rounds "
                                   "(the target did not apply in the others)",
        ("N=24", "1% lows"): "PASS: judged on 2 of 3 rounds (the target did not apply in the others)"},
        id="(c) saturated from round 2 on"),
    pytest.param(CLOUD, [{"N=12": saturated(0.5, is_saturated=False)}] * 3, {}, id="never saturated: no verdict"),
    pytest.param(CLOUD, [{"N=24": saturated(0.01)}, {}, {"N=24": saturated(0.5, is_saturated=False)}], {
        ("N=24", "FPS by weight"): "FAIL: 1 of 2 rounds did not measure it; judged on 2 of 3 rounds "
                                   "(the target did not apply in the others)",
        ("N=24", "1% lows"): "FAIL: 1 of 2 rounds did not measure it; judged on 2 of 3 rounds "
                             "(the target did not apply in the others)"},
        id="a round without the case is missing, not left out"),
])
def test_a_target_is_judged_on_every_round_it_applies_in(targets: tuple[verdicts.Target, ...],
                                                         rounds: list[dict[str, Any]],
                                                         want: dict[tuple[str, str], str]) -> None:
    """Whether a target applies is each round's to say: a case whose first round lacks the metric or does not
    apply is still judged on the rounds that do, and a round without the case or its metric fails it."""
    assert judged(targets, rounds) == want


# ------------------------------------------------------------------------------------------------ expected cases


def test_an_expected_case_that_no_round_measured_fails() -> None:
    """A case absent from every round has no verdict of judge_all's: unmeasured gives it a failing one; a case that
    some round measured (here only the second) gets none from it."""
    rounds = [{"cuda+cuda 1:1": contending(0.5)}, {"cuda+cuda 1:1": contending(0.5), "cuda+cuda 3:1": contending(0.5)}]
    got = verdicts.unmeasured(("cuda+cuda 1:1", "cuda+cuda 3:1", "cuda+cuda 1:3"), rounds)
    assert [v.to_json() for v in got] == [{"case": "cuda+cuda 1:3", "target": "measured", "value": None,
                                           "text": "every case of the suite measured", "passed": False,
                                           "detail": "not measured in any round"}]
    assert verdicts.overall([*verdicts.judge_all(PAIRS, rounds), *got]) is False
    assert verdicts.unmeasured((), rounds) == [] and verdicts.unmeasured(("c",), []) != []


def _step_arg(suite: str, flag: str) -> str:
    argv = suites.BY_NAME[suite].steps[0].argv
    return argv[argv.index(flag) + 1]


def test_the_expected_cases_are_the_ones_the_suites_commands_produce() -> None:
    """The names as the readers key them, from each suite's own command: a rename on either side shows here."""
    pairs_plan = bench_module("pairs_plan")
    for name in ("pairs", "overlap"):
        want = tuple(p.key for p in pairs_plan.parse_pairs(_step_arg(name, "--pairs")))
        assert suites.BY_NAME[name].expected == want
    batches, setups = _step_arg("online", "--online-batches").split(","), _step_arg("online", "--online-setups")
    assert suites.BY_NAME["online"].expected == tuple(f"b{b} unisched {s}" for b in batches for s in setups.split(","))
    sizes = [s.name.removeprefix("unisched-") for s in suites.BY_NAME["cloud-gaming"].steps if s.serve is not None]
    assert suites.BY_NAME["cloud-gaming"].expected == tuple(f"N={n}" for n in sizes)
    assert len(suites.BY_NAME["mixed"].expected) == 13  # 5 pairs at 3 weights, less client8+client8 and frame+frame 1:3
    assert "client8+client8 1:3" not in suites.BY_NAME["mixed"].expected
    assert suites.BY_NAME["overhead"].expected == ("cuda alone", "render alone")


# ------------------------------------------------------------------------------------------------ the memory suite's log

VERBOSE = "tests/test_gpu_memory.py::test_oom PASSED\nsome test's output: 3 passed to the hook\n"


@pytest.mark.parametrize(("log", "counts", "passes"), [
    pytest.param(VERBOSE + "===== 4 passed in 64.88s (0:01:04) =====\n", (4, 0, 0), True, id="pytest's closing line"),
    pytest.param(VERBOSE + "===== 4 passed in 64.88s (0:01:04) =====\nexit 0\n", (4, 0, 0), True,
                 id="a line after pytest's summary"),
    pytest.param(VERBOSE + "==== 1 passed, 40 skipped in 2.10s ====\n", (1, 0, 40), False, id="skipped tests"),
    pytest.param(VERBOSE + "= 1 failed, 3 passed, 1 error in 9.0s =\ndone\n", (3, 1, 0), False, id="a failure"),
    pytest.param(VERBOSE + "==== 4 passed, 1 error in 3.00s ====\n", (4, 0, 0), False, id="an error"),
    pytest.param("....\n4 passed in 1.20s\nwrapper: finished\n", (4, 0, 0), True, id="-q's bare summary"),
    pytest.param(VERBOSE, (0, 0, 0), False, id="no summary: pytest did not finish"),
])
def test_the_memory_suite_reads_pytests_summary_line_and_skips_do_not_pass(
        tmp_path: Path, log: str, counts: tuple[int, int, int], passes: bool) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "test_gpu_memory.log").write_text(log)
    cases, _ = readers.read_memory(tmp_path)
    m = cases["tests/test_gpu_memory.py"]
    assert m["tests_pass"] is passes
    assert (m["passed"], m["failed"], m.get("skipped")) == counts


# ------------------------------------------------------------------------------------------------ internal repeats


def _results(folder: Path, data: dict[str, Any]) -> Path:
    (folder / "step").mkdir()
    (folder / "step" / "results.json").write_text(json.dumps(data))
    return folder


def _mixed_run(error: float) -> dict[str, Any]:
    return {"normalized": [0.5, 0.5], "error_pts": error, "sum": 1.0, "guarantee": True}


@pytest.mark.parametrize(("repeats", "notes"), [
    (1, []),
    (3, ["mixed_engines.py (--rounds) ran 2 of 2 pairs more than once in its own rounds (up to 3 runs each): only "
         "the last run of each is read"]),
])
def test_mixed_says_when_only_the_last_of_its_own_rounds_is_read(tmp_path: Path, repeats: int,
                                                                  notes: list[str]) -> None:
    runs = [_mixed_run(float(k)) for k in range(1, repeats + 1)]
    data = {"solo": [{"frame": 60.0}], "runs": {"frame+render 1:1": runs, "frame+frame 1:1": runs}}
    cases, got = readers.read_mixed_engines(_results(tmp_path, data))
    assert cases["frame+render 1:1"]["error_pts"] == float(repeats)  # what is read is unchanged: the last
    assert got == notes


def _online_round(p99_x: float) -> dict[str, Any]:
    return {"alone_p99_ms": 9.0, "setups": {"unisched kernel": {"p99_ms": 9.0 * p99_x, "p99_x_alone": p99_x,
                                                                "p99_x_bounds": [1.0, 1.2], "offline_kept": 0.9}}}


@pytest.mark.parametrize(("repeats", "notes"), [
    (1, []),
    (2, ["scenarios.py (--repeat) ran 1 of 1 batches more than once in its own rounds (up to 2 runs each): only the "
         "first run of each is read"]),
])
def test_online_says_when_only_the_first_of_its_own_rounds_is_read(tmp_path: Path, repeats: int,
                                                                    notes: list[str]) -> None:
    per_round = [_online_round(1.0 + k / 10) for k in range(repeats)]
    data = {"scenarios": {"online": {"batches": {"1": {"derived": {"per_round": per_round}}}}}}
    cases, got = readers.read_online(_results(tmp_path, data))
    assert cases["b1 unisched kernel"]["p99_x_alone"] == 1.0  # what is read is unchanged: the first
    assert got == notes
