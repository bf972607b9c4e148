"""`unisched serve` on a private socket and a cgroup subtree of its own, for the benchmarks that need a bare daemon
(lease_load, hook_startup, the runner's steps); bench/gpu_pairs.py has its own `Daemon` with status checks and
tenant snapshots."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unisched.enforce.cgroups import CgroupDriver

ROOT = Path(__file__).resolve().parents[1]


def bench_env(root: Path = ROOT) -> dict[str, str]:
    """The checkout `root` (and its wire package, clients/) first on PYTHONPATH, whatever was set after it (a
    machine's own site directory, say)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), str(root / "clients"),
                                                                      os.environ.get("PYTHONPATH")]))}


_STARTED = itertools.count(1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (for a daemon's --metrics-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """A daemon's /metrics on `port`: (sample name, labels, value) of every sample."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def start_daemon(work: Path, *extra: str, timeout_s: float = 30.0, root: Path = ROOT,
                 profile: Path | None = None, sample: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start the daemon (of the checkout `root`) with its socket, state and log in `work`; returns it and its socket
    once the socket is there. Exits with the log's tail when it dies first or does not come up. `profile`: run it
    under cProfile (its main thread: the event loop and every gRPC handler), written there when it exits. `sample`:
    run it under bench/stack_sampler.py (what blocked its event loop, and for how long), written there.

    Unless `extra` names one, it gets a cgroup subtree of its own (unisched-bench-<pid>-<n>): a benchmark's tenants
    never share the subtree of a daemon already serving the host (whose cgroups a stopping daemon would thaw), and
    `stop_daemon` removes them."""
    if profile and sample:
        raise SystemExit("start_daemon: profile or sample, not both (each runs the daemon under itself)")
    work = work.absolute()  # `serve` takes absolute socket and state paths only
    extra, subtree = own_subtree(extra)
    (work / "subtree").write_text(subtree)
    (work / "origin").write_text(_own_cgroup() or "")
    sock = str(work / "d.sock")
    prof = (["-m", "cProfile", "-o", str(profile)] if profile
            else [str(ROOT / "bench" / "stack_sampler.py"), str(sample)] if sample else [])
    with (work / "daemon.log").open("wb") as log:  # the daemon writes to its own copy of the file
        daemon = subprocess.Popen([sys.executable, *prof, "-m", "unisched", "serve", "--socket", sock, "--state-dir",
                                   str(work / "state"), *extra], stdout=log, stderr=log,
                                  env=bench_env(root),
                                  cwd=root)
    deadline = time.monotonic() + timeout_s
    while not Path(sock).exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            raise SystemExit(f"unisched serve did not come up:\n{(work / 'daemon.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return daemon, sock


def stop_daemon(daemon: subprocess.Popen[bytes], work: Path, timeout_s: float = 30.0) -> None:
    """Stop a daemon `start_daemon` started in `work` (SIGTERM, killed if it does not exit in `timeout_s`, and then
    its tenants thawed) and remove its cgroup subtree; this process, where it registered itself as a tenant
    (lease_flood, lease_load), goes back to the cgroup it started in first."""
    subtree = (work / "subtree").read_text() if (work / "subtree").exists() else None
    daemon.terminate()
    try:
        daemon.wait(timeout_s)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
        if subtree is not None:
            thaw_subtree(subtree)
    if subtree is not None:
        from unisched.enforce.cgroups import within  # the checkout's own, as the daemons use it

        origin = (work / "origin").read_text() if (work / "origin").exists() else ""
        here = _own_cgroup()
        if origin and here and within(here, "/" + subtree.strip("/")):  # this process registered itself
            _driver().attach(origin, os.getpid())
        remove_subtree(subtree)


def thaw_subtree(subtree: str) -> None:
    """Thaw every cgroup of a daemon's subtree: a daemon killed thawed nothing, and its tenants' processes must not
    stay frozen (nor, under the v1 freezer, keep its cgroups from being removed)."""
    thaw = _driver(subtree.strip("/"))
    for cgroup in thaw.managed():
        thaw.set_frozen(cgroup, False)


def _driver(subtree: str | None = None) -> CgroupDriver:
    """The checkout's own cgroup driver, as the daemons detect it (for `subtree`: a daemon's own)."""
    from unisched.enforce.cgroups import DEFAULT_SUBTREE, detect_driver

    return detect_driver("auto", subtree=subtree or DEFAULT_SUBTREE, create=False)


def _own_cgroup() -> str | None:
    """This process's cgroup in the hierarchy the daemons govern (None: no cgroups to govern here)."""
    try:
        return _driver().cgroup_of(os.getpid())
    except Exception:  # no usable freezer (not root, no cgroup fs): nothing will have moved it
        return None


def own_subtree(serve_args: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """`unisched serve` arguments with a cgroup subtree for this run's daemon (unisched-bench-<pid>-<n>) unless they
    name one, and the subtree."""
    for i, word in enumerate(serve_args):
        if word.startswith("--cgroup-subtree="):
            return serve_args, word.split("=", 1)[1]
        if word == "--cgroup-subtree" and i + 1 < len(serve_args):
            return serve_args, serve_args[i + 1]
    subtree = f"unisched-bench-{os.getpid()}-{next(_STARTED)}"
    return (*serve_args, "--cgroup-subtree", subtree), subtree


def remove_subtree(subtree: str) -> None:
    """A run's own cgroup subtree (`--cgroup-subtree`), in every hierarchy the daemon made it in, deepest first (empty
    once the tenants are gone); what cannot be removed is said on stderr."""
    rel = subtree.strip("/")
    if not rel or ".." in rel.split("/"):
        raise ValueError(f"remove_subtree: {subtree!r} is not a daemon's subtree")  # never the hierarchy's root
    fs = Path("/sys/fs/cgroup")
    for top in [fs / rel, *fs.glob(f"*/{rel}")]:  # cgroup v2's one hierarchy, or each of v1's
        for d in [*sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True), top] if top.is_dir() else []:
            if d.is_dir():
                try:
                    d.rmdir()
                except OSError as e:
                    print(f"{Path(sys.argv[0]).name}: left {d}: {e.strerror}", file=sys.stderr)
