#!/usr/bin/env python3
"""Run a Python module with a thread that samples its main thread's stack, to find what blocks an event loop.

  python3 bench/stack_sampler.py OUT.json -m unisched serve --socket /tmp/d.sock ...

Every EVERY_S the sampler looks at the main thread: waiting in the selector (the loop is idle) or elsewhere (busy).
OUT.json says where the busy samples were (the innermost frames, most common first) and lists every stretch of
STALL_S or more that the main thread spent busy without returning to its selector, or that the sampler itself
could not run (the main thread held the GIL), with the stacks seen in it. It is written every WRITE_EVERY_S and
at exit, so a daemon that is killed still leaves what was sampled until then. bench/lease_load.py runs its
daemon under it when LL_SAMPLE=OUT.json is set.
"""

from __future__ import annotations

import atexit
import collections
import runpy
import sys
import threading
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import save_json

EVERY_S = 0.002
STALL_S = 0.05
WRITE_EVERY_S = 5.0
DEPTH = 10
KEPT_STALLS = 200


def _stack(frame: FrameType | None) -> tuple[str, ...]:
    out: list[str] = []
    while frame is not None and len(out) < DEPTH:
        code = frame.f_code
        out.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return tuple(out)


def _idle(stack: tuple[str, ...]) -> bool:
    """The loop waits for I/O: its innermost frame is the selector's select()."""
    return bool(stack) and stack[0].startswith("selectors.py:select:")


class Sampler:
    def __init__(self, out: Path, main_ident: int) -> None:
        self.out = out
        self.main = main_ident
        self.t0 = time.monotonic()
        self.samples = 0
        self.idle = 0
        self.busy: collections.Counter[tuple[str, ...]] = collections.Counter()
        self.stalls: list[dict[str, object]] = []
        self.stall_count = 0
        self.lock = threading.Lock()

    def _stall(self, start: float, end: float, why: str, stacks: collections.Counter[tuple[str, ...]]) -> None:
        self.stall_count += 1
        if len(self.stalls) < KEPT_STALLS:
            self.stalls.append({"at_s": round(start - self.t0, 3), "ms": round(1000 * (end - start), 1), "why": why,
                                "stacks": [{"n": n, "stack": list(s)} for s, n in stacks.most_common(3)]})

    def run(self) -> None:
        last = time.monotonic()
        last_write = last
        busy_since: float | None = None
        run_stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
        while True:
            time.sleep(EVERY_S)
            now = time.monotonic()
            frame = sys._current_frames().get(self.main)
            if frame is None:
                return
            stack = _stack(frame)
            with self.lock:
                self.samples += 1
                if now - last >= STALL_S:
                    self._stall(last, now, "sampler could not run (GIL held)", collections.Counter({stack: 1}))
                if _idle(stack):
                    self.idle += 1
                    if busy_since is not None and now - busy_since >= STALL_S:
                        self._stall(busy_since, now, "busy without returning to the selector", run_stacks)
                    busy_since = None
                    run_stacks = collections.Counter()
                else:
                    self.busy[stack] += 1
                    run_stacks[stack] += 1
                    if busy_since is None:
                        busy_since = last
            last = now
            if now - last_write >= WRITE_EVERY_S:
                self.write()
                last_write = now

    def write(self) -> None:
        with self.lock:
            body = {"seconds": round(time.monotonic() - self.t0, 1), "samples": self.samples, "idle": self.idle,
                    "every_ms": 1000 * EVERY_S, "stall_ms": 1000 * STALL_S, "stalls_total": self.stall_count,
                    "stalls": self.stalls,
                    "busy_top": [{"n": n, "stack": list(s)} for s, n in self.busy.most_common(40)]}
        save_json(self.out, body)


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit(__doc__)
    out, module = Path(sys.argv[1]), sys.argv[3]
    sampler = Sampler(out, threading.main_thread().ident or 0)
    threading.Thread(target=sampler.run, name="stack-sampler", daemon=True).start()
    atexit.register(sampler.write)
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
