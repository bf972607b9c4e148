"""`unisched`: the daemon (`serve`) and the commands that talk to it. This parses (cli.parser, cli.args) and
dispatches to the command (cli.commands); `serve` thaws what a dead daemon left frozen first."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from unisched.cli.args import remote_error
from unisched.cli.commands import COMMANDS
from unisched.cli.parser import build_parser
from unisched.enforce.governed import thaw_orphans
from unisched.transport.client import DaemonError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `serve` thaws what a dead daemon left frozen before anything else, so no later error (a bad flag or config,
    # a damaged state file) can leave a tenant frozen for good
    serving = argv[:1] == ["serve"] and "--check-config" not in argv
    orphans = thaw_orphans() if serving and os.geteuid() == 0 else None
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        if orphans is not None:
            from unisched.daemon import say_orphans

            say_orphans(orphans)
        raise
    args.orphans = orphans
    if hasattr(args, "target") and (problem := remote_error(args)):
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subcommands.choices[args.command].error(problem)  # with the command's own usage line
    try:
        return COMMANDS[args.command](args)
    except DaemonError as e:
        print(f"unisched {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`unisched tenants --json | head`): stop quietly, as other Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
        return 141
