# Sourced first by the bench/h200_*.sh scripts on the GPU machine: stop the call at once, naming the fix, when
# unisched cannot import there. Why: on 12-01 (sixth session) the machine's grpcio 1.84 refused our generated code
# (grpcio-tools 1.85.1), every daemon of a 4-minute call died at start, and only the runs without one were kept.
need=$(sed -nE 's/^ *"(grpcio|protobuf)>=([0-9.]+)".*/\1==\2/p' pyproject.toml | tr '\n' ' ')
if ! python3 -c "import unisched.transport.client, unisched.transport.lease" 2>/tmp/preflight.err; then
  tail -n 3 /tmp/preflight.err >&2
  echo "preflight: unisched does not import on this machine. Here (not there): bash ../shared/device/prepare.sh ${need}" >&2
  echo "preflight: then carry .devcache again and start the command with: source .devcache/setup.sh" >&2
  exit 3
fi
