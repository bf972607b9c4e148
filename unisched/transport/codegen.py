"""Regenerate the committed gRPC code from our .proto files (needs grpcio-tools; dev only).

unisched.proto (the daemon's API, in the wire package clients/unisched_wire that the daemon and the client library
share) and the kubelet's device plugin, pod resources, plugin registration and DRA plugin APIs under
unisched/integrations/kubernetes/.
`python -m unisched.transport.codegen` rewrites the modules; `--check` exits 1 when any is stale.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PACKAGE = ROOT / "unisched"
KUBERNETES = PACKAGE / "integrations" / "kubernetes"
CLIENTS = ROOT / "clients"
"""The client distribution's root: its .proto files are generated from here, so their code imports `unisched_wire`."""
PROTOS = (
    CLIENTS / "unisched_wire" / "unisched.proto",
    KUBERNETES / "deviceplugin_v1beta1.proto",
    KUBERNETES / "podresources_v1.proto",
    KUBERNETES / "pluginregistration_v1.proto",
    KUBERNETES / "dra_v1beta1.proto",
)


def outputs(proto: Path) -> list[Path]:
    """The generated files of one .proto, beside it."""
    stem = proto.stem
    return [proto.with_name(f"{stem}_pb2.py"), proto.with_name(f"{stem}_pb2.pyi"), proto.with_name(f"{stem}_pb2_grpc.py")]


def include_root(proto: Path) -> Path:
    """The directory a .proto's import path starts from: the generated code imports its package from there."""
    return CLIENTS if proto.is_relative_to(CLIENTS) else ROOT


def generate(out_root: Path) -> None:
    """Write every .proto's code under out_root, at the path its package has under the repository."""
    from grpc_tools import protoc  # dev-only dependency

    for proto in PROTOS:
        base = include_root(proto)
        out = out_root / base.relative_to(ROOT)
        out.mkdir(parents=True, exist_ok=True)
        rc = protoc.main(
            [
                "protoc",
                f"-I{base}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(proto.relative_to(base)),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto.name} with exit code {rc}")


def stale_files() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for proto in PROTOS:
            for path in outputs(proto):
                rel = path.relative_to(ROOT)
                fresh = Path(tmp) / rel
                if not path.exists() or fresh.read_text() != path.read_text():
                    stale.append(str(rel))
        return stale


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
