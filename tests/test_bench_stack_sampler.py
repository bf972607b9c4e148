"""bench/stack_sampler.py: a main thread that holds off its event loop is caught, with where it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = '''
import asyncio, time

def hold_the_loop():
    end = time.monotonic() + 0.4
    while time.monotonic() < end:  # busy, as a blocking call in a callback is
        pass

async def main():
    await asyncio.sleep(0.1)  # idle in the selector first
    hold_the_loop()
    await asyncio.sleep(0.1)

asyncio.run(main())
'''


def test_a_blocked_loop_is_listed_with_its_stack(tmp_path: Path) -> None:
    (tmp_path / "blocker.py").write_text(BLOCKER)
    out = tmp_path / "sample.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "stack_sampler.py"), str(out), "-m", "blocker"],
                   cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, check=True, timeout=60)
    body = json.loads(out.read_text())
    assert body["idle"] > 0  # the sleeps were seen as the selector's wait
    long = [s for s in body["stalls"] if s["ms"] >= 300]
    assert long, body["stalls"]
    assert any("hold_the_loop" in frame for s in long for st in s["stacks"] for frame in st["stack"])


def test_usage_without_a_module() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "stack_sampler.py"), "x.json"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "stack_sampler.py OUT.json -m" in r.stderr
