"""`unisched top`: a live view of tenants, their share per engine domain (target vs measured), state,
weight, sessions and refusals.

`render_frame` is pure (what the daemon answered -> a rich renderable) so tests render it to text;
`run_top` polls the daemon and redraws every interval until `q` (stdin a terminal, read in cbreak mode)
or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import time
import tty
from collections.abc import Iterator, Mapping, Sequence
from typing import TextIO

from rich import box
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb

__all__ = ["BAR_WIDTH", "render_frame", "run_top", "share_bar"]

BAR_WIDTH = 20
_STATE_STYLE = {"running": "green", "idle": "dim", "frozen": "cyan"}


def share_bar(target: float, measured: float, width: int = BAR_WIDTH) -> Text:
    """Measured share as filled cells, the target share as a marker: '██████████┃·········' (both 0.5)."""
    filled = round(min(max(measured, 0.0), 1.0) * width)
    mark = min(width - 1, round(min(max(target, 0.0), 1.0) * width)) if target > 0 else None
    bar = Text()
    for i in range(width):
        if i == mark:
            bar.append("┃", style="bold yellow")
        elif i < filled:
            bar.append("█", style="green")
        else:
            bar.append("·", style="dim")
    return bar


def _counts(values: Mapping[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(values.items()) if v) or "-"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _header(status: pb.StatusReply | None, tenants: int) -> Iterator[RenderableType]:
    if status is None:
        yield Text(f"unisched: {tenants} tenants", style="bold")
        return
    yield Text(
        f"unisched {status.version}: mode {status.mode}, slice {status.slice_ms:g} ms, {status.tenants} tenants, "
        f"up {status.uptime_s:.0f} s" + ("" if status.nvml else " (no NVML: CPU signals)"),
        style="bold",
    )
    for g in status.gpus:
        yield Text(gpu_line(g))


def gpu_line(g: pb.Gpu) -> str:
    """One GPU as `unisched status` and `top` show it, with its mixed slices while it has them."""
    line = (f"gpu{g.index} {g.name} [{g.contention}]  sm {100 * g.sm_util:.0f}%  dec {100 * g.dec_util:.0f}%  "
            f"enc {100 * g.enc_util:.0f}%  mem {g.memory_used / 2**30:.1f}/{g.memory_total / 2**30:.1f} GiB")
    if g.HasField("mix"):
        m = g.mix
        line += (f"  mixed: together {100 * m.together:.0f}% / compute {100 * m.compute_alone:.0f}% / graphics "
                 f"{100 * m.graphics_alone:.0f}% (now {m.now})")
    return line


def memory_text(t: pb.Tenant) -> str:
    """Video memory per GPU as the hooks count it: used/cap GiB, the reserve, and refused allocations."""
    parts = []
    for m in t.gpu_memory:
        cap = "-" if m.cap_bytes < 0 else f"{m.cap_bytes / 2**30:.1f}"
        text = f"gpu{m.gpu} {m.used_bytes / 2**30:.1f}/{cap} GiB"
        if m.reserve_bytes:
            text += f" r{m.reserve_bytes / 2**30:.1f}"
        if m.refused:
            text += f" !{m.refused}"
        parts.append(text)
    return ", ".join(parts) or "-"


def render_frame(
    tenants: Sequence[pb.Tenant],
    status: pb.StatusReply | None = None,
    error: str | None = None,
    hint: str | None = None,
) -> RenderableType:
    """One frame: a header (daemon, GPUs), then one row per tenant and engine domain it uses."""
    parts: list[RenderableType] = list(_header(status, len(tenants)))
    if error is not None:
        parts.append(Text(error, style="bold red"))
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True, expand=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("TENANT", "left"), ("WEIGHT", "right"), ("STATE", "left"), ("DOMAIN", "left"),
        ("SHARE", "left"), ("TARGET", "right"), ("MEASURED", "right"),
        ("GPU-S", "right"), ("SESSIONS", "left"), ("REFUSED", "left"),
    )
    longest = max((len(t.name) for t in tenants), default=6)
    min_width = {"TENANT": min(longest, 32), "SHARE": BAR_WIDTH, "DOMAIN": 8}
    for col, justify in columns:
        table.add_column(col, justify=justify, no_wrap=True, min_width=min_width.get(col))
    for t in tenants:
        weight = str(t.weight) if t.weight == t.base_weight else f"{t.weight} ({t.base_weight})"
        refused = _counts(t.refusals)
        first: list[RenderableType] = [
            Text(t.name, style="bold"), weight, Text(t.state, style=_STATE_STYLE.get(t.state, "")),
        ]
        rest: list[RenderableType] = [
            f"{t.gpu_seconds:.1f}", _counts(t.sessions), Text(refused, style="red" if refused != "-" else ""),
        ]
        shares = list(t.shares) or [pb.ResourceShare(target_share=t.target_share, measured_share=t.measured_share)]
        for i, s in enumerate(shares):
            domain = f"gpu{s.gpu}/{s.domain}" if s.domain else "-"
            bar = share_bar(s.target_share, s.measured_share)
            row: list[RenderableType] = [domain, bar, _pct(s.target_share), _pct(s.measured_share)]
            if i == 0:
                table.add_row(*first, *row, *rest)
            else:
                table.add_row("", "", "", *row, "", "", "")
    if tenants:
        parts.append(table)
        parts.extend(Text(f"memory {t.name}: {memory_text(t)}") for t in tenants if t.gpu_memory)
        parts.append(Text.assemble(("█", "green"), " measured share  ", ("┃", "bold yellow"), " target share", style="dim"))
    else:
        parts.append(Text("no tenants", style="dim"))
    if hint:
        parts.append(Text(hint, style="dim"))
    return Group(*parts)


class _Keys:
    """Single key presses from a terminal on stdin (cbreak: no Enter needed, Ctrl-C still interrupts)."""

    def __init__(self, stream: TextIO) -> None:
        self.fd = stream.fileno()
        self._saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd)

    def close(self) -> None:
        termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def wait_quit(self, timeout: float, interrupt_fd: int) -> bool:
        """Wait up to `timeout` seconds; True when q was pressed or `interrupt_fd` became readable (Ctrl-C)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.fd, interrupt_fd], [], [], left)
            if interrupt_fd in ready:
                return True
            if ready:
                data = os.read(self.fd, 64)
                if not data or b"q" in data.lower():
                    return True  # q, or the terminal went away
        return False


class _Interrupt:
    """SIGINT as a byte on a pipe that the view's wait selects on, instead of KeyboardInterrupt: raised at
    whatever bytecode runs when the signal lands, it could land inside grpc's or rich's internals (a finalizer,
    a callback) and be swallowed there, and the view would never end. This way it ends at its next wait, at most
    one call's deadline later. The previous handler comes back on close()."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._previous = signal.signal(signal.SIGINT, self._note)

    @property
    def fd(self) -> int:
        return self._r

    def _note(self, _signum: int, _frame: object) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._w, b"!")

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds; True once Ctrl-C came (also before this wait)."""
        ready, _, _ = select.select([self._r], [], [], timeout)
        return bool(ready)

    def close(self) -> None:
        signal.signal(signal.SIGINT, self._previous)
        os.close(self._r)
        os.close(self._w)


def run_top(
    client: DaemonClient,
    interval: float = 1.0,
    once: bool = False,
    console: Console | None = None,
    stdin: TextIO | None = None,
) -> int:
    """Redraw every `interval` s until q or Ctrl-C (0); `once`: print one frame (1 when the daemon is unreachable,
    raised as DaemonError). Errors after the first frame are shown in the view, which keeps retrying."""
    if console is None:
        # a pipe or file has no width to follow: keep rows whole (COLUMNS still wins)
        wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
        console = Console(width=160 if wide else None)
    tenants, status = client.tenants(), client.status()  # an unreachable daemon fails here, as elsewhere
    if once:
        console.print(render_frame(tenants, status))
        return 0
    stdin = stdin or sys.stdin
    keys = _Keys(stdin) if stdin.isatty() else None
    hint = f"q quits · every {interval:g} s" if keys else f"Ctrl-C quits · every {interval:g} s"

    def frame() -> RenderableType:
        try:
            return render_frame(client.tenants(), client.status(), hint=hint)
        except DaemonError as e:
            return render_frame([], None, error=str(e), hint=hint)

    interrupted = _Interrupt()

    def wait() -> bool:
        if keys is not None:
            return keys.wait_quit(interval, interrupted.fd)
        return interrupted.wait(interval)

    try:
        if console.is_terminal:
            start = render_frame(tenants, status, hint=hint)
            with Live(start, console=console, auto_refresh=False, screen=True, redirect_stderr=False) as live:
                while not wait():
                    live.update(frame(), refresh=True)
        else:  # output to a pipe or file: one frame after another, like `top -b`
            console.print(render_frame(tenants, status, hint=hint))
            while not wait():
                console.print(frame())
    except KeyboardInterrupt:
        pass
    finally:
        interrupted.close()
        if keys is not None:
            with contextlib.suppress(termios.error):
                keys.close()
    return 0
