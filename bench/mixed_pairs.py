"""The members and pairs of bench/mixed_engines.py: what each member runs, which pairs it accepts, a round's plan
and about how long it takes.

Why apart from the runner: the command lines and the plan are checked without a GPU
(tests/test_bench_mixed_engines.py), and bench/suites.py takes the suite's minutes a round from the same sum the
runner prints. Standard library only: bench/run.py imports it through suites.py before the daemon's package is on
the path.

Members (a pair is two members of one engine, so that they contend):
  app       examples/workloads/cuda_matmul.py unmodified (bf16 8192x8192, synchronised every 4) under
            `unisched run --engines compute` (the freezer)
  clientK   cuda_matmul.py --client: each step of K bf16 4096x4096 matmuls inside `client.step()` (leases)
  render    examples/workloads/egl_render.py unmodified (1920x1080, glFinish every frame) under
            `unisched run --engines graphics`
  frame     egl_render.py --client: every frame inside `FrameGate` (the graphics lease, timed by GL queries)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_WORKLOAD = ROOT / "examples" / "workloads" / "cuda_matmul.py"
RENDER_WORKLOAD = ROOT / "examples" / "workloads" / "egl_render.py"
RENDER_ITERATIONS = 447
"""egl_render.py --iterations: about 36 FPS alone on the H200 (27 ms frames), as gpu_pairs' calibration found; the
render of the pairs and overlap suites, so a frame is about half of a 50 ms slice."""
CLIENT_MATMUL_SIZE = 4096
"""A client step's matmuls are 4096x4096 (about 0.2 ms each on the H200), so K sets the step from ~1 ms up."""
DEFAULT_PAIRS = "client8+app,client240+app,client8+client8,frame+render,frame+frame"
DEFAULT_WEIGHTS = "1:1,3:1,1:3"
DEFAULT_SECONDS = 8.0
DEFAULT_WARMUP_S = 6.0
MATMUL_S = 1 / 4855
"""A client's 4096x4096 bf16 matmul on the H200 (client8 alone: 4855 matmul/s), for the length of its steps."""
SLICE_S, RUN_UNITS, MAX_RUN_S = 0.050, 8, 0.500
"""The daemon's defaults (slice_ms, Tuning.run_units, lease_max_run_ms; tests/test_bench_mixed_engines.py checks
they match): a client whose steps are long against the slice earns turns of RUN_UNITS steps, at most MAX_RUN_S."""
WINDOW_CYCLES = 24
"""A pair's window holds at least this many of its scheduling cycles (a client's turn and the other's). A window
cuts a cycle where it falls, and a side with share s then reads up to s(1-s)/N of the GPU off (N cycles): with
50 ms steps a client's turns are ~0.4 s and at 1:3 a cycle ~1.6 s, so an 8 s window (5 cycles) can read a share up
to 3.75 points off by where it falls alone. With 24, at most 1.04 points at 1:1 and 0.78 at 1:3 (a quarter of that
on average)."""
RUN_OVERHEAD_S = 2.0
"""Per run beyond warm-up and window, for the estimate: a fresh daemon's start-up and SIGTERM, the workloads' exit
and reports. Measured on the H200: a default round (18 runs) took 285 s, 15.8 s a run (bench/results/
2026-12-03-h200-4fb9e1f/mixed)."""
ENGINE = {"app": "compute", "client": "compute", "render": "graphics", "frame": "graphics"}
"""Each member's engine; a pair's two members must share one (compute beside graphics overlaps on the H200: no
contention to split)."""
UNIT = {"compute": "matmul/s", "graphics": "frames/s"}


@dataclass(frozen=True)
class Workloads:
    """The workload commands (shell words) members run: the CUDA one and the render one."""

    cuda: tuple[str, ...] = (sys.executable, str(CUDA_WORKLOAD))
    render: tuple[str, ...] = (sys.executable, str(RENDER_WORKLOAD))
    render_iterations: int = RENDER_ITERATIONS


@dataclass(frozen=True)
class Member:
    """`app`, `clientK`, `render` or `frame` (see the module's docstring)."""

    spec: str

    @property
    def family(self) -> str:
        return "client" if self.spec.startswith("client") else self.spec

    @property
    def client_steps(self) -> int | None:
        return int(self.spec[len("client"):]) if self.family == "client" else None

    @property
    def engine(self) -> str:
        return ENGINE[self.family]

    @property
    def unit(self) -> str:
        return UNIT[self.engine]

    @property
    def cooperative(self) -> bool:
        """A client of the library (leases), not an unmodified app under `unisched run`."""
        return self.family in ("client", "frame")

    def command(self, tenant: str, weight: int, sock: str, start_at: float, seconds: float, report: Path,
                workloads: Workloads) -> list[str]:
        """The argv of this member as tenant `tenant` with daemon weight `weight`, measuring over the shared window."""
        window = ["--start-at", f"{start_at:.3f}", "--seconds", f"{seconds:g}", "--report", str(report)]
        if self.engine == "graphics":
            app = [*workloads.render, "--iterations", str(workloads.render_iterations), *window]
        else:
            k = self.client_steps
            app = [*workloads.cuda, *(["--size", str(CLIENT_MATMUL_SIZE), "--sync-every", str(k)] if k else []),
                   *window]
        if self.cooperative:
            return [*app, "--client", tenant, "--weight", str(weight), "--socket", sock]
        return [sys.executable, "-m", "unisched", "run", "--socket", sock, "--tenant", tenant, "--weight", str(weight),
                "--engines", self.engine, "--", *app]


def parse_member(text: str) -> Member:
    m = Member(text)
    steps = text[len("client"):] if m.family == "client" else ""
    known = text in ("app", "render", "frame") or (steps.isdigit() and int(steps) > 0)
    if not known:
        raise SystemExit(f"--pairs: {text!r} is none of app, clientK (K matmuls a step), render, frame")
    return m


def parse_pairs(text: str) -> list[tuple[Member, Member]]:
    """'client8+app,frame+render' -> pairs; both members of a pair on one engine."""
    out = []
    for item in filter(None, text.split(",")):
        a, plus, b = item.partition("+")
        if not plus:
            raise SystemExit(f"--pairs: {item!r} is not A+B")
        ma, mb = parse_member(a), parse_member(b)
        if ma.engine != mb.engine:
            raise SystemExit(f"--pairs: {item!r} pairs {ma.engine} with {mb.engine}, which do not contend "
                             "(pair app/clientK together, render/frame together)")
        out.append((ma, mb))
    if not out:
        raise SystemExit("--pairs: no pair given")
    return out


def parse_weights(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        a, _, b = item.partition(":")
        if not (a.isdigit() and b.isdigit() and int(a) > 0 and int(b) > 0):
            raise SystemExit(f"--weights: {item!r} is not A:B with positive integers")
        out.append((int(a), int(b)))
    return out


def plan(pairs: list[tuple[Member, Member]], weights: list[tuple[int, int]]) -> list[tuple[Member, Member, tuple[int, int]]]:
    """Every pair at every weight, less A+A at A:B with A < B (the same run as B:A)."""
    return [(a, b, w) for a, b in pairs for w in weights if not (a == b and w[0] < w[1])]


def members_of(pairs: list[tuple[Member, Member]]) -> list[Member]:
    """The members of the pairs, each once (each runs alone once a round, for its alone rate)."""
    return [Member(s) for s in sorted({m.spec for p in pairs for m in p})]


def turn_s(m: Member) -> float:
    """About how long a member's turns are when it contends (0: a slice at a time, as for apps and frames)."""
    k = m.client_steps
    run = 0.0 if k is None else min(MAX_RUN_S, RUN_UNITS * k * MATMUL_S)
    return run if run >= 2 * SLICE_S else 0.0


def window_s(a: Member, b: Member, w: tuple[int, int], seconds: float) -> float:
    """The measured window of pair a+b at weights w: `seconds`, or WINDOW_CYCLES of its cycles when longer."""
    cycle = max((turn_s(m) * sum(w) / wm for m, wm in ((a, w[0]), (b, w[1]))), default=0.0)
    return max(seconds, WINDOW_CYCLES * cycle)


def round_seconds(pairs: list[tuple[Member, Member]], weights: list[tuple[int, int]], warmup: float,
                  seconds: float) -> float:
    """About how long a round runs: every member alone and every planned pair, each on a fresh daemon (an estimate
    from the workloads' warm-up and windows, RUN_OVERHEAD_S for the rest)."""
    runs = [seconds] * len(members_of(pairs)) + [window_s(a, b, w, seconds) for a, b, w in plan(pairs, weights)]
    return sum(warmup + s + RUN_OVERHEAD_S for s in runs)


def default_round_minutes() -> float:
    """The suite's estimate: a round of the default pairs and weights."""
    return round(round_seconds(parse_pairs(DEFAULT_PAIRS), parse_weights(DEFAULT_WEIGHTS), DEFAULT_WARMUP_S,
                               DEFAULT_SECONDS) / 60.0, 1)
