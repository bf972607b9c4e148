"""A thin synchronous client for the CLI and tests (the daemon itself stays async)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from unisched_wire import unisched_pb2 as pb
from unisched_wire import unisched_pb2_grpc as pb_grpc
from unisched_wire.leasewire import MAX_REPLY_BYTES

__all__ = ["AGENT_SOCKET_METADATA", "LEASE_SOCKET_METADATA", "DaemonClient", "DaemonError", "RunSockets", "TlsFiles"]

AGENT_SOCKET_METADATA = "unisched-agent-socket"
"""Register's trailing metadata: the daemon's seccomp agent socket ("" when it has none), so `unisched run`
learns it in the same round trip as its registration."""
LEASE_SOCKET_METADATA = "unisched-lease-socket"
"""Register's trailing metadata: the daemon's lease socket, which `unisched run` names to its command."""

TlsFiles = tuple[str | Path, str | Path, str | Path]
"""(CA that signed the daemon's certificate, client certificate, client key): PEM files."""


@dataclass(frozen=True)
class RunSockets:
    """The daemon's sockets besides the one a client called, as `unisched run` needs them ("" for none)."""

    agent: str
    lease: str


class DaemonError(Exception):
    """A call the daemon refused or could not be reached for; str() is the message for the user."""

    def __init__(self, code: grpc.StatusCode | None, message: str) -> None:
        super().__init__(message)
        self.code = code


def _read(path: str | Path) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DaemonError(None, f"cannot read TLS file {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:  # else gRPC's TLS layer prints its own errors and the call says "unreachable"
        raise DaemonError(None, f"TLS file {path} is not PEM (no '-----BEGIN' line): give the PEM certificate or key")
    return data


class DaemonClient:
    """The daemon on its Unix socket (`socket`), or on a gRPC `target`; `tls` for the daemon's TCP listener."""

    def __init__(
        self, socket: str | None = None, target: str | None = None, timeout: float = 10.0, tls: TlsFiles | None = None
    ) -> None:
        self.address = target or f"unix:{socket}"
        self.tls = tls is not None
        options = [("grpc.max_receive_message_length", MAX_REPLY_BYTES)]
        if tls is None:
            self._channel = grpc.insecure_channel(self.address, options)
        else:
            ca, cert, key = (_read(p) for p in tls)
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            self._channel = grpc.secure_channel(self.address, creds, options)
        self._stub = pb_grpc.UnischedStub(self._channel)  # type: ignore[no-untyped-call]
        self.timeout = timeout

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: object) -> object:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def _call_with(self, method: str, request: object) -> tuple[Any, grpc.Call]:
        """The reply and the call (its metadata)."""
        try:
            return getattr(self._stub, method).with_call(request, timeout=self.timeout)  # type: ignore[no-any-return]
        except grpc.RpcError as e:
            raise self._error(e) from None

    def _error(self, e: grpc.RpcError) -> DaemonError:
        code = e.code()
        if code is grpc.StatusCode.UNAVAILABLE:
            details = e.details() or ""
            if not self.tls and "Permission denied" in details:
                return DaemonError(code, f"permission denied on the unisched daemon's socket {self.address}: only "
                                   "root and the members of its group (socket_group) may use it; ask an admin to "
                                   "add you")
            hint = f"({details})" if self.tls else "is `unisched serve` running?"
            return DaemonError(code, f"cannot reach the unisched daemon at {self.address}: {hint}")
        return DaemonError(code, e.details() or str(code))

    def register(self, request: pb.RegisterRequest) -> pb.Tenant:
        return self._call("Register", request)  # type: ignore[return-value]

    def register_for_run(self, request: pb.RegisterRequest) -> tuple[pb.Tenant, RunSockets]:
        """Register, and the daemon's other sockets: one round trip, or a Status call after it for a daemon
        that does not send the agent socket with its reply."""
        tenant, call = self._call_with("Register", request)
        sent = dict(call.trailing_metadata() or ())
        agent = sent.get(AGENT_SOCKET_METADATA)
        if agent is None:
            agent = self.status().agent_socket
        return tenant, RunSockets(str(agent), str(sent.get(LEASE_SOCKET_METADATA, "")))

    def adopt(self, request: pb.AdoptRequest) -> pb.Tenant:
        return self._call("Adopt", request)  # type: ignore[return-value]

    def set_weight(self, tenant: str, weight: int) -> pb.Tenant:
        return self._call("SetWeight", pb.SetWeightRequest(tenant=tenant, weight=weight))  # type: ignore[return-value]

    def set_limit(self, request: pb.SetLimitRequest) -> pb.Tenant:
        return self._call("SetLimit", request)  # type: ignore[return-value]

    def remove(self, tenant: str) -> None:
        self._call("RemoveTenant", pb.RemoveTenantRequest(tenant=tenant))

    def tenants(self) -> list[pb.Tenant]:
        reply = self._call("ListTenants", pb.ListTenantsRequest())
        assert isinstance(reply, pb.ListTenantsReply)
        return list(reply.tenants)

    def status(self) -> pb.StatusReply:
        return self._call("Status", pb.StatusRequest())  # type: ignore[return-value]
