"""GPU diagnostic: why a busy CUDA tenant under `unisched run` can read 'idle' (tests/test_gpu.py)."""
import json, os, subprocess, sys, time
sock = "/tmp/diag/d.sock"
os.makedirs("/tmp/diag", exist_ok=True)
log = open("/tmp/diag/daemon.log", "wb")
d = subprocess.Popen([sys.executable, "-m", "unisched", "serve", "--socket", sock, "--state-dir", "/tmp/diag/state",
                      "--slice-ms", "50", "--log-format", "json", *([] if os.environ.get("OLD") else ["--cgroup-subtree", "unisched-diag"])], stdout=log, stderr=log)
def cli(*a):
    return subprocess.run([sys.executable, "-m", "unisched", a[0], "--socket", sock, *a[1:]], capture_output=True, text=True)
for _ in range(100):
    if cli("status").returncode == 0: break
    time.sleep(0.2)
BURN = ("import torch,time\nx=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\nprint('burn start',flush=True)\n"
        "end=time.time()+10\nwhile time.time()<end:\n    for _ in range(4): y=x@x\n    torch.cuda.synchronize()\nprint('burn end',flush=True)\n")
t0 = time.time()
p = subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", sock, "--tenant", "diag", "--", sys.executable, "-c", BURN])
while p.poll() is None and time.time() - t0 < 60:
    ts = json.loads(cli("tenants", "--json").stdout or "[]")
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip().replace("\n", ";")
    for t in ts:
        print(f"{time.time()-t0:5.1f}s state={t.get('state')} gpu_s={t.get('gpu_seconds',0):.2f} sessions={t.get('sessions')} pids={t.get('pids')} mem={t.get('memory_bytes')} nvidia-smi=[{apps}]", flush=True)
    time.sleep(0.5)
print("run rc", p.wait())
d.terminate(); d.wait()
for line in open("/tmp/diag/daemon.log"):
    if any(k in line for k in ("diag", "session", "slicing", "lending", "error", "hook")):
        print(line.strip()[:300])
