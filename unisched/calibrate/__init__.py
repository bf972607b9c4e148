"""Calibration: measure on a real GPU how much its engines slow each other, for the daemon to read at start.

`unisched calibrate` (command.main) runs GPU workloads in subprocesses and writes STATE_DIR/contention.json
(scheduler.contention_file). The daemon never imports this package: serving measures nothing, it reads the file.
"""

from unisched.calibrate.command import EXIT_FAILED, EXIT_REFUSED, NO_GPU, QUICK, STANDARD, Request, Timing, estimate_s, main

__all__ = ["EXIT_FAILED", "EXIT_REFUSED", "NO_GPU", "QUICK", "STANDARD", "Request", "Timing", "estimate_s", "main"]
