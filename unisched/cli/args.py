"""Argument types and option groups the `unisched` commands share: each value checked where it is parsed."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from typing import Any

from unisched.policy import WEIGHT_MAX, WEIGHT_MIN, Engine
from unisched.policy.caps import MAX_SESSIONS
from unisched.scheduler.config import (
    DEFAULT_SOCKET,
    KNOBS,
    MAX_GPU_INDEX,
    is_gpu_index,
    parse_size,
)
from unisched.scheduler.knobs import Knob


def int_in(what: str, lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: a whole number in lo..hi, with a message that names it."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer in {lo}..{hi}, got {text!r}") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"{what} must be in {lo}..{hi}, got {n}")
        return n

    return parse


weight_arg = int_in("weight", WEIGHT_MIN, WEIGHT_MAX)


def engines_arg(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    allowed = [e.value for e in Engine]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"engines must be a comma list of {', '.join(allowed)}; got {text!r}")
    return names


def gpus_arg(text: str) -> list[int]:
    bad = argparse.ArgumentTypeError(f"gpus must be a comma list of GPU indices 0..{MAX_GPU_INDEX}, got {text!r}")
    try:
        gpus = [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise bad from None
    if not all(map(is_gpu_index, gpus)):
        raise bad
    return gpus


_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""A Kubernetes namespace name (an RFC 1123 label)."""


def namespace_list(text: str) -> frozenset[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not _NAMESPACE.fullmatch(n)]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"a comma list of Kubernetes namespaces (RFC 1123 labels); got {text!r}")
    return frozenset(names)


def count_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number 0..{MAX_SESSIONS}, or -1 to clear; got {text!r}") from None
    if not -1 <= n <= MAX_SESSIONS:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_SESSIONS}, or -1 to clear; got {n}")
    return n


def size_arg(text: str) -> int:
    if text.strip() == "-1":
        return -1
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        default=os.environ.get("UNISCHED_SOCKET", DEFAULT_SOCKET),
        help=f"daemon socket (default: $UNISCHED_SOCKET or {DEFAULT_SOCKET})",
    )


def add_remote(p: argparse.ArgumentParser) -> None:
    """A read-only command may also reach the daemon's TCP listener (TLS with a client certificate)."""
    g = p.add_argument_group("remote daemon (its TCP listener; read-only calls)")
    g.add_argument("--target", metavar="HOST:PORT", help="the daemon's --listen address instead of --socket")
    g.add_argument("--tls-ca", metavar="PEM", help="CA certificate that signed the daemon's certificate")
    g.add_argument("--tls-cert", metavar="PEM", help="this client's certificate (signed by the daemon's tls_client_ca)")
    g.add_argument("--tls-key", metavar="PEM", help="this client's private key")


def remote_error(args: argparse.Namespace) -> str | None:
    tls = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    if args.target is None:
        given = [k for k, v in tls.items() if v is not None]
        verb = "applies" if len(given) == 1 else "apply"
        return f"{', '.join(given)} {verb} only with --target HOST:PORT" if given else None
    missing = [k for k, v in tls.items() if v is None]
    if missing:
        return f"--target needs {', '.join(missing)} (the daemon's TCP listener requires TLS with a client certificate)"
    host, _, port = args.target.rpartition(":")
    if not host or not port.isdigit():
        return f"--target must be HOST:PORT; got {args.target!r}"
    return None


def interval_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"interval must be a number of seconds, got {text!r}") from None
    if not 0.1 <= v <= 3600:
        raise argparse.ArgumentTypeError(f"interval must be in 0.1..3600 seconds, got {v:g}")
    return v


def add_tenant_opts(p: argparse.ArgumentParser, weight_required: bool = False) -> None:
    p.add_argument("--tenant", required=True, help="tenant name (letters, digits, '_', '.', '-'; "
                   "not a cgroup file's prefix such as 'cpu.')")
    p.add_argument(
        "--weight",
        type=weight_arg,
        required=weight_required,
        help=f"share weight {WEIGHT_MIN}..{WEIGHT_MAX} (default 100 for a new tenant)",
    )
    p.add_argument("--priority", choices=["online", "offline"], help="online preempts offline in preemptive mode")
    p.add_argument(
        "--engines", type=engines_arg, default=[], help="engines it uses: compute,graphics,decode,encode (default compute)"
    )
    p.add_argument("--gpus", type=gpus_arg, default=[], help="GPU indices it may use (default all)")


def add_memory_opts(p: argparse.ArgumentParser, refused: str) -> None:
    """GPU memory terms of a tenant a command makes, as `set-limit` sets them; `refused`: what a reserve that does
    not fit does to the command."""
    p.add_argument("--memory", type=size_arg, metavar="SIZE",
                   help="GPU memory the tenant may hold per GPU, e.g. 8GiB; the allocation that would cross it fails "
                        "as out of memory (as set-limit --memory; on a tenant that exists, admin)")
    p.add_argument("--memory-reserve", type=size_arg, metavar="SIZE",
                   help="GPU memory kept for the tenant on each GPU it may use, e.g. 4GiB, at most --memory (admin); "
                        f"{refused} when the reserves on a GPU would exceed its memory")


def _knob_help(spec: Knob) -> str:
    """The knob's help with its range, unit and default, from the one table (scheduler.config.KNOBS); argparse
    expands %, so it is doubled."""
    if spec.kind == "bool":
        text = f"turn {'off' if spec.default else 'on'} {spec.name} ({'on' if spec.default else 'off'} by default): {spec.help}"
    else:
        said = " ".join(p for p in (spec.range_text if spec.bounds else "", spec.unit) if p)
        if spec.default_text:
            default = f"default: {spec.default_text}"
        else:
            default = "unset by default" if spec.default is None else f"default {spec.default_shown}"
        text = f"{spec.help} ({said + '; ' if said else ''}{default})"
    return text.replace("%", "%%")


_METAVARS = {"ms": "MS", "us": "US", "s": "S", "fraction": "U", "port": "PORT", "%": "P", "slices": "N"}


def add_knob_flag(parser: argparse.ArgumentParser, spec: Knob) -> None:
    """One `serve` flag per config key; None when not given, so the file's value stands (with_overrides)."""
    common: dict[str, Any] = {"dest": spec.name, "default": None, "help": _knob_help(spec)}
    if spec.kind == "bool":
        parser.add_argument(spec.flag_name, action="store_const", const=not spec.default, **common)
    elif spec.kind == "choice":
        parser.add_argument(spec.flag_name, choices=spec.choices, **common)
    elif spec.kind == "str":
        parser.add_argument(spec.flag_name, **common)
    else:
        kind = int if spec.kind == "int" else float
        metavar = _METAVARS.get(spec.unit, "N" if kind is int else "X")
        parser.add_argument(spec.flag_name, type=kind, metavar=metavar, **common)


def knob_flags(args: argparse.Namespace) -> dict[str, Any]:
    """`serve`'s flags as DaemonConfig.with_overrides takes them (None: not given)."""
    return {spec.name: getattr(args, spec.name) for spec in KNOBS}


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value < 3600.0:
        raise argparse.ArgumentTypeError(f"must be above 0 and under 3600 s, got {text}")
    return value
