"""One cloud-gaming run of N players under a daemon of this checkout, the players started with a timer slack of
SLACK_NS (inherited through fork and exec; 0 leaves the default)."""
import ctypes
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, "bench")
from _daemon import start_daemon

out, n, slack = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
work = out / f"cg-{n}-slack-{slack}"
work.mkdir(parents=True)
d, sock = start_daemon(work, "--log-level", "debug")
if slack:
    assert ctypes.CDLL(None, use_errno=True).prctl(29, ctypes.c_ulong(slack), 0, 0, 0) == 0  # PR_SET_TIMERSLACK
try:
    with (work / "run.log").open("w") as log:
        rc = subprocess.run([sys.executable, "examples/cloud_gaming.py", "--instances", n, "--weights", "1,2,4",
                             "--warmup", "20", "--out", str(work / "players"), "--report", str(work / "report.json"),
                             "--width", "640", "--height", "360", "--iterations", "140", "--unisched-socket", sock],
                            timeout=150, stdout=log, stderr=subprocess.STDOUT).returncode
    print(work.name, "rc", rc)
finally:
    d.send_signal(signal.SIGINT)
    d.wait(30)
