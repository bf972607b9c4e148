"""The online scenario's tables, plots and one-screen summary (bench/scenarios.py writes them; --replot rebuilds
them from results.json): results.md, plots/online-b<batch>-latency.png and, for interleaved runs,
plots/online-b<batch>-interleaved.png.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _results import save_json, save_plot, write_atomic
from online_scoring import (
    INTERLEAVE_GUARD_S,
    INTERLEAVED_STATS,
    OFFLINE_KEPT_TARGET,
    ONLINE_P99_TARGET,
    interleaved,
    p99_resolution,
)
from pairs_report import fmt


def online_line(run: dict[str, Any]) -> str:
    if run.get("error"):
        return f"FAILED: {run['error'][:200]}"
    parts = []
    for t in run.get("tenants", []):
        r = t.get("report") or {}
        if "latency_ms" in r:
            wait = r.get("lease_wait_ms") or {}
            parts.append(f"online p50 {fmt(r['latency_ms'].get('p50'))} ms p99 {fmt(r['latency_ms'].get('p99'))} ms"
                         + (f" (lease wait p50 {fmt(wait.get('p50'))} p99 {fmt(wait.get('p99'))} ms)" if wait else ""))
        elif r:
            parts.append(f"offline {fmt(r.get('throughput'), 1)} {r.get('unit', '')}")
        else:
            parts.append(f"{t.get('name')}: {t.get('error')}")
    inter = interleaved(run)
    if inter is not None:
        r, q = inter["running"], inter["paused"]
        parts.append(f"interleaved: p99 {fmt(r.get('p99'))} ms beside the trainer ({r.get('n', 0)}), {fmt(q.get('p99'))} "
                     f"ms while it idled ({q.get('n', 0)}); trainer {fmt(inter['offline_running_tp'], 1)} running")
    return "; ".join(parts)


def markdown(results: dict[str, Any]) -> str:
    """The tables for every scenario present, with the command and date each came from."""
    meta = results.get("meta", {})
    lines = [f"# Scenarios on {meta.get('gpu', '?')}", ""]
    sc = results.get("scenarios", {})
    if "online" in sc:
        lines += online_md(sc["online"])
    return "\n".join(lines) + "\n"


def provenance(data: dict[str, Any]) -> list[str]:
    return [f"`{data.get('command', '?')}` ({data.get('date_utc', '?')} UTC)", ""]


def online_md(data: dict[str, Any]) -> list[str]:
    lines = [f"## 4. Online + offline (ResNet-50 fp16 inference at {data.get('rate', '?')} req/s next to ResNet-50 "
             "training; preemptive mode)", "", *provenance(data),
             f"Target: online p99 <= {ONLINE_P99_TARGET:g}x alone while the offline tenant keeps >= "
             f"{OFFLINE_KEPT_TARGET:.0%} of its solo throughput.", "",
             "| batch | setup | online p50 ms | online p99 ms | p50 / alone | p99 / alone | p99 / alone, 90% bounds | "
             "offline kept | target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for batch, runs in data.get("batches", {}).items():
        d = runs.get("derived") or {}
        n = d.get("rounds")
        lines.append(f"| {batch} | alone{f' (median of {n} rounds)' if n else ''} | {fmt(d.get('alone_p50_ms'))} | "
                     f"{fmt(d.get('alone_p99_ms'))} | 1.00 | 1.00 | | 1.00 ({fmt(d.get('offline_solo'), 1)} img/s) | |")
        for setup, s in (d.get("setups") or {}).items():
            met = {True: "**met**", False: "missed", None: s.get("error") or "n/a"}[s.get("target_met")]
            if n and s.get("target_met") is not None:
                met += f" ({s.get('target_met_rounds', 0)} of {n} rounds)"
            b = s.get("p99_x_bounds")
            bounds = f"{fmt(b[0])}-{fmt(b[1])}: {p99_resolution(b)}" if b else "n/a"
            cells = [fmt_ranged(s, k) for k in ("p50_x_alone", "p99_x_alone")] + [bounds, fmt_ranged(s, "offline_kept")]
            name = f"{setup} (interleaved)" if s.get("interleaved") else setup
            lines.append(f"| {batch} | {name} | {fmt(s.get('p50_ms'))} | {fmt(s.get('p99_ms'))} | "
                         f"{' | '.join(cells)} | {met} |")
    lines += interleaved_md(data)
    if any((runs.get("derived") or {}).get("rounds") for runs in data.get("batches", {}).values()):
        lines += ["", "Medians over the rounds, each ratio against its own round's solo runs; [min-max] across rounds."]
        lines += ["", "Pooled: every round's requests of a setup as one sample, against every round's requests alone.", "",
                  "| batch | setup | requests | p99 ms (90% interval) | p99 / alone | 90% bounds | p99 target |",
                  "|---|---|---|---|---|---|---|"]
        for batch, runs in data.get("batches", {}).items():
            pooled = (runs.get("derived") or {}).get("pooled") or {}
            rows = [("alone", pooled.get("alone")), *(pooled.get("setups") or {}).items()]
            for setup, q in rows:
                if not q:
                    continue
                b = q.get("p99_x_bounds")
                paired = q.get("p99_x_paired_ci")
                lines.append(f"| {batch} | {setup}{' (vs its paused periods)' if q.get('paused') else ''} | {q['n']} | "
                             f"{fmt(q['p99_ms'])} ({fmt(q['p99_lo'])}-{fmt(q['p99_hi'])}) | "
                             f"{fmt(q.get('p99_x_alone', 1.0))} | {f'{fmt(b[0])}-{fmt(b[1])}' if b else ''}"
                             f"{f'; paired {fmt(paired[0])}-{fmt(paired[1])}' if paired else ''} | "
                             f"{q.get('resolution', '')} |")
    lines += ["", f"90% bounds: from each p99's distribution-free 90% interval (order statistics of its requests), "
                  f"shared low / alone high to shared high / alone low; 'cannot tell' where they straddle "
                  f"{ONLINE_P99_TARGET:g}x."]
    return [*lines, ""]


def interleaved_setups(runs: dict[str, Any]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(round index, setup, its derivation) for each interleaved run of one batch size's rounds, as derive_batch
    scored them (each round against its own solo runs)."""
    for k, d in enumerate((runs.get("derived") or {}).get("per_round") or []):
        for setup, s in (d.get("setups") or {}).items():
            if s.get("interleaved"):
                yield k, setup, s


def interleaved_md(data: dict[str, Any]) -> list[str]:
    """Interleaved runs, round by round: the two phases, and each against the separate alone run (which shows what
    a setup costs a lone online tenant in both phases, across minutes of the VM's drift)."""
    rows = []
    for batch, runs in data.get("batches", {}).items():
        for k, setup, s in interleaved_setups(runs):
            i = s["interleaved"]
            r, q = i.get("running") or {}, i.get("paused") or {}
            cis = " | ".join(fmt_ci(i.get(f"{n}_x"), i.get(f"{n}_x_ci")) for n in INTERLEAVED_STATS)
            rows.append(f"| {batch} | {k + 1} | {setup} | {r.get('n', 0)} / {q.get('n', 0)} | {fmt(r.get('p50'))} / "
                        f"{fmt(r.get('p99'))} | {fmt(q.get('p50'))} / {fmt(q.get('p99'))} | {cis} | "
                        f"{fmt(i.get('paused_p99_x_alone_run'))} | "
                        f"{fmt(s.get('offline_kept'))} | {i.get('switches')}, {fmt(i.get('max_lag_ms'), 1)} ms |")
    if not rows:
        return []
    return ["", "Interleaved (`--interleave S`): in each shared run the trainer idled in every other period of S "
            f"seconds; requests within {INTERLEAVE_GUARD_S:g} s of a switch count for neither phase. The setup's p99 / alone "
            "above is its running periods' p99 against its paused periods' (same run, seconds apart), the offline kept "
            "its rate over its running periods against its solo run. A cost the setup puts on the online tenant in both "
            "phases shows in the paused periods against the alone run (with the minutes of drift between them).", "",
            "Running / paused ratios carry a 90% interval from resampling whole pairs of periods (a running second and "
            "the idle one after it), the independent units here.", "",
            "| batch | round | setup | requests running / paused | running p50 / p99 ms | paused p50 / p99 ms | "
            "p50 running / paused | mean running / paused | p99 running / paused | paused p99 / alone run | "
            "offline kept (running) | switches, max lag |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def fmt_ci(x: float | None, ci: list[float] | None) -> str:
    return fmt(x) + (f" [{fmt(ci[0])}-{fmt(ci[1])}]" if ci else "")


def fmt_ranged(s: dict[str, Any], key: str) -> str:
    rng = s.get(f"{key}_range")
    return fmt(s.get(key)) + (f" [{fmt(rng[0])}-{fmt(rng[1])}]" if rng else "")


def plots(results: dict[str, Any], folder: Path) -> list[Path]:
    """PNG plots for what results.json holds; empty when matplotlib is missing (the tables still stand)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    sc = results.get("scenarios", {})
    if "online" in sc:
        made += online_plot(plt, sc["online"], folder)
        made += online_interleaved_plot(plt, sc["online"], folder)
    return made


def online_plot(plt: Any, data: dict[str, Any], folder: Path) -> list[Path]:
    made = []
    for batch, runs in data.get("batches", {}).items():
        d = runs.get("derived") or {}
        setups = [("alone", d.get("alone_p50_ms"), d.get("alone_p99_ms"), 1.0)]
        setups += [(k, v.get("p50_ms"), v.get("p99_ms"), v.get("offline_kept")) for k, v in (d.get("setups") or {}).items()]
        setups = [s for s in setups if s[2] is not None]
        if not setups:
            continue
        fig, ax = plt.subplots(figsize=(8, 3.5))
        xs = range(len(setups))
        ax.bar([x - 0.2 for x in xs], [s[1] or 0 for s in setups], width=0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [s[2] or 0 for s in setups], width=0.4, label="p99")
        if d.get("alone_p99_ms"):
            ax.axhline(ONLINE_P99_TARGET * d["alone_p99_ms"], color="k", ls="--", lw=0.8, label="target p99")
        ax.set_xticks(list(xs), [setup_tick(s[0], s[3]) for s in setups], fontsize=8)
        ax.set_ylabel("online latency (ms)")
        ax.set_title(f"online inference batch {batch} + training")
        ax.legend(fontsize=8)
        made.append(save_plot(plt, fig, folder / f"online-b{batch}-latency.png"))
    return made


def setup_tick(setup: str, kept: float | None) -> str:
    """A setup's tick label, wrapped (the long names ran into each other) above the trainer's kept."""
    return f"{textwrap.fill(setup, 24)}\noffline {fmt(kept)}"


def online_interleaved_plot(plt: Any, data: dict[str, Any], folder: Path) -> list[Path]:
    """Interleaved runs (first round): p50, mean and p99 beside the trainer over its idle seconds, per setup, with
    their 90% intervals, against the 1.05x line. Why a plot of its own: their reference is the run's own idle
    seconds, not the alone run the latency plot's target line is drawn from."""
    made = []
    for batch, runs in data.get("batches", {}).items():
        rows = [(setup, s["interleaved"], s.get("offline_kept")) for k, setup, s in interleaved_setups(runs) if k == 0]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(8, 3.5))
        width = 0.8 / len(INTERLEAVED_STATS)
        for j, name in enumerate(INTERLEAVED_STATS):
            xs = [i + (j - (len(INTERLEAVED_STATS) - 1) / 2) * width for i in range(len(rows))]
            ys = [r.get(f"{name}_x") or 0.0 for _, r, _ in rows]
            cis = [r.get(f"{name}_x_ci") or [y, y] for (_, r, _), y in zip(rows, ys, strict=True)]
            err = [[max(0.0, y - c[0]) for y, c in zip(ys, cis, strict=True)],
                   [max(0.0, c[1] - y) for y, c in zip(ys, cis, strict=True)]]
            ax.bar(xs, ys, width=width, yerr=err, capsize=3, label=name)
        ax.axhline(ONLINE_P99_TARGET, color="k", ls="--", lw=0.8, label=f"{ONLINE_P99_TARGET:g}x")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xticks(list(range(len(rows))), [setup_tick(k, kept) for k, _, kept in rows], fontsize=8)
        ax.set_ylim(0.5, 1.6)
        ax.set_ylabel("beside the trainer / its idle seconds")
        ax.set_title(f"online batch {batch}, interleaved (90% intervals)")
        ax.legend(fontsize=8)
        made.append(save_plot(plt, fig, folder / f"online-b{batch}-interleaved.png"))
    return made


def summary(results: dict[str, Any]) -> str:
    """One screen: the headline number of each scenario present."""
    sc = results.get("scenarios", {})
    out = [f"scenarios on {results.get('meta', {}).get('gpu', '?')}:"]
    for batch, runs in (sc.get("online") or {}).get("batches", {}).items():
        derived = runs.get("derived") or {}
        pooled = (derived.get("pooled") or {}).get("setups") or {}
        for setup, s in (derived.get("setups") or {}).items():
            q = pooled.get(setup) if derived.get("rounds") else None
            more = f"; pooled p99 x{fmt(q.get('p99_x_alone'))} of {q['n']} requests: {q['resolution']}" if q else ""
            out.append(f"  online b{batch} {setup:16} p99 x{fmt(s.get('p99_x_alone'))}, offline kept "
                       f"{fmt(s.get('offline_kept'))}{more}")
    return "\n".join(out)


def write_outputs(results: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    save_json(out / "results.json", results)
    write_atomic(out / "results.md", markdown(results))
    return plots(results, out / "plots")
