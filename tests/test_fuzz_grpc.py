"""The gRPC API under hypothesis-generated requests: a real server in this process (fake cgroups), called through
its Unix socket (SO_PEERCRED identity) as root, as two non-admin uids, and with no identity (as over TLS).

After every example the server still answers, every refusal carries one of the codes the API documents, the
tenants it lists are well formed, callers only changed what they may change, and the state file reloads to what
the server shows.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inproc import in_process_server

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.policy import WEIGHT_MAX, WEIGHT_MIN, PolicyError, validate_tenant_name
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.registration import MAX_USER_TENANTS
from unisched.scheduler.state import StateStore
from unisched.transport.identity import PeerCred
from unisched_wire import unisched_pb2 as pb
from unisched_wire import unisched_pb2_grpc as pb_grpc

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
METHODS = {
    pb.RegisterRequest: "Register",
    pb.AdoptRequest: "Adopt",
    pb.SetWeightRequest: "SetWeight",
    pb.SetLimitRequest: "SetLimit",
    pb.RemoveTenantRequest: "RemoveTenant",
    pb.ListTenantsRequest: "ListTenants",
    pb.StatusRequest: "Status",
}
MUTATING_ADMIN = {"Adopt", "SetWeight", "SetLimit"}
OWNER_OR_ADMIN = {"RemoveTenant"}
EXISTING_CGROUPS = ("/other", "/system.slice/ctr.scope", "/unisched/orphan")
USERS = (1000, 1001)


@dataclass
class FuzzServer:
    socket: str
    state_dir: Path
    config: DaemonConfig = field(repr=False)
    as_uid: Callable[[int | str | None], None] = field(repr=False)
    driver: FakeCgroupDriver = field(repr=False)


@pytest.fixture
def fuzz_server(tmp_path: Path) -> Iterator[FuzzServer]:
    driver = FakeCgroupDriver()
    for cg in EXISTING_CGROUPS:
        driver.create(cg)
    with in_process_server(tmp_path / "state", driver=driver) as s:
        # The server sees the caller as SO_PEERCRED reports it (root: this process); `as_uid` makes it see a
        # non-admin uid instead, so one process can fuzz as several users (test_security.py drops privileges for real).
        # "side-door": no identity at all, as a call over the TLS listener has.
        uid_box: list[int | str | None] = [None]

        def caller(cred: PeerCred | None) -> PeerCred | None:
            uid = uid_box[0]
            if uid == "side-door":
                return None
            if cred is None or uid is None:
                return cred
            assert isinstance(uid, int)
            return dataclasses.replace(cred, uid=uid, gid=uid)

        def as_uid(uid: int | str | None) -> None:
            uid_box[0] = uid

        s.doors.grpc.caller = caller
        yield FuzzServer(s.socket, Path(s.config.state_dir), s.config, as_uid, driver)


# --- strategies --------------------------------------------------------------------------------------
INT32 = st.one_of(
    st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, 1, -1, 99, 100, 101, WEIGHT_MAX, WEIGHT_MAX + 1, 2**31 - 1, -(2**31)])
)
INT64 = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63)]))
POOL = ["a", "b", "web", "x" * 63, "orphan", "ctr"]
NAMES = st.one_of(
    st.sampled_from([*POOL, "x" * 64, "", " ", ".", "..", "../etc", "a/b", "-a", "cgroup.procs", "ünï", "a\x00b", "a\nb"]),
    st.text(max_size=80),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,70}", fullmatch=True),
)
ENGINES = st.lists(
    st.one_of(st.sampled_from(["compute", "graphics", "decode", "encode", "", "COMPUTE", "warp"]), st.text(max_size=12)),
    max_size=6,
)
GPUS = st.lists(INT32, max_size=4)
PRIORITY = st.one_of(st.sampled_from([0, 1, 2]), st.integers(-(2**31), 2**31 - 1))  # proto3 enums are open
CGROUPS = st.one_of(
    st.sampled_from([*EXISTING_CGROUPS, "/", "", "other", "unisched/orphan", "/unisched/a", "../../etc", "/x/../..", "//"]),
    st.text(max_size=40),
)


def _set_limit(tenant: str, **fields: int | None) -> pb.SetLimitRequest:
    req = pb.SetLimitRequest(tenant=tenant)
    for k, v in fields.items():
        if v is not None:
            setattr(req, k, v)
    return req


REQUESTS = st.one_of(
    st.builds(pb.RegisterRequest, tenant=NAMES, weight=INT32, priority=PRIORITY, engines=ENGINES, gpus=GPUS),
    st.builds(pb.AdoptRequest, tenant=NAMES, weight=INT32, priority=PRIORITY, cgroup=CGROUPS, engines=ENGINES, gpus=GPUS),
    st.builds(pb.SetWeightRequest, tenant=NAMES, weight=INT32),
    st.builds(
        _set_limit, tenant=NAMES, render=st.none() | INT32, decode=st.none() | INT32, encode=st.none() | INT32,
        memory_bytes=st.none() | INT64,
    ),
    st.builds(pb.RemoveTenantRequest, tenant=NAMES),
    st.just(pb.ListTenantsRequest()),
    st.just(pb.StatusRequest()),
)
CALLERS = st.sampled_from(["root", "root", *USERS, "side-door"])


# --- checks ------------------------------------------------------------------------------------------
def _call(stub: Any, method: str, req: Any) -> tuple[grpc.StatusCode, Any]:
    try:
        return grpc.StatusCode.OK, getattr(stub, method)(req, timeout=10)
    except grpc.RpcError as e:
        return e.code(), e.details()


def _view(tenants: list[pb.Tenant]) -> dict[str, tuple[Any, ...]]:
    """What a caller must not be able to change on tenants that are not its own."""
    return {
        t.name: (t.base_weight, t.priority, t.owner_uid, t.adopted, t.cgroup, tuple(t.engines),
                 t.caps.render, t.caps.decode, t.caps.encode, t.caps.memory_bytes)
        for t in tenants
    }


def _check_consistent(s: FuzzServer, stub: Any) -> None:
    code, status = _call(stub, "Status", pb.StatusRequest())
    assert code is grpc.StatusCode.OK, f"server no longer answers Status: {code} {status}"
    code, reply = _call(stub, "ListTenants", pb.ListTenantsRequest())
    assert code is grpc.StatusCode.OK, reply
    names = [t.name for t in reply.tenants]
    assert len(names) == len(set(names)) == status.tenants
    for t in reply.tenants:
        try:
            validate_tenant_name(t.name)
        except PolicyError as e:
            raise AssertionError(f"a tenant with an invalid name was created: {e}") from None
        assert WEIGHT_MIN <= t.weight <= WEIGHT_MAX and WEIGHT_MIN <= t.base_weight <= WEIGHT_MAX, t
        if not t.adopted:
            assert t.cgroup == f"/unisched/{t.name}", t
    for uid in USERS:
        assert sum(1 for t in reply.tenants if t.owner_uid == uid) <= MAX_USER_TENANTS
    # the state file is what the server shows once the tick has saved (registrations are saved within
    # SAVE_DELAY_S), and it reloads cleanly (a corrupt file would be renamed aside)
    shown = {t.name: (t.base_weight, t.owner_uid, t.adopted, t.cgroup) for t in reply.tenants}

    def saved() -> dict[str, tuple[int, int, bool, str]]:
        return {t.name: (t.weight, t.owner_uid, t.adopted, t.cgroup) for t in StateStore(s.state_dir).load()}

    wait_until(lambda: saved() == shown, 20, f"the state file to hold what the server shows: {shown}")
    assert not list(s.state_dir.glob("state.json.corrupt-*")), "the daemon wrote a state file it cannot read back"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(calls=st.lists(st.tuples(CALLERS, REQUESTS), min_size=1, max_size=6))
def test_fuzzed_requests_never_crash_or_corrupt(fuzz_server: FuzzServer, calls: list[tuple[Any, Any]]) -> None:
    s = fuzz_server
    with grpc.insecure_channel(f"unix:{s.socket}") as unix:
        unix_stub = pb_grpc.UnischedStub(unix)  # type: ignore[no-untyped-call]
        for caller, req in calls:
            method = METHODS[type(req)]
            s.as_uid(None)
            before = _view(unix_stub.ListTenants(pb.ListTenantsRequest(), timeout=10).tenants)
            was_in = s.driver.cgroup_of(os.getpid())  # every caller is this process, seen as another uid
            s.as_uid(None if caller == "root" else caller)
            try:
                code, reply = _call(unix_stub, method, req)
            finally:
                s.as_uid(None)
            assert code in ALLOWED, f"{method} as {caller} got {code}: {reply} (request {req!r})"
            after = _view(unix_stub.ListTenants(pb.ListTenantsRequest(), timeout=10).tenants)
            if caller == "root":
                continue
            if method == "ListTenants":  # others' tenants only as a public summary: no processes, no cgroup
                for t in reply.tenants:
                    if caller == "side-door" or t.owner_uid != caller:
                        assert not t.pids and not t.cgroup, f"{caller} sees the details of {t.name!r}"
            if caller == "side-door" or method in MUTATING_ADMIN:
                # no identity, or not an admin: nothing may change
                if method in MUTATING_ADMIN | OWNER_OR_ADMIN or method == "Register":
                    assert code is grpc.StatusCode.PERMISSION_DENIED, f"{method} as {caller} got {code}"
                assert after == before, f"{method} as {caller} changed tenants"
                continue
            if method in OWNER_OR_ADMIN and code is grpc.StatusCode.OK:
                assert before[req.tenant][2] == caller, f"uid {caller} removed a tenant of uid {before[req.tenant][2]}"
            if method == "Register" and code is grpc.StatusCode.OK:
                # only its own tenant, or the one whose cgroup already holds it (a container of an adopted pod)
                assert reply.owner_uid == caller or was_in == before[req.tenant][4], (
                    f"uid {caller} joined a tenant of uid {reply.owner_uid}")
                if req.tenant not in before:
                    assert reply.base_weight <= s.config.max_user_weight
            # a non-admin changes at most its own tenants
            for name, row in before.items():
                if row[2] != caller:
                    assert after.get(name) == row, f"uid {caller} changed tenant {name!r} it does not own"
            for name in set(after) - set(before):
                assert after[name][2] == caller
        _check_consistent(s, unix_stub)


PAYLOADS = st.one_of(
    st.binary(max_size=300),
    st.tuples(REQUESTS.map(lambda m: m.SerializeToString()), st.binary(max_size=20)).map(lambda t: t[0] + t[1]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(method=st.sampled_from(sorted(METHODS.values())), payload=PAYLOADS)
def test_raw_bytes_never_crash_the_server(fuzz_server: FuzzServer, method: str, payload: bytes) -> None:
    """Bytes that are not a valid request: grpc itself refuses what does not parse (INTERNAL or UNKNOWN, before
    any of our code runs); what parses (unknown fields included) gets a documented code; the server goes on."""
    request_type = next(t for t, m in METHODS.items() if m == method)
    try:
        request_type.FromString(payload)
        parses = True
    except Exception:  # google.protobuf.message.DecodeError and friends
        parses = False
    with grpc.insecure_channel(f"unix:{fuzz_server.socket}") as channel:
        call = channel.unary_unary(
            f"/unisched.v1.Unisched/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        try:
            call(payload, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        if parses:
            assert code in ALLOWED, f"{method} with {payload!r}: {code}"
        else:  # grpc's own answer to bytes that do not deserialize
            assert code in ALLOWED | {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}, f"{method} with {payload!r}: {code}"
        stub = pb_grpc.UnischedStub(channel)  # type: ignore[no-untyped-call]
        _check_consistent(fuzz_server, stub)
