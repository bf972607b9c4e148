"""Session admission's pure parts: the driver classes and ioctl decoding, the seccomp filter (run on a BPF
interpreter here), the agent messages of runc, crun and `unisched run`, the OCI profile, and the session ledger."""

from __future__ import annotations

import json
import struct

import pytest
from conftest import ROOT
from test_seccomp import GRAPHICS, NVDEC

from unisched.enforce import nvclasses as nv
from unisched.enforce.nvclasses import SessionKind, classify, decode_ioctl, iowr
from unisched.enforce.seccomp.abi import (
    AUDIT_ARCH_AARCH64,
    AUDIT_ARCH_I386,
    AUDIT_ARCH_X86_64,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_USER_NOTIF,
    SeccompError,
)
from unisched.enforce.seccomp.accounting import EventAction, SessionEvent, SessionLedger
from unisched.enforce.seccomp.agent import parse_agent_message
from unisched.enforce.seccomp.calls import escape_of
from unisched.enforce.seccomp.filter import NOTIFIED, build_filter
from unisched.enforce.seccomp.handover import make_agent_message
from unisched.scheduler.config import DEFAULT_RUNTIME_AGENT_SOCKET


# --- pure parts ------------------------------------------------------------------------------------------------------
def test_classes_and_ioctl_decoding() -> None:
    assert classify(0xCB97) is SessionKind.GRAPHICS
    assert classify(0xCBC0) is SessionKind.COMPUTE
    assert classify(0xB8B0) is SessionKind.NVDEC
    assert classify(0xC9B7) is SessionKind.NVENC
    assert classify(0xA0BC) is SessionKind.NVENC_SW_SESSION
    assert classify(0xCED0) is SessionKind.NVJPG
    assert classify(0xB8FA) is SessionKind.OFA
    for not_a_session in (0xC56F, 0xC86F, 0xC8B5, 0xA06C, 0x0041, 0x1234):
        assert classify(not_a_session) is None
    cmd = iowr(ord("F"), nv.RM_ALLOC, 32)
    assert cmd == 0xC020462B
    assert decode_ioctl(cmd) == (0x46, 0x2B, 32)
    assert decode_ioctl(cmd | 0xFFFFFFFF00000000) == (0x46, 0x2B, 32)  # musl sign-extends the request
    assert decode_ioctl(iowr(ord("F"), nv.XFER, 16)) == (0x46, 0xD3, 16)
    assert decode_ioctl(iowr(ord("F"), nv.RM_ALLOC, 48))[2] == nv.NVOS64_SIZE


def _run_bpf(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = (0,) * 6) -> int:
    """A classic-BPF interpreter for the instructions build_filter uses, on a struct seccomp_data."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    insns = [struct.unpack_from("=HBBI", prog, i) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    for _ in range(len(insns) + 1):
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x54:
            acc &= k
        elif code == 0x15:
            pc += jt if acc == k else jf
        elif code == 0x06:
            return int(k)
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")
        pc += 1
    raise AssertionError("BPF program did not return")


def test_filter_is_well_formed_and_matches_what_it_should() -> None:
    for notify_free, match_type in ((True, True), (False, True), (True, False)):
        prog = build_filter(notify_free=notify_free, match_type=match_type)
        assert prog and len(prog) % 8 == 0 and len(prog) // 8 <= 4096
        insns = [struct.unpack_from("=HBBI", prog, i) for i in range(0, len(prog), 8)]
        for i, (code, jt, jf, k) in enumerate(insns):
            assert code in (0x20, 0x54, 0x15, 0x06), f"insn {i}: opcode {code:#x}"
            if code == 0x15:
                assert i + 1 + max(jt, jf) < len(insns), f"insn {i}: jump out of range"
            if code == 0x20:
                assert k in (0, 4, 24), f"insn {i}: loads seccomp_data offset {k}"
        assert insns[-1][0] == 0x06

    prog = build_filter()
    rm_alloc, xfer, rm_free = iowr(0x46, 0x2B, 32), iowr(0x46, 0xD3, 16), iowr(0x46, 0x29, 16)
    heap, dup = iowr(0x46, 0x4A, 184), iowr(0x46, 0x34, 28)  # heap allocations; dups, which may take driver handles
    notif, allow = SECCOMP_RET_USER_NOTIF, SECCOMP_RET_ALLOW
    alloc_object, alloc_memory = iowr(0x46, 0x28, 20), iowr(0x46, 0x27, 56)  # RM_ALLOC's older forms
    x32 = 0x40000000 | 514  # an x32 process's ioctl: x86_64's arch, its own number
    for arch, ioctl_nr in ((AUDIT_ARCH_X86_64, 16), (AUDIT_ARCH_X86_64, x32), (AUDIT_ARCH_AARCH64, 29),
                           (AUDIT_ARCH_I386, 54), (0x40000028, 54)):  # the last: 32-bit ARM on aarch64
        assert escape_of(ioctl_nr, arch, rm_alloc) == (0x2B, 32)
        for cmd in (rm_alloc, xfer, rm_free, heap, dup, alloc_object, alloc_memory, iowr(0x46, 0x2B, 48),
                    rm_alloc | 0xFFFFFFFF00000000):
            assert _run_bpf(prog, ioctl_nr, arch, (3, cmd, 0x1000)) == notif, (hex(arch), hex(cmd))
        for cmd in (iowr(0x46, 0x2A, 32), iowr(0x47, 0x2B, 32), 0x541B, 0x5401):  # RM_CONTROL, other type, FIONREAD
            assert _run_bpf(prog, ioctl_nr, arch, (3, cmd, 0x1000)) == allow, (hex(arch), hex(cmd))
        assert _run_bpf(prog, ioctl_nr + 1, arch, (3, rm_alloc)) == allow  # not ioctl
    assert _run_bpf(prog, 29, AUDIT_ARCH_X86_64, (3, rm_alloc)) == allow  # x86_64 nr 29 is shmget, not ioctl
    assert _run_bpf(prog, 16, 0x40000015, (3, rm_alloc)) == allow  # an arch the filter does not know
    assert _run_bpf(build_filter(notify_free=False), 16, AUDIT_ARCH_X86_64, (3, rm_free)) == allow
    assert _run_bpf(build_filter(match_type=False), 16, AUDIT_ARCH_X86_64, (3, iowr(0x47, 0x2B, 32))) == notif


RUNC_HELLO = {
    "ociVersion": "1.2.0",
    "fds": ["seccompFd"],
    "pid": 4242,
    "metadata": "tenant=render",
    "state": {
        "ociVersion": "1.2.0",
        "id": "c0ffee",
        "status": "creating",
        "pid": 4242,
        "bundle": "/run/containerd/io.containerd.runtime.v2.task/k8s.io/c0ffee",
        "annotations": {"io.kubernetes.pod.name": "game-0"},
    },
}


CRUN_HELLO = (
    '{"ociVersion":"0.2.0","fds":["seccompFd"],"pid":777,"metadata":"","state":{"ociVersion":"0.2.0","id":"abc",'
    '"status":"running","pid":777,"bundle":"/var/lib/containers/abc/userdata"}}'
)


def test_agent_messages_from_runc_crun_and_unisched_run() -> None:
    hello = parse_agent_message(json.dumps(RUNC_HELLO).encode())
    assert (hello.pid, hello.metadata, hello.container_id, hello.status) == (4242, "tenant=render", "c0ffee", "creating")
    assert hello.annotations == {"io.kubernetes.pod.name": "game-0"}
    assert hello.fd_index == 0 and hello.oci_version == "1.2.0"
    crun = parse_agent_message(CRUN_HELLO)  # crun writes ociVersion 0.2.0 and may omit annotations
    assert (crun.pid, crun.container_id, crun.status, crun.annotations, crun.oci_version) == (777, "abc", "running", {}, "0.2.0")
    ours = parse_agent_message(make_agent_message(99, metadata="m"))
    assert (ours.pid, ours.metadata, ours.status) == (99, "m", "running")
    for bad in (b"not json", b"[1]", b'{"fds":["seccompFd"]}', b'{"pid":-1}', b'{"pid":5,"fds":["other"]}', b'{"pid":true}'):
        with pytest.raises(SeccompError):
            parse_agent_message(bad)


def test_oci_profile_notifies_exactly_the_filter_s_calls() -> None:
    """The OCI profile is the runtime's default (refusing what it does not list) plus notify rules for exactly the
    calls `unisched run`'s own filter notifies on."""
    profile = json.loads((ROOT / "deploy/seccomp/unisched-gpu.json").read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert profile["listenerPath"] == DEFAULT_RUNTIME_AGENT_SOCKET  # root's alone: the host's runtime hands over there
    assert profile["listenerMetadata"] == ""
    notified = set()
    for rule in profile["syscalls"]:
        if rule["action"] != "SCMP_ACT_NOTIFY":
            continue
        assert rule["names"] == ["ioctl"]
        (arg,) = rule["args"]
        assert arg["index"] == 1 and arg["op"] == "SCMP_CMP_MASKED_EQ" and arg["value"] == 0xFFFF
        notified.add(arg["valueTwo"])
    assert notified == {(ord("F") << 8) | e for e in NOTIFIED}


def test_ledger_reserves_and_releases() -> None:
    ledger = SessionLedger(lambda tenant, kind: 1 if kind is SessionKind.NVDEC else None)

    def ev(action: EventAction) -> SessionEvent:
        return SessionEvent("t", action, SessionKind.NVDEC, NVDEC, 1, 5, 0)

    assert ledger.decide("t", SessionKind.NVDEC, NVDEC)
    assert not ledger.decide("t", SessionKind.NVDEC, NVDEC)  # the reservation counts
    ledger.on_event(ev(EventAction.ABORTED))
    assert ledger.decide("t", SessionKind.NVDEC, NVDEC)
    ledger.on_event(ev(EventAction.ADMITTED))
    assert ledger.live("t") == {SessionKind.NVDEC: 1}
    assert not ledger.decide("t", SessionKind.NVDEC, NVDEC)
    assert ledger.decide("u", SessionKind.NVDEC, NVDEC)  # another tenant has its own count
    ledger.on_event(ev(EventAction.FREED))
    assert ledger.live("t") == {}
    assert ledger.decide("t", SessionKind.GRAPHICS, GRAPHICS)  # uncapped kind
