"""The committed gRPC code must match unisched.proto and the kubelet's .proto files under integrations/kubernetes."""

import pytest


def test_generated_code_is_up_to_date() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) is needed to regenerate")
    from unisched.transport.codegen import stale_files

    assert stale_files() == [], "run: python -m unisched.transport.codegen"


def test_every_proto_is_generated_and_checked() -> None:
    from unisched.transport.codegen import PACKAGE, PROTOS

    assert set(PACKAGE.rglob("*.proto")) == set(PROTOS)
