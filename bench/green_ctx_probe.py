"""What CUDA green contexts would give a trainer that shares the GPU with online requests (issue 5).

Why: beside a ResNet-50 b128 trainer the MPS SM cap keeps the request at ~1.0x, but a static cap costs the trainer
all the time (0.47-0.50 of its solo rate at 30% of the SMs, 0.73-0.76 at 60%; bench/results/2026-12-02-h200-b), while
the requests hold the GPU ~14% of it. A trainer that ran narrow only while a request runs, on a green context of
N SMs (torch.cuda.green_contexts; with MPS only where the client has no thread cap), and on the whole device
otherwise, could keep most of its rate, if switching is cheap. Before the daemon tells trainers when to narrow,
this measures, in one process and with no daemon:
  1. a training step's rate on N SMs against the whole device: the kept that narrowing to N costs while narrow (and
     a forward pass without autograd and the step's own forward, to tell which part the context narrows);
  2. what a switch costs: a step with a switch to the narrow context and back at every --switch-every-th weight
     layer (forward), against the plain step; a trainer narrowing for each request pays one such pair a request;
  3. whether green contexts work here at all (the torch build, the driver, under MPS with --mps).

  python3 bench/green_ctx_probe.py --out /tmp/green             # whole device, then each N
  python3 bench/green_ctx_probe.py --out /tmp/green-mps --mps   # the same as a client of a private MPS server
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gpu_pairs as gp

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SMS = "112,92,66,40,24"
KINDS = {"forward": "forward only", "train_forward": "step's forward", "step": "training step"}
"""What is timed on each context, in this order, and its column: a forward pass without autograd, the step's forward
with it, a training step. The step last: 12-02's run hung in its first step on 40 SMs (the forward never ran), so a
size whose backward hangs still reports its forward."""
REQUESTS_PER_S = 20.0  # the online scenario's rate; a trainer narrowing for each request switches there and back once


def load_build() -> Callable[[str, int], tuple[Any, Any, Any, Any]]:
    """examples/02's model builder (the file name starts with a digit: not importable by name)."""
    sys.path.insert(0, str(ROOT / "examples" / "workloads"))
    sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("pytorch_training", ROOT / "examples" / "02_pytorch_training.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build  # type: ignore[no-any-return]


def parse_sms(text: str) -> list[int]:
    try:
        sms = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated SM counts, e.g. {DEFAULT_SMS}; got {text!r}") from None
    if not sms or any(n < 1 for n in sms):
        raise argparse.ArgumentTypeError(f"SM counts must be positive; got {text!r}")
    return sms


def switch_cost(plain_ms: float, switching_ms: float, switches_per_step: int) -> dict[str, float | None]:
    """Per switch pair (to narrow and back), and what it would cost a trainer narrowing for every request."""
    if switches_per_step < 1:
        return {"us_per_pair": None, "overhead_at_rate": None}
    per_pair_s = max(0.0, switching_ms - plain_ms) / 1000 / switches_per_step
    return {"us_per_pair": per_pair_s * 1e6, "overhead_at_rate": per_pair_s * REQUESTS_PER_S}


def entered(gc: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """The green context's enter and leave: set_context / pop_context in recent torch, make_current / pop_current in
    the first releases that had green contexts (the GPU machine has torch 2.11)."""
    if hasattr(gc, "set_context"):
        return gc.set_context, gc.pop_context
    return gc.make_current, gc.pop_current


def note(msg: str) -> None:
    """Each driver call announced first: on 12-02 a run stopped answering after the first size (no line said where)."""
    print(f"green_ctx_probe: {msg}", file=sys.stderr, flush=True)


def measure(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The timings; `save` gets the results so far after each setting, so a run killed in a hung driver call keeps
    what it had measured."""
    import torch
    from torch import nn

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False (no GPU or no CUDA driver)")
    from torch.cuda import green_contexts

    props = torch.cuda.get_device_properties(0)
    out: dict[str, Any] = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                           "cuda": torch.version.cuda, "green_supported": bool(getattr(green_contexts, "SUPPORTED", True)),
                           "mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), "model": args.model,
                           "batch": args.batch, "steps": args.steps}
    net, opt, x, y = load_build()(args.model, args.batch)
    loss_fn = nn.CrossEntropyLoss()

    def step(on_backward: Callable[[Any], Any] | None = None) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(net(x), y)
        if on_backward is not None:  # a hook on the loss's gradient: the first thing autograd's thread runs
            loss.register_hook(on_backward)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # runs on autograd's own thread, where the green context is not current: may be refused
        opt.step()

    def forward() -> None:  # the main thread only: tells "green contexts work" from "backward works under them"
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            net(x)

    def train_forward() -> None:  # the step's forward and loss, graph kept then dropped: the step's part before backward
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_fn(net(x), y)

    # 12-02's run: on 112 SMs forward kept 0.86 (narrowed) but the step 0.99; train_forward tells which part escaped
    kinds = dict(zip(KINDS, (forward, train_forward, step), strict=True))

    def timed(label: str, fn: Callable[[], None]) -> float:
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        ms = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - t0) * 1000)
        med = statistics.median(ms)
        note(f"{label}: {med:.2f} ms (median of {args.steps})")
        return med

    whole = {k: timed(f"whole device, {k}", fn) for k, fn in kinds.items()}
    out["whole_device_ms"] = whole
    save(out)
    if not out["green_supported"]:
        out["error"] = "this torch build has no green contexts"
        return out
    out["narrow"] = {}
    # Every context stays alive to the end: rebinding `enter` would destroy the last one (cuGreenCtxDestroy) while
    # torch's caching allocator may still hold blocks allocated inside it, one suspect for 12-02's hang.
    alive: list[Any] = []

    def create(n: int) -> tuple[Callable[[], None], Callable[[], None]]:
        alive.append(green_contexts.GreenContext.create(num_sms=n, device_id=0))
        return entered(alive[-1])

    def time_narrow(n: int, enter: Callable[[], None], leave: Callable[[], None], entry: dict[str, Any], key: str,
                    fn: Callable[[], None], whole_ms: float) -> None:
        """`fn` timed inside the context into entry[key_ms] and its kept against the whole device, or the
        driver's refusal into entry[key_error]."""
        note(f"entering {n} SMs for {key}")
        enter()
        try:
            entry[f"{key}_ms"] = ms = timed(f"{n} SMs, {key}", fn)
            entry[f"{key}_kept"] = whole_ms / ms
        except RuntimeError as e:
            entry[f"{key}_error"] = first_line(e)
        finally:
            note(f"leaving {n} SMs")
            leave()

    def narrow_backward(n: int, enter: Callable[[], None], leave: Callable[[], None], entry: dict[str, Any]) -> None:
        """A step with the context current on autograd's backward thread too: pushed there by a hook on the loss's
        gradient at the first backward, and left there (popping it at the end of backward would need a hook that
        runs last on that thread), so this must be the process's last use of that thread."""
        pushed: list[bool] = []

        def on_backward_thread(grad: Any) -> Any:
            if not pushed:
                note(f"entering {n} SMs on autograd's thread")
                enter()
                pushed.append(True)
            return grad

        time_narrow(n, enter, leave, entry, "step_narrow_backward", lambda: step(on_backward_thread), whole["step"])

    for n in args.sms:
        entry: dict[str, Any] = out["narrow"].setdefault(str(n), {})
        note(f"creating a green context of {n} SMs")
        try:  # the driver may refuse: too old, MPS with a thread cap, a count it cannot split
            enter, leave = create(n)
        except RuntimeError as e:
            entry["error"] = first_line(e)
            continue
        for k, fn in kinds.items():
            time_narrow(n, enter, leave, entry, k, fn, whole[k])
            save(out)
        if args.narrow_backward:
            narrow_backward(n, enter, leave, entry)
            save(out)
    if args.switch_sms == 0:
        return out
    note(f"creating a green context of {args.switch_sms} SMs for switching")
    try:
        enter, leave = create(args.switch_sms)
    except RuntimeError as e:
        out["switch"] = {"error": first_line(e)}
        return out
    points = [m for m in net.modules() if isinstance(m, nn.Conv2d | nn.Linear)][:: args.switch_every]

    def there_and_back(*_: Any) -> None:
        enter()
        leave()

    hooks = [m.register_forward_pre_hook(there_and_back) for m in points]
    try:
        switching = timed(f"a switch to {args.switch_sms} SMs and back at {len(points)} layers", step)
    except RuntimeError as e:
        out["switch"] = {"error": first_line(e)}
        return out
    finally:
        for h in hooks:
            h.remove()
    out["switch"] = {"narrow_sms": args.switch_sms, "pairs_per_step": len(points), "step_ms": switching,
                     "plain_ms": whole["step"], **switch_cost(whole["step"], switching, len(points))}
    return out


def first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Green contexts on {r.get('device')} ({r.get('sms')} SMs), torch {r.get('torch')}, CUDA {r.get('cuda')}",
             "", f"{r.get('model')} training, batch {r.get('batch')}, median of {r.get('steps')} steps; "
             f"MPS client: {'yes' if r.get('mps_pipe') else 'no'}; green contexts in this build: "
             f"{r.get('green_supported')}.", "",
             "| SMs | " + " | ".join(f"{label} ms | kept" for label in KINDS.values()) + " |",
             "|---" * (1 + 2 * len(KINDS)) + "|"]
    whole = r.get("whole_device_ms") or {}
    lines.append(f"| all ({r.get('sms')}) | " + " | ".join(f"{gp.fmt(whole.get(k))} | 1.00" for k in KINDS) + " |")
    for n, v in (r.get("narrow") or {}).items():
        if "error" in v:
            lines.append(f"| {n} | {v['error']} |" + " |" * (2 * len(KINDS) - 1))
            continue
        cells = [n]
        for k in KINDS:  # a run killed part-way saved the kinds it had
            if f"{k}_error" in v:
                cells += [v[f"{k}_error"], ""]
            else:
                cells += [f"{v[f'{k}_ms']:.2f}", f"{v[f'{k}_kept']:.2f}"] if f"{k}_ms" in v else ["not run", ""]
        lines.append("| " + " | ".join(cells) + " |")
    for n, v in (r.get("narrow") or {}).items():
        if "step_narrow_backward_error" in v:
            lines += ["", f"{n} SMs, the context current on autograd's thread too: {v['step_narrow_backward_error']}"]
        elif "step_narrow_backward_ms" in v:
            lines += ["", f"{n} SMs, the context current on autograd's thread too: a step {v['step_narrow_backward_ms']:.2f} ms, "
                      f"{v['step_narrow_backward_kept']:.2f} kept."]
    s = r.get("switch") or {}
    if "error" in s:
        lines += ["", f"Switching: {s['error']}"]
    elif s:
        lines += ["", f"Switching to {s['narrow_sms']} SMs and back at {s['pairs_per_step']} layers a step: "
                  f"{s['step_ms']:.2f} ms against {s['plain_ms']:.2f} ms plain, "
                  f"{s['us_per_pair'] or 0:.0f} us a pair; narrowing for each of {REQUESTS_PER_S:g} requests/s, the "
                  f"trainer would lose {100 * (s['overhead_at_rate'] or 0):.2f}% to switching."]
    if r.get("error"):
        lines += ["", f"Error: {r['error']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for results.json and results.md")
    ap.add_argument("--model", choices=["resnet50", "mlp"], default="resnet50")
    ap.add_argument("--batch", type=int, default=128, help="training batch (default 128: SM-bound on the H200)")
    ap.add_argument("--sms", type=parse_sms, default=parse_sms(DEFAULT_SMS),
                    help=f"green context sizes to time a step on, in SMs (default {DEFAULT_SMS}; the driver rounds "
                         "them to its granularity)")
    ap.add_argument("--switch-sms", type=int, default=66, help="the narrow context of the switching test (default 66, "
                    "a size whose step ran alone and under MPS; 0 = no switching test)")
    ap.add_argument("--switch-every", type=int, default=8, help="switch at every N-th weight layer (default 8, as the "
                    "trainer's pause points in bench/scenarios.py)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per setting (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    ap.add_argument("--narrow-backward", action="store_true",
                    help="also time a step with the context pushed on autograd's backward thread (left there: use with "
                         "one size a process and no switching test)")
    ap.add_argument("--mps", action="store_true", help="run as the only client of a private MPS server, no thread cap")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.warmup < 0 or args.switch_every < 1 or args.switch_sms < 0:
        ap.error("--batch, --steps and --switch-every must be positive, --warmup and --switch-sms at least 0")
    if args.narrow_backward and (len(args.sms) > 1 or args.switch_sms):
        ap.error("--narrow-backward leaves the context current on autograd's thread, which would narrow every later "
                 "backward: give it one --sms size and --switch-sms 0")
    args.out.mkdir(parents=True, exist_ok=True)
    # stopped from outside (`timeout` in h200_green_probe.sh): unwind, so a private MPS server is asked to quit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.mps and not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        from scenarios import mps_daemon

        try:
            with mps_daemon(args.out / "mps") as env:  # the child is the client: its CUDA starts under MPS
                env = {k: v for k, v in {**os.environ, **env}.items() if k != "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"}
                return subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])],
                                      env=env, check=False).returncode
        except RuntimeError as e:
            print(f"error: MPS did not start: {e}", file=sys.stderr)
            return 2
    def save(results: dict[str, Any]) -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "results.md").write_text(markdown(results))

    try:
        results = measure(args, save)
    except (RuntimeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save(results)
    print(markdown(results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
