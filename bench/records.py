"""A run's record beyond running its rounds: whether rounds may join it (`unlike`, `cut_short`),
judging it again (`rescore`), taking in another run's rounds (`add_rounds`), and writing it out (`publish`)."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import provenance as pv
import summary as sm
from _results import utc_now
from suites import Suite
from verdicts import Verdict


def unlike(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How run `a`'s rounds differ from what run `b` measures ("" where rounds of both may stand in one record: the
    same commit and code, daemon settings, GPUs and drivers, the same command but for how long it may take and where
    it is written, and no tree with uncommitted changes on either side). `a` and `b` are summaries, or what a call
    is about to record."""
    if a.get("commit") != b.get("commit"):
        return f"of commit {a.get('commit')}, not {b.get('commit')}"
    if tuple(a.get("serve_args") or ()) != tuple(b.get("serve_args") or ()):
        return (f"whose daemons had {shlex.join(a.get('serve_args') or []) or 'no'} --serve-arg, not "
                f"{shlex.join(b.get('serve_args') or []) or 'none'}")
    if a.get("dirty") or b.get("dirty"):
        return "of a tree with uncommitted changes, or would take such rounds: no commit names their code"
    if a.get("code") and b.get("code") and a["code"] != b["code"]:
        return "of other code (its Python files differ, though both name the same commit)"
    if sm.gpu_names(a.get("machine") or {}) != sm.gpu_names(b.get("machine") or {}):
        return (f"measured on {sm.gpu_names(a.get('machine') or {}) or 'no GPU'}, not on "
                f"{sm.gpu_names(b.get('machine') or {}) or 'no GPU'}")
    if bool(a.get("standin")) != bool(b.get("standin")):
        return "measured " + ("with" if a.get("standin") else "without") + " --cpu-standin"
    if _options(a["command"]) != _options(b["command"]):
        return f"measured by `{a['command']}`, another command than `{b['command']}`"
    return ""


def cut_short(before: dict[str, Any]) -> dict[str, Any]:
    """A round the previous call started and never finished (it was killed): recorded as aborted."""
    started = before.get("in_progress")
    if not started:
        return {}
    return {"aborted": [*(before.get("aborted") or []),
                        {**started, "why": "the call that ran it ended before it finished (killed or cut off)"}]}


def rescore(suite: Suite, folder: Path, argv: list[str]) -> int:
    """The rounds in folder judged by the suite's current targets: a target's reading can change after a run, and the
    record says so rather than passing the new verdicts off as the run's. Each round's cases are read again from its
    raw outputs by the suite's current reader where the archive holds them (a reader may derive more from the same
    outputs), else kept as they were."""
    before = sm.load(folder)
    if before is None or not before.get("rounds"):
        print(f"run.py: {folder} holds no rounds to rescore", file=sys.stderr)
        return 2
    meta = {k: v for k, v in before.items() if k in sm.RUN_META}
    meta["rescored"] = {"command": shlex.join(["python3", "bench/run.py", *argv]), "commit": pv.commit()["commit"],
                        "date_utc": utc_now()}
    rounds = reread(suite, folder, before["rounds"])
    return publish(suite, folder, sm.build(suite, rounds, meta), f"rescored {len(rounds)} rounds: ")


def add_rounds(suite: Suite, folder: Path, other: Path, why: str) -> int:
    """other's rounds appended to folder's, renumbered after them, with their raw outputs; only for a run of the same
    command, machine and commit, so that every round measured is kept in one record."""
    a, b = sm.load(folder), sm.load(other)
    if a is None or b is None or not b.get("rounds"):
        print(f"run.py: --add-rounds needs rounds in both {folder} and {other}", file=sys.stderr)
        return 2
    if folder.resolve() == other.resolve() or {r["date_utc"] for r in a["rounds"]} & {r["date_utc"] for r in b["rounds"]}:
        print(f"run.py: {other}'s rounds are {folder}'s already (the same folder, or rounds of the same start): "
              "a round is counted once", file=sys.stderr)
        return 2
    under_way = [str(f) for f, s in ((folder, a), (other, b)) if s.get("in_progress")]
    if under_way:
        print(f"run.py: --add-rounds refused: {' and '.join(under_way)} has a round under way, or cut off unrecorded "
              "(run it again to record it)", file=sys.stderr)
        return 2
    if differs := unlike(a, b):
        print(f"run.py: {other} is not a run of the same command, machine and commit as {folder}: {folder} holds "
              f"rounds {differs}", file=sys.stderr)
        return 2
    sm.unpack_raw(folder)
    n, added = len(a["rounds"]), []
    with tempfile.TemporaryDirectory() as tmp:
        sm.extract_raw(other, Path(tmp))
        for r in b["rounds"]:
            k = n + int(r["round"])
            src = Path(tmp) / sm.RAW / f"round-{r['round']}"
            if src.is_dir():
                shutil.move(str(src), str(folder / sm.RAW / f"round-{k}"))
            renamed = json.loads(json.dumps(r).replace(f"/round-{r['round']}/", f"/round-{k}/"))
            added.append({**renamed, "round": k})
    meta = {k: a[k] for k in sm.RUN_META if k in a}
    meta["merged"] = [*(a.get("merged") or []),
                      {"rounds": [r["round"] for r in added], "date_utc": b["date_utc"], "why": why}]
    cut = [*(a.get("aborted") or []), *({**x, "round": n + int(x["round"])} for x in b.get("aborted") or [])]
    if cut:  # the other run's rounds cut short come with its rounds, numbered as they are
        meta["aborted"] = cut
    result = sm.build(suite, [*a["rounds"], *added], meta)
    result["raw"] = sm.archive_raw(folder)
    return publish(suite, folder, result, f"added {len(added)} rounds: ")


_HOW_LONG = ("--budget", "--rounds", "--out")
"""A run's options that say how long it may take and where it is written, not what it measures."""


def _options(command: str) -> list[str]:
    """A run's command without the options that only say how long it may take and where it is written."""
    words, out, skip = shlex.split(command), [], False
    for w in words:
        if skip or w.startswith(tuple(f"{o}=" for o in _HOW_LONG)):
            skip = False
            continue
        skip = w in _HOW_LONG
        if not skip:
            out.append(w)
    return out


def reread(suite: Suite, folder: Path, rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rounds with their cases and notes read again from the raw archive (left as it is), where it has them."""
    with tempfile.TemporaryDirectory() as tmp:
        if not sm.extract_raw(folder, Path(tmp)):
            return rounds
        out = []
        for r in rounds:
            raw = Path(tmp) / sm.RAW / f"round-{r['round']}"
            cases, notes = suite.read(raw) if raw.is_dir() else ({}, [])
            out.append({**r, "cases": cases, "notes": notes} if cases else r)
        return out


def publish(suite: Suite, folder: Path, result: dict[str, Any], what: str) -> int:
    """A summary's plots and files written (`what` heads the line naming its report), its verdicts printed; the exit
    status says whether a target was missed."""
    result["plots"] = sm.plot(folder, result)
    sm.write(folder, result)
    print(f"run {suite.name}: {what}{folder / sm.REPORT}", file=sys.stderr)
    for v in result["verdicts"]:
        print(f"{v['case']}: {v['target']}: {Verdict(**v).label()}")
    return 0 if result["passed"] is not False else 1
