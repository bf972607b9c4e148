#!/usr/bin/env python3
"""02: a PyTorch training loop under unisched (`with client.step():`), printing images/s and measured share.

Synthetic data, nothing downloaded. --model resnet50 (torchvision, random weights, batch 32, the scenario
programs' workload) or --model mlp (plain PyTorch: a deep bf16 MLP, no torchvision needed).

  python3 examples/02_pytorch_training.py --seconds 20                          # alone, no unisched
  python3 examples/02_pytorch_training.py --seconds 20 --tenant train --weight 300
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from _coop import add_unisched_args, connect, share_line, share_report
from _window import StepPauser, add_window_args, fail, measure, plan_window, write_report


def build(model: str, batch: int) -> tuple[Any, Any, Any, Any]:
    import torch
    from torch import nn

    dev = torch.device("cuda")
    if model == "resnet50":
        try:
            import torchvision
        except ImportError as e:
            raise RuntimeError(f"--model resnet50 needs torchvision ({e}); use --model mlp") from None
        net = torchvision.models.resnet50(weights=None, num_classes=1000).to(dev).to(memory_format=torch.channels_last)
        x = torch.randn(batch, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=dev)
    else:
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(4096, 4096), nn.ReLU()]
        net = nn.Sequential(*layers, nn.Linear(4096, 1000)).to(dev)
        x = torch.randn(batch, 4096, device=dev)
        y = torch.randint(0, 1000, (batch,), device=dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    return net, opt, x, y


def main(argv: list[str] | None = None) -> int:
    start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    ap.add_argument("--model", choices=["resnet50", "mlp"], default="resnet50")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default 32 for resnet50, 1024 for mlp)")
    ap.add_argument("--pause-every", type=int, default=0, metavar="N",
                    help="under unisched: let each step pause after every N-th weight layer, forward and backward, "
                         "while others wait for the GPU (a revoked step then leaves a part, not its rest, beside "
                         "the next holder's work; for trainers next to online tenants). 0 (default): off")
    ap.add_argument("--pausable", action="store_true",
                    help="idle between steps from SIGUSR1 to SIGUSR2, the lease handed back meanwhile (for benchmarks "
                         "that alternate this load on and off: bench/scenarios.py --interleave)")
    add_unisched_args(ap)
    args = ap.parse_args(argv)
    pauser = StepPauser() if args.pausable else None  # before any thread starts: they inherit its signal mask
    batch = args.batch or (32 if args.model == "resnet50" else 1024)
    if args.pause_every < 0:
        ap.error("--pause-every must be 0 (off) or a positive number of layers")
    start_at, end_at = plan_window(args, start)
    try:
        import torch
        from torch import nn
    except ImportError as e:
        return fail(f"PyTorch is not importable: {e}")
    client = connect(args, ("compute",))  # before CUDA starts: the daemon's MPS settings, where it has them
    if not torch.cuda.is_available():
        return fail("torch.cuda.is_available() is False (no GPU or no CUDA driver)")
    try:
        net, opt, x, y = build(args.model, batch)
    except RuntimeError as e:
        return fail(str(e))
    loss_fn = nn.CrossEntropyLoss()
    step_gate = client.step() if client is not None else None
    if step_gate is not None and args.pause_every:
        step_gate.pause_points(net, every=args.pause_every)

    def train_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def step() -> int:
        if pauser is not None and client is not None:
            pauser.between_steps(client.gate("compute").release)
        elif pauser is not None:
            pauser.between_steps()
        if step_gate is not None:
            with step_gate:
                train_step()
            step_gate.drain()  # counts a step when it has finished
        else:
            train_step()
            torch.cuda.synchronize()
        return batch

    window = measure(step, start_at, end_at)
    share = share_report(client, "compute")
    report = write_report(args.report, "train", "img/s", window,
                          {"share": share, "model": args.model, "batch": batch, "device_name": torch.cuda.get_device_name(),
                           "pause_splits": step_gate.flight.splits if step_gate is not None else 0,
                           **({"pauses": pauser.pauses, "paused_s": round(pauser.paused_s, 3)} if pauser else {})})
    print(f"02_pytorch_training pid={report['pid']}: {window.throughput:.1f} img/s ({args.model}, batch {batch}); "
          f"{share_line(share)}", flush=True)
    if client is not None:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
