"""What a bench/run.py run writes, and the README's results table built from it.

Per suite, bench/results/<date>-<gpu>-<commit>/<suite>/ holds summary.json (the command, machine, driver, commit,
date; every round's cases and metrics; median, worst and interval per metric; the verdict per target, computed by
bench/verdicts.py), report.md (the same for reading), plots/ (when matplotlib is there) and raw.tar.xz (the scripts'
own outputs, at most RAW_ARCHIVE_MAX bytes). The README's at-a-glance table is `results_table()` of each suite's run
of the newest code measured (`latest`), between the markers README_BEGIN and README_END.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import math
import os
import re
import shlex
import shutil
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _results import save_json, write_atomic
from charges import charges_md
from provenance import output_of
from suites import SUITES, Suite
from verdicts import MEASURED, Verdict, judge_all, overall, stats_of, unmeasured

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SUMMARY, REPORT, RAW, ARCHIVE = "summary.json", "report.md", "raw", "raw.tar.xz"
RAW_ARCHIVE_MAX = 1_000_000
"""Raw logs are not committed: at most one compressed archive of 1 MB per suite run, its largest files left out first."""
README_BEGIN, README_END = "<!-- results:begin -->", "<!-- results:end -->"
NOT_MEASURED = "not measured on this code yet"


def gpu_slug(name: str | None, standin: bool) -> str:
    """'NVIDIA H200' -> 'h200'; CPU stand-in runs are 'cpu'."""
    if standin or not name:
        return "cpu"
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w != "nvidia"]
    return "-".join(words) or "gpu"


def run_folder(mach: dict[str, Any], head: dict[str, Any], standin: bool, when: dt.datetime | None = None,
               serve_args: tuple[str, ...] = ()) -> Path:
    """bench/results/<date>-<gpu>-<commit>: one folder per machine and commit a day; suites go under it. A variant
    (daemons with `serve_args`) gets a folder of its own, named after them: <date>-<gpu>-<commit>-slice-ms-10."""
    day = (when or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%d")
    variant = "-".join(w for w in re.split(r"[^a-z0-9.]+", " ".join(serve_args).lower()) if w)
    return RESULTS / "-".join(filter(None, (day, gpu_slug(mach.get("gpu"), standin), head["commit"][:7], variant)))


# ------------------------------------------------------------------------------------------------ summary


RUN_META = ("command", "machine", "commit", "dirty", "code", "standin", "serve_args", "date_utc", "raw", "rescored",
            "merged", "aborted", "in_progress")
"""A summary's keys that describe the run itself (what build adds is recomputed from the rounds)."""


def build(suite: Suite, rounds: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """summary.json's content from the rounds (each: round, steps, cases, notes), verdicts recomputed from all."""
    cases = [r["cases"] for r in rounds]
    # a case the suite runs that no round has fails (a stand-in or a part of the suite runs fewer, by design)
    missing = unmeasured(() if meta.get("standin") or is_subset(meta) else suite.expected, cases) if rounds else []
    verdicts = judge_all(suite.targets, cases) + missing
    settled = len(rounds) >= suite.rounds  # fewer rounds than the suite's least decide nothing yet
    targets = [{"name": t.name, "text": t.text, "metric": t.metric, "stat": t.stat, "op": t.op, "limit": t.limit}
               for t in suite.targets]
    if missing:  # shown where it failed, in the report and the table, as a target of its own
        targets.append({"name": MEASURED, "text": missing[0].text, "metric": "", "stat": "every", "op": ">=",
                        "limit": 1})
    return {**meta, "suite": suite.name, "measures": suite.measures, "rounds_least": suite.rounds,
            "targets": targets,
            "rounds": rounds, "stats": stats_of(cases), "verdicts": [v.to_json() for v in verdicts],
            "passed": overall(verdicts) if suite.targets and settled else None}


def write(folder: Path, summary: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_json(folder / SUMMARY, summary)
    write_atomic(folder / REPORT, report_md(summary))


def load(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _num(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.4g}"
    return "n/a" if x is None else str(x)


def gpu_names(m: dict[str, Any]) -> str:
    """A summary's machine's GPUs, each with its driver ("" without one)."""
    return ", ".join(f"{g['name']} (driver {g['driver']})" for g in m.get("gpus") or [])


def report_md(s: dict[str, Any]) -> str:
    m = s["machine"]
    gpu = gpu_names(m) or "none"
    lines = [f"# {s['suite']}", "", s["measures"], "",
             f"Command: `{s['command']}`  ", f"Date (UTC): {s['date_utc']}  ",
             f"Commit: {s['commit']}{' (with uncommitted changes)' if s.get('dirty') else ''}  ",
             f"Machine: {m['host']}; {m['cpu']}, {m['cores']} cores; GPU: {gpu}; kernel {m['kernel']}  ",
             *([f"Rescored: `{s['rescored']['command']}` on {s['rescored']['date_utc']} UTC at commit "
                f"{s['rescored']['commit']}: the rounds' outputs as measured, read and judged by that commit's reader "
                "and targets  "]
               if s.get("rescored") else []),
             *(f"Rounds {', '.join(str(n) for n in m_['rounds'])} were measured by another run of the same command "
               f"({m_['date_utc']} UTC, same machine and commit) and are reported here with it: {m_['why']}  "
               for m_ in s.get("merged") or []),
             *([f"Daemon settings: `{shlex.join(s['serve_args'])}` on every daemon the runner started (a variant "
                "of the suite, not its defaults)  "] if s.get("serve_args") else []),
             f"Rounds: {len(s['rounds'])}" + _unsettled(s)
             + ("; CPU stand-ins (not a GPU measurement)" if s.get("standin") else "") + "  ",
             *_calls_md(s), ""]
    if s["targets"]:
        verdict = {True: "**all targets met**", False: "**targets missed**", None: "**not settled**"}[s["passed"]]
        lines += [f"Verdict: {verdict}", "", "| case | target | value | verdict |", "|---|---|---|---|"]
        lines += [f"| {v['case']} | {v['text']} | {_num(v['value'])} | "
                  f"{Verdict(**v).label()} |" for v in s["verdicts"]]
    else:
        lines += ["No target is set for this suite: the numbers are reported as measured."]
    lines += ["", "## Every round", ""]
    for r in s["rounds"]:
        lines += [f"Round {r['round']} ({r['date_utc']}, {sum(st['wall_s'] for st in r['steps']):.0f} s):", "",
                  "| case | " + "metrics |", "|---|---|"]
        lines += [f"| {case} | " + ", ".join(f"{k} {_num(v)}" for k, v in metrics.items()
                                           if not isinstance(v, list | dict)) + " |"
                  for case, metrics in r["cases"].items()]
        bad = [f"`{st['name']}` exit status {st['rc']}" for st in r["steps"] if st["rc"] != 0]
        lines += [""] + [f"- {n}" for n in [*bad, *r.get("notes", [])]] + ([""] if bad or r.get("notes") else [])
    lines += charges_md(s["rounds"])
    lines += ["## Over the rounds", "", "| case | metric | rounds | median | lowest | highest | 90% interval of the mean |",
              "|---|---|---|---|---|---|---|"]
    for case, metrics in s["stats"].items():
        for name, d in metrics.items():
            iv = d.get("interval90")
            lines.append(f"| {case} | {name} | {d.get('n', '?')} of {len(s['rounds'])} | {_num(d['median'])} | "
                         f"{_num(d['min'])} | {_num(d['max'])} | "
                         f"{'n/a' if iv is None else f'{_num(iv[0])} to {_num(iv[1])}'} |")
    lines += ["", "The commands of a round:", ""]
    lines += [f"- `{shlex.join(st['argv'])}`" for st in (s["rounds"][0]["steps"] if s["rounds"] else [])]
    if s.get("raw"):
        lines += ["", f"Raw outputs: {s['raw']}"]
    return "\n".join(lines) + "\n"


def _calls_md(s: dict[str, Any]) -> list[str]:
    """The report's lines on how the rounds came: the calls that measured them, where more than one did (each with its
    command, start, host and kernel), the rounds started and cut short (not in the record), and a round under way."""
    calls: dict[str, list[int]] = {}
    for r in s["rounds"]:
        c = r.get("call")
        if c:
            calls.setdefault(f"`{c['command']}` from {c['date_utc']} UTC on {c['host']} ({c['cpu']}, kernel "
                             f"{c['kernel']})", []).append(int(r["round"]))
    lines = [f"Round{'s' if len(ks) > 1 else ''} {', '.join(map(str, ks))} measured by {what}  "
             for what, ks in calls.items()] if len(calls) > 1 else []
    lines += [f"Round {a['round']} was started at {a['call']['date_utc'] if 'call' in a else a.get('date_utc')} UTC and "
              f"cut short, so it is not in the record: {a['why']}  " for a in s.get("aborted") or []]
    if s.get("in_progress"):
        lines.append(f"Round {s['in_progress']['round']} under way since {s['in_progress']['date_utc']} UTC  ")
    return lines


# ------------------------------------------------------------------------------------------------ raw and plots


def archive_raw(folder: Path) -> str:
    """Pack folder/raw into folder/raw.tar.xz (at most RAW_ARCHIVE_MAX bytes: the largest files are left out until it
    fits, and named) and remove folder/raw; returns what the archive holds, for the summary."""
    raw = folder / RAW
    if not raw.is_dir():
        return ""
    files = sorted((p for p in raw.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    left: list[str] = []
    while True:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tar:
            for p in files:
                tar.add(p, arcname=str(p.relative_to(folder)))
        if buf.tell() <= RAW_ARCHIVE_MAX or not files:
            break
        left.append(str(files.pop().relative_to(folder)))
    (folder / ARCHIVE).write_bytes(buf.getvalue())
    shutil.rmtree(raw)
    return f"{ARCHIVE} ({buf.tell()} bytes, {len(files)} files" + (f"; left out for size: {', '.join(left)})" if left else ")")


def extract_raw(folder: Path, dest: Path) -> bool:
    """folder's raw archive unpacked under dest (its files at dest/raw/...); False when folder has none."""
    if not (folder / ARCHIVE).exists():
        return False
    with tarfile.open(folder / ARCHIVE) as tar:
        tar.extractall(dest, filter="data")
    return True


def unpack_raw(folder: Path) -> None:
    """An earlier call's raw outputs back into folder/raw, so the archive of a resumed run holds every round."""
    if not (folder / RAW).exists():
        extract_raw(folder, folder)


def plot(folder: Path, s: dict[str, Any]) -> list[str]:
    """One PNG per target: each case's value in every round, and the limit. Skipped without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out: list[str] = []
    (folder / "plots").mkdir(exist_ok=True)
    for t in s["targets"]:
        series = {c: [r["cases"].get(c, {}).get(t["metric"]) for r in s["rounds"]]
                  for c in {v["case"] for v in s["verdicts"] if v["target"] == t["name"]}}
        series = {c: v for c, v in series.items() if any(isinstance(x, int | float) for x in v)}
        if not series or t["stat"] == "every":
            continue
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for case, vals in sorted(series.items()):
            ax.plot(range(1, len(vals) + 1), [math.nan if x is None else float(x) for x in vals], "o-", label=case)
        ax.axhline(t["limit"], color="red", linestyle="--", label=f"target {t['op']} {t['limit']:g}")
        ax.set(xlabel="round", ylabel=t["metric"], title=f"{s['suite']}: {t['text']}")
        ax.legend(fontsize=7)
        name = f"plots/{re.sub(r'[^a-z0-9]+', '-', t['name'].lower())}.png"
        fig.tight_layout()
        fig.savefig(folder / name, dpi=90)
        plt.close(fig)
        out.append(name)
    return out


# ------------------------------------------------------------------------------------------------ the README table


SUBSET_ARGS = ("--pairs", "--weights")
"""Arguments passed on to a suite's scripts (after `--`) that run only part of its plan."""


def _passed(s: dict[str, Any]) -> list[str]:
    """The words a summary's command passed on to the suite's scripts (after `--`)."""
    words = shlex.split(str(s.get("command", "")))
    return words[words.index("--") + 1:] if "--" in words else []


def _names(words: list[str], names: tuple[str, ...]) -> bool:
    return any(w == a or w.startswith(a + "=") for w in words for a in names)


def is_subset(s: dict[str, Any]) -> bool:
    """Whether a summary's run measured only part of its suite (SUBSET_ARGS after `--` in its command)."""
    return _names(_passed(s), SUBSET_ARGS)


def is_variant(s: dict[str, Any]) -> bool:
    """Whether a summary's run measured something other than the suite as it is (the runner's --serve-arg, or any
    argument after `--` but SUBSET_ARGS: other daemon settings, windows, workloads, repeats, or a logs folder outside
    the run's archive, which the suite's own keeps): a result of those, not of what the suite measures."""
    rest, words = [], iter(_passed(s))
    for w in words:
        if w in SUBSET_ARGS:
            next(words, None)  # (its value)
        elif not _names([w], SUBSET_ARGS):
            rest.append(w)
    return bool(s.get("serve_args")) or bool(rest)


def history_gap() -> str | None:
    """Why this checkout cannot order runs by their commits (`latest` then orders them by date): no git metadata, or
    a shallow clone's partial history; None when it can."""
    shallow = output_of("git", "rev-parse", "--is-shallow-repository")
    if not shallow:
        return "no git metadata here: the results table orders runs by their commits' history"
    if shallow == "true":
        return "a shallow clone: the results table orders runs by their commits' history (git fetch --unshallow)"
    return None


def _history() -> list[str]:
    """The checkout's commits, newest first (HEAD and its ancestors); empty without git metadata."""
    return output_of("git", "rev-list", "--topo-order", "HEAD").split()


def _recency(s: dict[str, Any], path: Path, history: Sequence[str]) -> tuple[bool, int, str, str]:
    """How recent a run is, for `latest`: runs of a commit in the checkout's history first (named by 7 hex digits or
    more), the newer commit first; then, for one commit (or commits not in the history), the newer date, then the
    folder name."""
    commit = str(s.get("commit") or "").lower()
    at = None if len(commit) < 7 else next((i for i, sha in enumerate(history) if sha.startswith(commit)), None)
    return at is not None, -(at or 0), str(s.get("date_utc", "")), str(path)


def latest(results: Path = RESULTS, history: Sequence[str] | None = None) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Per suite, the summary under `results` of the newest code measured: the run of the newest commit of
    `history` (the checkout's commits, newest first; by default `git rev-list HEAD`), the newest run of that commit,
    so that a run of older code made afterwards (a control for a comparison) does not stand for the code as it is;
    runs of commits outside the history come after, newest date first. Stand-in runs never count, nor do runs of
    part of a suite (is_subset): the table would show a few cases as if they were all of it; nor variants
    (is_variant): it shows what the defaults do; nor a run with no round yet."""
    commits = _history() if history is None else history
    found: dict[str, tuple[tuple[bool, int, str, str], Path, dict[str, Any]]] = {}  # suite -> its best's recency, run
    for path in sorted(results.glob(f"*/*/{SUMMARY}")):
        s = load(path.parent)
        if (s is None or not s.get("rounds") or s.get("standin") or is_subset(s) or is_variant(s)
                or s.get("suite") not in {x.name for x in SUITES}):
            continue  # (a run with no round yet: one stopped or killed in its first)
        recency = _recency(s, path, commits)
        if s["suite"] not in found or recency >= found[s["suite"]][0]:
            found[s["suite"]] = (recency, path.parent, s)
    return {name: (folder, s) for name, (_, folder, s) in found.items()}


def _least(s: dict[str, Any]) -> int:
    """The least rounds the summary's suite asks for (summaries from before it was recorded: the suite's now)."""
    suite = next((x for x in SUITES if x.name == s.get("suite")), None)
    return int(s.get("rounds_least") or (suite.rounds if suite else 1))


def _unsettled(s: dict[str, Any]) -> str:
    """What the report says after its round count when there are fewer than the suite's least."""
    n, least = len(s["rounds"]), _least(s)
    return f" of the {least} the suite needs: not settled until then" if n < least else ""


def _worst(vs: Sequence[dict[str, Any]], op: str, stat: str = "") -> dict[str, Any]:
    """The case that failed a target (else could not be judged, else met it) by the most, or came nearest its
    limit: the highest value where the target is an upper bound (`op` "<="), the lowest where it is a lower one;
    for a target of every round (`stat` "every", whose value is the rounds that missed it), the most rounds missed."""
    bad = [v for v in vs if v["passed"] is False] or [v for v in vs if v["passed"] is None] or list(vs)
    numeric = [v for v in bad if isinstance(v["value"], int | float) and not isinstance(v["value"], bool)]
    if not numeric:
        return bad[0]
    higher_is_worse = stat == "every" or op.startswith("<")
    return max(numeric, key=lambda v: float(v["value"]) if higher_is_worse else -float(v["value"]))


def _worst_label(v: dict[str, Any], stat: str = "") -> str:
    """A case's verdict, with its value where it met the target (a failure's detail already says it; a target of
    every round that was met in all has no value to show)."""
    label = Verdict(**v).label()
    return f"{label} ({_num(v['value'])})" if v["passed"] is True and stat != "every" else label


def results_table(results: Path = RESULTS, link_from: Path = ROOT) -> str:
    """The README's at-a-glance table: per suite and target, how many cases met it in its `latest` run, the worst
    case, and a link to its report. Suites never measured say so."""
    have = latest(results)
    lines = ["| suite | target | met | worst case | run |", "|---|---|---|---|---|"]
    for suite in SUITES:
        if suite.name not in have:
            targets = "; ".join(t.text for t in suite.targets) or "no target"
            lines.append(f"| {suite.name} | {targets} | {NOT_MEASURED} | | |")
            continue
        folder, s = have[suite.name]
        link = f"[{folder.parent.name}]({os.path.relpath(folder / REPORT, link_from)})"
        n, least = len(s["rounds"]), _least(s)
        rounds = f"{n} rounds" if n >= least else f"{n} of {least} rounds"
        if not s["targets"]:
            lines.append(f"| {suite.name} | no target | measured | | {link}, {rounds} |")
        for t in s["targets"]:
            vs = [v for v in s["verdicts"] if v["target"] == t["name"]]
            if not vs:
                lines.append(f"| {suite.name} | {t['text']} | no case | | {link}, {rounds} |")
                continue
            met = sum(1 for v in vs if v["passed"] is True)
            count = f"{met} of {len(vs)}" if n >= least else f"not settled ({met} of {len(vs)} so far)"
            w = _worst(vs, t["op"], t.get("stat", ""))
            lines.append(f"| {suite.name} | {t['text']} | {count} | {w['case']}: "
                         f"{_worst_label(w, t.get('stat', ''))} | {link}, {rounds} |")
    return "\n".join(lines) + "\n"


def results_page(results: Path = RESULTS, link_from: Path = ROOT) -> str:
    """docs/results.md's generated part: the at-a-glance table, then per suite its `latest` run (command, date, commit,
    machine, rounds) and every case's verdict against every target, linked to the run's report with every round."""
    have = latest(results)
    lines = [results_table(results, link_from).rstrip("\n")]
    for suite in SUITES:
        if suite.name not in have:
            continue
        folder, s = have[suite.name]
        gpu = gpu_names(s["machine"]) or "no GPU"
        lines += ["", f"### {suite.name}", "", s["measures"], "",
                  f"Run: [{folder.parent.name}]({os.path.relpath(folder / REPORT, link_from)}), {len(s['rounds'])} "
                  f"rounds, {s['date_utc']} UTC, commit {s['commit']}, {gpu}  ", f"Command: `{s['command']}`"
                  + (f"  \nVerdicts rescored by the targets of commit {s['rescored']['commit'][:7]}, "
                     f"{s['rescored']['date_utc']} UTC" if s.get("rescored") else ""), ""]
        if s["verdicts"]:
            lines += ["| case | target | value | verdict |", "|---|---|---|---|"]
            lines += [f"| {v['case']} | {v['text']} | {_num(v['value'])} | {Verdict(**v).label()} |"
                      for v in s["verdicts"]]
    return "\n".join(lines) + "\n"


def variant_label(s: dict[str, Any]) -> str:
    """What a run's daemons were given beyond the defaults, in words for a column head."""
    return f"`{shlex.join(s['serve_args'])}`" if s.get("serve_args") else "defaults"


def compare_table(runs: Sequence[tuple[Path, dict[str, Any]]], link_from: Path = ROOT) -> str:
    """One suite's runs side by side (variants of its settings, or the same settings on two commits): per target and
    case the value each run is judged by and its verdict, then per case and metric its median over each run's
    rounds. The runs must be of one suite."""
    if len({s["suite"] for _, s in runs}) != 1:
        raise ValueError("compare runs of one suite: " + ", ".join(sorted({s["suite"] for _, s in runs})))
    heads = [f"{variant_label(s)}, [{folder.parent.name}]({os.path.relpath(folder / REPORT, link_from)}), "
             f"{len(s['rounds'])} rounds" + ("" if len(s["rounds"]) >= _least(s) else " (not settled)")
             for folder, s in runs]
    bar = "|---" * (len(runs) + 2) + "|"
    lines = ["| target | case | " + " | ".join(heads) + " |", bar]
    keys = dict.fromkeys((v["target"], v["case"], v["text"]) for _, s in runs for v in s["verdicts"])
    for name, case, text in keys:
        cells = []
        for _, s in runs:
            v = next((v for v in s["verdicts"] if v["target"] == name and v["case"] == case), None)
            cells.append("" if v is None else f"{_num(v['value'])}: "
                         + {True: "met", False: "missed", None: "not judged"}[v["passed"]])
        lines.append(f"| {text} | {case} | " + " | ".join(cells) + " |")
    lines += ["", "| case | metric, median of the rounds | " + " | ".join(variant_label(s) for _, s in runs) + " |", bar]
    stats = [s.get("stats") or {} for _, s in runs]
    for case in dict.fromkeys(c for st in stats for c in st):
        for metric in dict.fromkeys(m for st in stats for m in st.get(case) or {}):
            cells = [_num(((st.get(case) or {}).get(metric) or {}).get("median")) for st in stats]
            lines.append(f"| {case} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def readme_table(text: str) -> str | None:
    """What the README holds between its markers; None without them."""
    if README_BEGIN not in text or README_END not in text:
        return None
    return text.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip("\n") + "\n"


def with_table(text: str, table: str) -> str:
    """The README with `table` between its markers (which must be there)."""
    head, rest = text.split(README_BEGIN, 1)
    return f"{head}{README_BEGIN}\n{table}{README_END}{rest.split(README_END, 1)[1]}"
