"""The seccomp answer path's floor: hook_answer.py's tenant child (CUDA and EGL contexts of fake RM calls on
/dev/null, 800 us of busy time before each) answered, in turn, by the product's SessionSupervisor (a thread of this
process, sync wake-up), by pysup.py (the same syscalls in plain Python), by hybsup.py (the syscalls in C through fastcall.c's two
calls with Python between them, `hybrid`; or fastcall.c's loop in a thread of a Python process, `native-thread`)
and by csup.c (all in a C process). A helper process says when it serves; the tenant starts only then. Prints, for
each of 6 rounds (the order alternating), the mean time one of the tenant's calls took per context kind.

    gcc -O2 -o /tmp/csup csup.c && gcc -O2 -shared -fPIC -o /tmp/fastcall.so fastcall.c
    python3 cmp.py /tmp/csup /tmp/fastcall.so     (from this folder, as root)
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import hook_answer as ha  # noqa: E402

from unisched.enforce.seccomp.agent import recv_agent_message  # noqa: E402
from unisched.enforce.seccomp.supervisor import SessionSupervisor  # noqa: E402


def run(kind: str, csup: str, fastcall: str, contexts: int = 20, gap_us: int = 800) -> tuple[dict[str, float], float]:
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, ha.__file__, "--child", str(theirs.fileno()), "--contexts", str(contexts),
                              "--plain", "20", "--gap-us", str(gap_us)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, pass_fds=[theirs.fileno()], cwd=ROOT)
    theirs.close()
    fd, _ = recv_agent_message(ours)
    thread, helper = None, None
    if kind == "product":
        engine = ha.FakeEngine()
        sup = SessionSupervisor(fd, "bench", engine.decide, engine.on_event)
        thread = threading.Thread(target=sup.serve_forever)
        thread.start()
    else:
        argv = {"c": [csup, str(fd), "1"], "python": [sys.executable, str(HERE / "pysup.py"), str(fd)]}.get(kind) or [
            sys.executable, str(HERE / "hybsup.py"), str(fd), fastcall, kind]
        helper = subprocess.Popen(argv, pass_fds=[fd], stdout=subprocess.PIPE, text=True)
        os.close(fd)
        assert helper.stdout is not None and helper.stdout.readline().strip() == "serving"
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "ready"
    child.stdin.write("go\n")
    child.stdin.flush()
    out = json.loads(child.stdout.readline())
    child.stdin.close()
    child.wait()
    if thread is not None:
        thread.join(10)
    if helper is not None:
        helper.wait(10)
    per = {k: statistics.mean(total / n for total, n in v) / 1000 for k, v in out["contexts"].items()}
    return per, statistics.median(out["times"]["plain ioctl"]) / 1000


def main(csup: str, fastcall: str) -> None:
    for rnd in range(6):
        kinds = ("product", "python", "hybrid", "native-thread", "c")
        for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
            per, plain = run(kind, csup, fastcall)
            shown = ", ".join(f"{k} {v:.1f}" for k, v in per.items())
            print(f"round {rnd + 1}, {kind}: us per call {shown}; an ioctl the filter lets through {plain:.1f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
