"""CPU stand-in for GPU work in tests: optionally block (idle) until a line arrives on a FIFO, then burn
one core for --seconds."""

import argparse
import time

ap = argparse.ArgumentParser()
ap.add_argument("--seconds", type=float, default=10.0)
ap.add_argument("--wake-fifo")
args = ap.parse_args()
if args.wake_fifo:
    with open(args.wake_fifo) as f:
        f.readline()
end = time.monotonic() + args.seconds
x = 0
while time.monotonic() < end:
    for _ in range(10000):
        x += 1
