"""Trampoline for `unisched run`: a fresh single-threaded process that installs the GPU session filter,
hands its listener to the daemon's agent socket, then execs the tenant's command (which inherits the filter).

    python -m unisched.enforce.hooked_exec --agent PATH -- CMD ARGS...
"""

from __future__ import annotations

import argparse
import os
import sys

from unisched.enforce.seccomp.abi import SeccompError, SeccompUnavailable
from unisched.enforce.seccomp.filter import install_filter
from unisched.enforce.seccomp.handover import hand_over


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="unisched-hooked-exec", description=__doc__)
    ap.add_argument("--agent", required=True, help="the daemon's seccomp agent socket")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("missing command")
    try:
        fd = install_filter()
        hand_over(fd, args.agent)
    except SeccompUnavailable as e:
        print(f"unisched run: GPU session hooks unavailable on this kernel ({e}); running without them",
              file=sys.stderr)
    except SeccompError as e:
        print(f"unisched run: {e}", file=sys.stderr)
        return 1
    try:
        os.execvp(cmd[0], cmd)
    except FileNotFoundError:
        print(f"unisched run: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"unisched run: permission denied: {cmd[0]}", file=sys.stderr)
        return 126
    return 1  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
