# Sourced first by the bench/h200_*.sh scripts on the GPU machine: stop the call at once, naming the fix, when
# unisched cannot import there. Why: on 12-01 (sixth session) the machine's grpcio 1.84 refused our generated code
# (grpcio-tools 1.85.1), every daemon of a 4-minute call died at start, and only the runs without one were kept.
# Then the calls' common ground: $OUT (what comes back; /tmp/out when run by hand) made, Python's output unbuffered
# (progress lines reach the log as they happen), and record_machine for the GPU and driver beside the results.
need=$(sed -nE 's/^ *"(grpcio|protobuf)>=([0-9.]+)".*/\1==\2/p' pyproject.toml | tr '\n' ' ')
if ! python3 -c "import unisched.transport.client, unisched.transport.lease" 2>/tmp/preflight.err; then
  tail -n 3 /tmp/preflight.err >&2
  echo "preflight: unisched does not import on this machine. Here (not there): bash ../shared/device/prepare.sh ${need}" >&2
  echo "preflight: then carry .devcache again and start the command with: source .devcache/setup.sh" >&2
  exit 3
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
record_machine() { nvidia-smi -q | grep -iE "product name|driver version|compute mode" > "$OUT/machine.txt" 2>&1; }
