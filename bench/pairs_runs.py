"""bench/gpu_pairs.py's runs: the tenants of one run launched together on one shared window, what each reported, and
the `unisched serve` a run under the daemon gets (its own socket, state and status).

scenarios.py runs its own setups with the same machinery.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scoring
from _daemon import ROOT, own_subtree, remove_subtree, thaw_subtree
from charges import compact, keep_log
from interleave import Alternation, Alternator

from unisched.calibrate.runs import kill_group
from unisched.scheduler.contention_file import CONTENTION_FILE

SNAPSHOT_LEAD_S = 0.5
"""How long before a window's start and end its charges are asked for (`run_group`'s `charges`): `unisched tenants
--json` takes a few tenths of a second to start and answer, so the answers fall about on the window's edges; and a
tenant whose workload has ended is removed within a second, taking its charges with it."""
CHARGES_MIN_WINDOW_S = 2.0
"""Windows shorter than this take no charge snapshots: each is a CLI process started beside the pair (a few tenths
of a second of a core), which in a short window on a small machine delays the pair's own start-up (a stand-in
tenant of a 0.5 s window started 0.4 s late behind one on the 2-core test machine)."""
ENGINES = {"cuda": "compute", "render": "graphics", "nvdec": "decode"}
"""The engines a tenant of each kind declares (`unisched run --engines`)."""
LOG_TAIL_CHARS = 3000

# ------------------------------------------------------------------------------------ the configuration


@dataclass(frozen=True)
class Config:
    python: str
    seconds: float
    warmup: float
    unisched_warmup: float  # replaces `warmup` for the runs under unisched
    slice_ms: float
    grace_s: float
    work_dir: Path
    workload_cmd: dict[str, list[str]]  # per kind; the window arguments are appended
    custom_cmd: dict[str, bool]
    unisched_module: str
    env: dict[str, str]
    kind_args: dict[str, list[str]] = field(default_factory=dict)  # e.g. render --iterations N
    engine: str = "kernel"  # kernel: tenants under `unisched run`; user: cooperative clients (--tenant)
    serve_args: tuple[str, ...] = ()  # given to every `unisched serve` (--serve-arg), e.g. --log-level debug


# ------------------------------------------------------------------------------------ processes


class Progress:
    """'[k/N +elapsed] what' lines on stderr, so a long device call shows where it is."""

    def __init__(self, total: int, name: str = "gpu_pairs") -> None:
        self.total, self.done, self.t0, self.name = total, 0, time.monotonic(), name

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def step(self, what: str) -> None:
        self.done += 1
        self.note(f"[{self.done}/{self.total}] {what}")

    def note(self, text: str) -> None:
        print(f"{self.name} +{self.elapsed():5.0f}s {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class TenantSpec:
    name: str
    kind: str
    weight: float | None  # None: no scheduler
    priority: str | None = None  # online | offline (preemptive mode); None: the daemon's default
    env: tuple[tuple[str, str], ...] = ()  # extra environment (e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)


@dataclass
class TenantResult:
    name: str
    kind: str
    weight: float | None
    argv: list[str]
    rc: int | None
    report: dict[str, Any] | None
    log_tail: str
    error: str | None

    @property
    def throughput(self) -> float | None:
        return float(self.report["throughput"]) if self.report else None

    def short_window(self) -> str | None:
        """Why its report measured too little of its window to give its run rates (scoring.short_window)."""
        return scoring.short_window(self.report)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "weight": self.weight, "argv": self.argv,
                "rc": self.rc, "report": self.report, "error": self.error, "log_tail": self.log_tail}


@dataclass
class GroupResult:
    """One run: one or two tenants started together over one window."""

    label: str
    setup: str  # "alone" | "no scheduler" | "unisched"
    tenants: list[TenantResult]
    start_at: float
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(t.report is not None for t in self.tenants)

    def common_window(self) -> tuple[float, float] | None:
        """Where a tenant of a shared run started late (scoring.COMMON_WINDOW_LATE_S), the seconds of the window
        in which both ran: both are scored over them, not the one that ran alone meanwhile over the whole."""
        if len(self.tenants) < 2 or not self.ok:
            return None
        return scoring.common_window([((t.report or {}).get("window") or {}).get("timeline") or [] for t in self.tenants])

    def throughputs(self) -> list[float | None]:
        if any(t.short_window() for t in self.tenants):
            return [None] * len(self.tenants)
        window = self.common_window()
        if window is None:
            return [t.throughput for t in self.tenants]
        rates = scoring.rates_over([(t.report or {})["window"]["timeline"] for t in self.tenants], window)
        return list(rates)

    def to_json(self) -> dict[str, Any]:
        window = self.common_window()
        common = {} if window is None else {"common_window": [round(window[0], 3), round(window[1], 3)]}
        return {"label": self.label, "setup": self.setup, "ok": self.ok, "start_at": self.start_at,
                "wall_s": self.wall_s, "tenants": [t.to_json() for t in self.tenants], **common, **self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupResult:
        """A run as results.json keeps it (bench/rescore_pairs.py scores old runs again)."""
        tenants = [TenantResult(t["name"], t["kind"], t.get("weight"), t.get("argv") or [], t.get("rc"), t.get("report"),
                                t.get("log_tail") or "", t.get("error")) for t in data.get("tenants", [])]
        known = {"label", "setup", "ok", "start_at", "wall_s", "tenants", "common_window"}
        return cls(data["label"], data["setup"], tenants, data.get("start_at", 0.0), data.get("wall_s", 0.0),
                   {k: v for k, v in data.items() if k not in known})


def tail(path: Path, limit: int = LOG_TAIL_CHARS) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode(errors="replace")


def wait_all(procs: list[subprocess.Popen[bytes]], deadline: float,
             actions: Sequence[tuple[float, Callable[[], None]]] = ()) -> bool:
    """Wait for every process until `deadline` (time.time()); start each of `actions` (time, action) at its time, on a
    thread of its own so that one slow to end (a snapshot the daemon is slow to answer) delays neither the next one
    nor the wait; those still due when every process has ended start then. Returns once the actions have ended too.

    Returns False when the deadline passed with some still running (the caller kills them).
    """
    pending = list(procs)
    due = sorted(actions, key=lambda a: a[0])
    started: list[threading.Thread] = []

    def start(action: Callable[[], None]) -> None:
        started.append(threading.Thread(target=action, daemon=True))
        started[-1].start()

    try:
        while pending:
            while due and time.time() >= due[0][0]:
                start(due.pop(0)[1])
            wake = min(deadline, due[0][0]) if due else deadline
            try:
                pending[0].wait(timeout=max(0.0, wake - time.time()))
                pending.pop(0)
            except subprocess.TimeoutExpired:
                if time.time() >= deadline:
                    return False
        for _, action in due:  # everything ended before them: still take the snapshots
            start(action)
        return True
    finally:
        for thread in started:
            thread.join()


def read_report(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, "no report written"
    except (OSError, ValueError) as exc:
        return None, f"unreadable report: {exc}"


def workload_argv(cfg: Config, kind: str, report: Path, start_at: float, warmup: float | None = None) -> list[str]:
    return [*cfg.workload_cmd[kind], *cfg.kind_args.get(kind, []),
            "--seconds", f"{cfg.seconds:g}", "--warmup", f"{cfg.warmup if warmup is None else warmup:g}",
            "--report", str(report), "--start-at", f"{start_at:.3f}"]


def unisched_cmd(cfg: Config, *args: str) -> list[str]:
    return [cfg.python, "-m", cfg.unisched_module, *args]


def run_group(cfg: Config, label: str, setup: str, specs: list[TenantSpec],
              daemon: Daemon | None = None, warmup: float | None = None,
              alternate: tuple[str, float, float] | None = None, charges: bool = False) -> GroupResult:
    """Launch the tenants together, wait for their shared window to end, collect their reports.

    The window starts `warmup` seconds after the launch (default: cfg.warmup). `alternate` = (tenant, period s,
    guard s): that tenant is paused (SIGUSR1 / SIGUSR2: its workload must be --pausable) in every other period of the
    window (interleave.py); the plan and how it went are in extra["alternation"]. `charges` (with a daemon): what it
    charged each tenant, asked SNAPSHOT_LEAD_S before the window's start and before its end (charges.compact; windows
    of CHARGES_MIN_WINDOW_S or more), in
    extra["charges"].
    """
    run_dir = cfg.work_dir / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{setup}-{label}")
    run_dir.mkdir(parents=True, exist_ok=True)
    warmup = cfg.warmup if warmup is None else warmup
    start_at = time.time() + warmup
    plans: list[tuple[TenantSpec, list[str], Path, Path]] = []
    for spec in specs:
        report = run_dir / f"{spec.name}.json"
        report.unlink(missing_ok=True)
        argv = workload_argv(cfg, spec.kind, report, start_at, warmup)
        priority = ["--priority", spec.priority] if spec.priority else []
        if daemon is not None and cfg.engine == "user":
            assert spec.weight is not None
            argv += ["--tenant", spec.name, "--weight", f"{spec.weight:g}", "--socket", str(daemon.socket),
                     *priority]
        elif daemon is not None:
            assert spec.weight is not None
            argv = unisched_cmd(cfg, "run", "--socket", str(daemon.socket), "--tenant", spec.name,
                                "--weight", f"{spec.weight:g}", "--engines", ENGINES.get(spec.kind, "compute"),
                                *priority, "--", *argv)
        plans.append((spec, argv, report, run_dir / f"{spec.name}.log"))
    t0 = time.time()
    procs = []
    for spec, argv, _, log in plans:  # back to back: the launches are milliseconds apart
        with log.open("wb") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                          env={**cfg.env, **dict(spec.env)}, start_new_session=True))
    extra: dict[str, Any] = {}
    alternator, paused_name = None, None
    if alternate is not None:
        paused_name, period_s, guard_s = alternate
        (paused,) = [proc for (spec, *_), proc in zip(plans, procs, strict=True) if spec.name == paused_name]
        alternator = Alternator(Alternation(start_at, cfg.seconds, period_s, guard_s), paused.pid)
        alternator.start()
    actions: list[tuple[float, Callable[[], None]]] = []
    if daemon is not None:
        actions.append((start_at + 0.85 * cfg.seconds, lambda: extra.update(tenants_snapshot=daemon.tenants_json())))
    if daemon is not None and charges and cfg.seconds >= CHARGES_MIN_WINDOW_S:
        def charged(when: str) -> Callable[[], None]:
            return lambda: extra.setdefault("charges", {}).update({when: compact(daemon.tenants_json())})
        lead = min(SNAPSHOT_LEAD_S, cfg.seconds / 4)
        actions += [(start_at - lead, charged("start")), (start_at + cfg.seconds - lead, charged("end"))]
    try:
        finished = wait_all(procs, start_at + cfg.seconds + cfg.grace_s, actions)
    finally:
        if alternator is not None:  # resumed before anything is killed
            extra["alternation"] = {"tenant": paused_name, **alternator.stop()}
    if not finished:
        extra["timed_out"] = True
        for proc in procs:
            kill_group(proc)
    results = []
    for (spec, argv, report_path, log), proc in zip(plans, procs, strict=True):
        found, missing = read_report(report_path)
        problems = [p for p in (missing,) if p]
        if proc.returncode not in (0, None):
            problems.append(f"exit status {proc.returncode}")
        if not finished:
            problems.append(f"still running {cfg.grace_s:g} s after its window: killed")
        results.append(TenantResult(spec.name, spec.kind, spec.weight, argv, proc.returncode,
                                    found, tail(log), "; ".join(problems) or None))
    return GroupResult(label, setup, results, start_at, time.time() - t0, extra)


# -------------------------------------------------------------------------------------- the daemon


class DaemonError(RuntimeError):
    pass


class Daemon:
    """`unisched serve` on a private socket and state dir; ready once `unisched status` says so.

    `contention`: a contention file copied into the (otherwise fresh) state dir, so the daemon uses that
    calibration; only that file, since a live daemon's state dir also holds its tenants (state.json).
    """

    def __init__(self, cfg: Config, name: str, contention: Path | None = None, serve_args: tuple[str, ...] = ()) -> None:
        self.cfg = cfg
        self.serve_args = serve_args  # e.g. ("--mode", "preemptive")
        self.dir = cfg.work_dir / f"daemon-{name}"
        self.state_dir = self.dir / "state"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.contention = contention
        # AF_UNIX paths are limited to ~107 bytes: keep the socket in a short private folder.
        self.socket = Path(tempfile.mkdtemp(prefix="us-")) / "unisched.sock"
        self.log = self.dir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.subtree = ""
        """Its cgroup subtree, its own unless the serve arguments name one (`own_subtree`)."""
        self.info: dict[str, Any] = {"socket": str(self.socket), "state_dir": str(self.state_dir),
                                     "slice_ms": cfg.slice_ms}
        if contention is not None:
            shutil.copyfile(contention, self.state_dir / CONTENTION_FILE)
            self.info["contention_file"] = str(contention)

    def start(self, timeout_s: float = 20.0) -> None:
        serve, self.subtree = own_subtree((*self.cfg.serve_args, *self.serve_args))
        argv = unisched_cmd(self.cfg, "serve", "--socket", str(self.socket), "--state-dir",
                            str(self.state_dir), "--slice-ms", f"{self.cfg.slice_ms:g}", *serve)
        self.info["argv"] = argv
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env=self.cfg.env, start_new_session=True)
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.socket.exists() and self._status_ok():
                self.info["ready_s"] = time.monotonic() - t0
                if self.contention is not None:  # which contention map did it pick? (best effort)
                    self.info["status"] = self.status_json()
                return
            try:  # the poll interval doubles as an early exit when the daemon dies
                rc = self.proc.wait(timeout=0.1)
                raise DaemonError(f"unisched serve exited with status {rc} before it was ready:\n"
                                  f"{tail(self.log, 1500)}")
            except subprocess.TimeoutExpired:
                pass
        raise DaemonError(f"unisched serve not ready after {timeout_s:g} s (socket "
                          f"{'present' if self.socket.exists() else 'absent'}):\n{tail(self.log, 1500)}")

    def _status_ok(self) -> bool:
        try:
            done = subprocess.run(unisched_cmd(self.cfg, "status", "--socket", str(self.socket)),
                                  cwd=ROOT, env=self.cfg.env, capture_output=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def status_json(self) -> dict[str, Any]:
        """`unisched status --json`: rc and the parsed reply (None when it does not parse)."""
        argv = unisched_cmd(self.cfg, "status", "--json", "--socket", str(self.socket))
        try:
            done = subprocess.run(argv, cwd=ROOT, env=self.cfg.env, capture_output=True, timeout=10)
        except subprocess.TimeoutExpired:
            return {"argv": argv, "rc": None, "parsed": None}
        try:
            parsed = json.loads(done.stdout)
        except ValueError:
            parsed = None
        return {"argv": argv, "rc": done.returncode, "parsed": parsed}

    def gpu_contention(self) -> str | None:
        """The contention map the daemon reported for its first GPU, when `status_json` got it."""
        parsed: Any = (self.info.get("status") or {}).get("parsed")
        try:
            return str(parsed["gpus"][0]["contention"])
        except (KeyError, IndexError, TypeError):
            return None

    def tenants_json(self) -> dict[str, Any]:
        """`unisched tenants --json` as run near the end of the window: parsed when it parses."""
        argv = unisched_cmd(self.cfg, "tenants", "--json", "--socket", str(self.socket))
        snap: dict[str, Any] = {"argv": argv, "at": time.time()}
        try:
            done = subprocess.run(argv, cwd=ROOT, env=self.cfg.env, capture_output=True, timeout=10)
        except subprocess.TimeoutExpired:
            return {**snap, "rc": None, "error": "timed out after 10 s"}
        out = done.stdout.decode(errors="replace")
        snap.update(rc=done.returncode, answered=time.time(), stdout=out,
                    stderr=done.stderr.decode(errors="replace")[-2000:])
        try:
            snap["parsed"] = json.loads(out)
        except ValueError:
            snap["parsed"] = None
        return snap

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM and wait; SIGKILL its process group only if it will not go, then thaw its tenants."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.info["killed"] = True
                kill_group(self.proc, grace_s=0.0)
                thaw_subtree(self.subtree)  # killed, it thawed nothing
        self.info["rc"] = self.proc.returncode
        self.info["log_tail"] = tail(self.log)
        shutil.rmtree(self.socket.parent, ignore_errors=True)  # our own mkdtemp folder
        remove_subtree(self.subtree)  # the tenants' cgroups (its own subtree: start)

    def keep_log(self, dest: Path) -> None:
        """Its log (charges.keep_log: whole, or its start and end) kept at `dest`, said in `info`."""
        if keep_log(self.log, dest):
            self.info["log"] = str(dest)
