"""The CLI's gRPC client takes replies past gRPC's default 4 MiB: an admin's ListTenants of thousands of tenants,
each share with its charges by rule and source, is that large, and `unisched tenants` and `top` would fail on it
with RESOURCE_EXHAUSTED."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc

from unisched.transport.client import DaemonClient
from unisched_wire import unisched_pb2 as pb
from unisched_wire import unisched_pb2_grpc as pb_grpc

TENANTS = 80_000
"""Tenants of a 63-character name: a reply of ~5.6 MiB."""


class _Tenants(pb_grpc.UnischedServicer):
    def ListTenants(self, request: pb.ListTenantsRequest, context: grpc.ServicerContext) -> pb.ListTenantsReply:
        return pb.ListTenantsReply(tenants=[pb.Tenant(name=f"{i:063d}") for i in range(TENANTS)])


def test_a_list_of_tenants_past_4_mib_is_received(short_dir: Path) -> None:
    assert pb.ListTenantsReply(tenants=[pb.Tenant(name="x" * 63)] * TENANTS).ByteSize() > 5 << 20
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1),
                         options=[("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_UnischedServicer_to_server(_Tenants(), server)  # type: ignore[no-untyped-call]
    sock = short_dir / "d.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        with DaemonClient(socket=str(sock), timeout=30) as client:
            tenants = client.tenants()
        assert len(tenants) == TENANTS and tenants[-1].name == f"{TENANTS - 1:063d}"
    finally:
        server.stop(None)
