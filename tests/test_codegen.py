"""The committed gRPC code must match unisched.proto (in the wire package) and the kubelet's .proto files under
integrations/kubernetes."""

import pytest


def test_generated_code_is_up_to_date() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) is needed to regenerate")
    from unisched.transport.codegen import stale_files

    assert stale_files() == [], "run: python -m unisched.transport.codegen"


def test_every_proto_is_generated_and_checked() -> None:
    from unisched.transport.codegen import PROTOS, ROOT

    assert set(ROOT.joinpath("unisched").rglob("*.proto")) | set(ROOT.joinpath("clients").rglob("*.proto")) == set(PROTOS)


def test_the_wire_protocol_lives_in_one_place() -> None:
    """The daemon and the client import the same generated module: no second copy of the protocol in the daemon."""
    from unisched.transport.codegen import ROOT

    assert list(ROOT.joinpath("unisched").rglob("unisched.proto")) == []
    assert list(ROOT.joinpath("unisched").rglob("leasewire.py")) == []
