"""Regenerate the committed gRPC code from unisched.proto (needs grpcio-tools; dev only).

`python -m unisched.transport.codegen` rewrites the modules; `--check` exits 1 when they are stale.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUTPUTS = ("unisched_pb2.py", "unisched_pb2.pyi", "unisched_pb2_grpc.py")


def generate(out_root: Path) -> None:
    from grpc_tools import protoc  # dev-only dependency

    rc = protoc.main(
        [
            "protoc",
            f"-I{ROOT}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str((HERE / "unisched.proto").relative_to(ROOT)),
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def stale_files() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        gen = Path(tmp) / "unisched" / "transport"
        return [name for name in OUTPUTS if not (HERE / name).exists() or (gen / name).read_text() != (HERE / name).read_text()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed code is stale")
    args = ap.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated code: " + ", ".join(stale), file=sys.stderr)
            return 1
        print("generated code is up to date")
        return 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
