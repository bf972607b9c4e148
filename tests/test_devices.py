"""Device admission (cgroup v2 eBPF): the program's logic everywhere (a small eBPF interpreter checks the
assembled program against the plain-Python rule), and, as root, the real kernel: a child process moved into a
test cgroup opens mknod'ed device nodes and we look at the errno it gets."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import child_env, wait_until

from unisched.enforce import bpf, devices
from unisched.enforce.bpf import (
    BPF_CGROUP_DEVICE,
    BPF_DEVCG_DEV_BLOCK,
    BPF_DEVCG_DEV_CHAR,
    PROG_NAME,
    DeviceAdmissionError,
    bpf_prog_attach,
    bpf_prog_detach,
    bpf_prog_get_fd_by_id,
    bpf_prog_info,
    bpf_prog_load,
    bpf_prog_query,
)
from unisched.enforce.device_program import assemble_device_program, device_allowed
from unisched.enforce.devices import (
    BpfDeviceAdmission,
    FakeDeviceAdmission,
    cgroup2_mount,
    device_admission_unavailable_reason,
    nvidia_uvm_majors,
)

REASON = device_admission_unavailable_reason()
needs_bpf = pytest.mark.skipif(REASON is not None, reason=f"real device admission: {REASON}")
root = pytest.mark.root

# --- the program's logic, checked against the rule (no root needed) ------------------------------------------

MASK64 = (1 << 64) - 1


def run_program(code: bytes, access_type: int, major: int, minor: int) -> int:
    """Interpret the subset of eBPF that assemble_device_program emits, on one struct bpf_cgroup_dev_ctx."""
    ctx = struct.pack("<III", access_type, major, minor)
    insns = [struct.unpack_from("<BBhi", code, i) for i in range(0, len(code), 8)]
    regs = [0] * 11
    pc = 0
    while True:
        op, dst_src, off, imm = insns[pc]
        dst, src = dst_src & 0xF, dst_src >> 4
        pc += 1
        k = imm & MASK64
        if op == 0x61:  # ldxw dst, [r1 + off]
            assert src == 1, "loads only from the context"
            regs[dst] = struct.unpack_from("<I", ctx, off)[0]
        elif op == 0x57:
            regs[dst] &= k
        elif op == 0xB7:
            regs[dst] = k
        elif op == 0x05:
            assert off >= 0
            pc += off
        elif op in (0x15, 0x55):
            assert off >= 0, "forward jumps only"
            if (regs[dst] == k) == (op == 0x15):
                pc += off
        elif op == 0x95:
            assert regs[0] in (0, 1)
            return regs[0]
        else:
            raise AssertionError(f"unexpected opcode {op:#x}")


@pytest.mark.parametrize("gpus", [None, frozenset(), frozenset({0}), frozenset({1, 5, 247}), frozenset(range(8))])
def test_program_answers_like_the_rule(gpus: frozenset[int] | None) -> None:
    uvm = (510, 511)
    code = assemble_device_program(gpus, uvm)
    for dev_type in (BPF_DEVCG_DEV_BLOCK, BPF_DEVCG_DEV_CHAR):
        for access in (1, 2, 4, 6, 7):
            for major in (1, 194, 195, 196, 510, 511, 512):
                for minor in [*range(260), 0xFFFFF]:
                    got = run_program(code, (access << 16) | dev_type, major, minor)
                    want = device_allowed(gpus, dev_type, major, minor, uvm)
                    assert got == int(want), (gpus, dev_type, access, major, minor)


def test_rule_table() -> None:
    c = BPF_DEVCG_DEV_CHAR
    g0 = frozenset({0})
    assert device_allowed(g0, c, 195, 0) and not device_allowed(g0, c, 195, 1)
    assert device_allowed(g0, c, 195, 255) and device_allowed(g0, c, 195, 254)
    assert not device_allowed(g0, c, 195, 250), "unknown NVIDIA minors fail closed"
    assert not device_allowed(frozenset(), c, 195, 255) and not device_allowed(frozenset(), c, 510, 0, (510,))
    assert device_allowed(g0, c, 510, 0, (510,)) and device_allowed(None, c, 195, 7)
    assert device_allowed(frozenset(), c, 1, 3) and device_allowed(frozenset(), BPF_DEVCG_DEV_BLOCK, 195, 1)


@pytest.mark.parametrize("bad", [248, -1, 255])
def test_gpu_index_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError, match=r"0\.\.247"):
        assemble_device_program(frozenset({bad}))
    with pytest.raises(ValueError):
        FakeDeviceAdmission().admit(Path("/x"), frozenset({bad}))


def test_nvidia_uvm_majors_from_proc_devices(tmp_path: Path) -> None:
    p = tmp_path / "devices"
    p.write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n234 nvidia-uvm\n235 nvidia-uvm-tools\n"
                 "\nBlock devices:\n  7 loop\n236 nvidia-uvm\n")
    assert nvidia_uvm_majors(p) == (234, 235)
    p.write_text("Character devices:\n  1 mem\n\nBlock devices:\n  7 loop\n")
    assert nvidia_uvm_majors(p) == ()
    assert nvidia_uvm_majors(tmp_path / "missing") == ()


def test_cgroup2_mount_from_mounts(tmp_path: Path) -> None:
    p = tmp_path / "mounts"
    p.write_text("cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n")
    assert cgroup2_mount(p) == Path("/sys/fs/cgroup/unified")
    p.write_text("cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n")
    assert cgroup2_mount(p) == Path("/sys/fs/cgroup")
    p.write_text("proc /proc proc rw 0 0\n")
    assert cgroup2_mount(p) is None


def test_unavailable_reason_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("unisched.enforce.devices.os.geteuid", lambda: 1000)
    assert "needs root" in (device_admission_unavailable_reason() or "")


def test_fake_records_and_answers() -> None:
    fake = FakeDeviceAdmission(uvm_majors=(510,))
    a, b = Path("/fake/a"), Path("/fake/b")
    fake.admit(a, frozenset({0}))
    fake.admit(b, frozenset())
    assert fake.allows(a, 195, 0) and not fake.allows(a, 195, 1) and fake.allows(a, 510, 0)
    assert not fake.allows(b, 195, 255) and not fake.allows(b, 510, 0) and fake.allows(b, 1, 3)
    assert fake.describe(a) == "fake device filter: GPU 0" and fake.describe(Path("/fake/c")) is None
    fake.revoke(b)
    assert fake.allows(b, 195, 1) and fake.revokes == [b] and fake.admits == [(a, frozenset({0})), (b, frozenset())]
    fake.fail_next = DeviceAdmissionError("bpf(BPF_PROG_ATTACH) failed: EPERM", errno.EPERM)
    with pytest.raises(DeviceAdmissionError):
        fake.admit(a, None)
    fake.admit(a, None)
    assert fake.current[a] is None
    fake.close()
    assert fake.closed


# --- the real kernel (root) -------------------------------------------------------------------------------

PROBE = r"""
import errno, json, os, sys
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
out = {"cgroup": open("/proc/self/cgroup").read()}
for name, path in json.loads(sys.argv[2]).items():
    try:
        os.close(os.open(path, os.O_RDWR))
        out[name] = "ok"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out))
"""
# the device check passed: the open then fails with no driver behind major 195 (here), or succeeds (GPU machine)
ALLOWED_NVIDIA = ("ENXIO", "ENODEV", "ok")


def _detach_everything(cg: Path) -> None:
    fd = os.open(cg, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for prog_id in bpf_prog_query(fd):
            with contextlib.suppress(DeviceAdmissionError):
                pfd = bpf_prog_get_fd_by_id(prog_id)
                try:
                    bpf_prog_detach(fd, pfd)
                finally:
                    os.close(pfd)
    finally:
        os.close(fd)


@pytest.fixture
def cgroup() -> Iterator[Path]:
    mount = cgroup2_mount()
    assert mount is not None
    cg = mount / f"unisched-devtest-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        yield cg
    finally:
        for pid in (cg / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        wait_until(lambda: not (cg / "cgroup.procs").read_text().split(), 10, f"{cg} to empty")
        _detach_everything(cg)
        cg.rmdir()


@pytest.fixture
def nodes(tmp_path: Path) -> dict[str, str]:
    d = tmp_path / "dev"
    d.mkdir()
    spec = {"nvidia0": (195, 0), "nvidia1": (195, 1), "nvidiactl": (195, 255), "null": (1, 3), "uvm": (511, 0)}
    out = {}
    for name, (major, minor) in spec.items():
        p = d / name
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        out[name] = str(p)
    try:
        os.close(os.open(out["null"], os.O_RDWR))
    except OSError as e:
        pytest.skip(f"cannot open a device node under {d} ({e.strerror}): is the temp dir mounted nodev?")
    return out


@pytest.fixture
def proc_devices(tmp_path: Path) -> Path:
    """A /proc/devices where major 511 (unused on this host) is nvidia-uvm."""
    assert not any(line.split()[:1] == ["511"] for line in Path("/proc/devices").read_text().splitlines())
    p = tmp_path / "proc-devices"
    p.write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n511 nvidia-uvm\n\nBlock devices:\n  7 loop\n")
    return p


def probe(cg: Path, nodes: dict[str, str]) -> dict[str, str]:
    """Open every node from a child process inside the cgroup; name -> "ok" or the errno name."""
    proc = subprocess.run([sys.executable, "-c", PROBE, str(cg / "cgroup.procs"), json.dumps(nodes)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, str] = json.loads(proc.stdout)
    assert f"0::/{cg.name}\n" in out.pop("cgroup"), "the probe did not run inside the test cgroup"
    return out


def assert_access(got: dict[str, str], denied: set[str]) -> None:
    for name, result in got.items():
        if name in denied:
            assert result == "EPERM", f"{name}: expected EPERM (denied), got {result}; all: {got}"
        elif name == "null":
            assert result == "ok", f"null must open: {got}"
        else:
            assert result in ALLOWED_NVIDIA, f"{name}: expected the device check to pass, got {result}; all: {got}"


def ours(cg: Path) -> list[int]:
    fd = os.open(cg, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ids = []
        for prog_id in bpf_prog_query(fd):
            pfd = bpf_prog_get_fd_by_id(prog_id)
            try:
                if bpf_prog_info(pfd).name == PROG_NAME:
                    ids.append(prog_id)
            finally:
                os.close(pfd)
        return ids
    finally:
        os.close(fd)


def deny_null_program() -> int:
    """Someone else's program (a container runtime's, say): denies char 1:3, allows the rest."""
    insns = [
        (0x61, 0x12, 0, 0),  # r2 = ctx->access_type
        (0x57, 0x02, 0, 0xFFFF),  # r2 &= 0xffff
        (0x55, 0x02, 6, BPF_DEVCG_DEV_CHAR),  # not char -> allow
        (0x61, 0x13, 4, 0),  # r3 = ctx->major
        (0x55, 0x03, 4, 1),  # major != 1 -> allow
        (0x61, 0x14, 8, 0),  # r4 = ctx->minor
        (0x55, 0x04, 2, 3),  # minor != 3 -> allow
        (0xB7, 0x00, 0, 0),  # r0 = 0 (deny)
        (0x95, 0x00, 0, 0),
        (0xB7, 0x00, 0, 1),  # allow: r0 = 1
        (0x95, 0x00, 0, 0),
    ]
    return bpf_prog_load(b"".join(struct.pack("<BBhi", *i) for i in insns), name="foreign_nonull")


@root
@needs_bpf
def test_admit_gpu0_then_none_then_all_then_revoke(cgroup: Path, nodes: dict[str, str], proc_devices: Path) -> None:
    adm = BpfDeviceAdmission(proc_devices)
    try:
        assert_access(probe(cgroup, nodes), denied=set())
        assert adm.describe(cgroup) is None

        adm.admit(cgroup, frozenset({0}))
        assert_access(probe(cgroup, nodes), denied={"nvidia1"})
        first = ours(cgroup)
        assert len(first) == 1
        assert adm.describe(cgroup) == f"eBPF device filter {PROG_NAME} id {first[0]}: GPU 0; nvidia-uvm majors 511"

        adm.admit(cgroup, frozenset())
        assert_access(probe(cgroup, nodes), denied={"nvidia0", "nvidia1", "nvidiactl", "uvm"})
        second = ours(cgroup)
        assert len(second) == 1 and second != first, "re-admitting replaces our program, never stacks a second"
        assert "no GPU" in (adm.describe(cgroup) or "")

        adm.admit(cgroup, None)
        assert_access(probe(cgroup, nodes), denied=set())
        assert len(ours(cgroup)) == 1 and "all GPUs" in (adm.describe(cgroup) or "")

        adm.admit(cgroup, frozenset({1}))
        assert_access(probe(cgroup, nodes), denied={"nvidia0"})

        adm.revoke(cgroup)
        assert_access(probe(cgroup, nodes), denied=set())
        assert ours(cgroup) == [] and adm.describe(cgroup) is None
        adm.revoke(cgroup)  # idempotent
    finally:
        adm.close()


@root
@needs_bpf
def test_foreign_program_keeps_applying_alongside_ours(cgroup: Path, nodes: dict[str, str], proc_devices: Path) -> None:
    foreign = deny_null_program()
    cg_fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    adm = BpfDeviceAdmission(proc_devices)
    try:
        bpf_prog_attach(cg_fd, foreign)  # BPF_F_ALLOW_MULTI, as runc and systemd attach theirs
        got = probe(cgroup, nodes)
        assert got["null"] == "EPERM" and got["nvidia1"] in ALLOWED_NVIDIA

        adm.admit(cgroup, frozenset({0}))
        got = probe(cgroup, nodes)
        assert got["null"] == "EPERM", f"the other program must still deny /dev/null: {got}"
        assert got["nvidia1"] == "EPERM" and got["nvidia0"] in ALLOWED_NVIDIA and got["nvidiactl"] in ALLOWED_NVIDIA

        adm.admit(cgroup, frozenset({1}))  # replacing ours leaves theirs alone
        got = probe(cgroup, nodes)
        assert got["null"] == "EPERM" and got["nvidia0"] == "EPERM" and got["nvidia1"] in ALLOWED_NVIDIA

        adm.revoke(cgroup)
        got = probe(cgroup, nodes)
        assert got["null"] == "EPERM" and got["nvidia0"] in ALLOWED_NVIDIA
        foreign_id = bpf_prog_info(foreign).prog_id
        assert bpf_prog_query(cg_fd) == [foreign_id], "revoke detaches only our program"
    finally:
        adm.close()
        with contextlib.suppress(DeviceAdmissionError):
            bpf_prog_detach(cg_fd, foreign)
        os.close(cg_fd)
        os.close(foreign)


@root
@needs_bpf
def test_restarted_daemon_finds_replaces_and_revokes(cgroup: Path, nodes: dict[str, str], proc_devices: Path) -> None:
    # the first daemon is another process: it attaches, then exits without revoking
    first = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; from unisched.enforce.devices import BpfDeviceAdmission; "
         "BpfDeviceAdmission(Path(sys.argv[2])).admit(Path(sys.argv[1]), frozenset({0}))", str(cgroup), str(proc_devices)],
        capture_output=True, text=True, timeout=60, env=child_env(),
    )
    assert first.returncode == 0, first.stderr
    assert_access(probe(cgroup, nodes), denied={"nvidia1"})
    [old_id] = ours(cgroup)

    second = BpfDeviceAdmission(proc_devices)
    try:
        text = second.describe(cgroup) or ""
        assert f"id {old_id}" in text and "earlier unisched" in text
        second.admit(cgroup, frozenset({1}))
        [new_id] = ours(cgroup)
        assert new_id != old_id
        assert_access(probe(cgroup, nodes), denied={"nvidia0"})
    finally:
        second.close()

    third = BpfDeviceAdmission(proc_devices)
    try:
        third.revoke(cgroup)
        assert ours(cgroup) == []
        assert_access(probe(cgroup, nodes), denied=set())
    finally:
        third.close()


@root
@needs_bpf
def test_program_attached_without_allow_multi_gives_a_clear_error(cgroup: Path, proc_devices: Path) -> None:
    foreign = deny_null_program()
    cg_fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    adm = BpfDeviceAdmission(proc_devices)
    try:
        bpf_prog_attach(cg_fd, foreign, flags=0)  # exclusive, as old container runtimes did
        with pytest.raises(DeviceAdmissionError) as info:
            adm.admit(cgroup, frozenset({0}))
        assert info.value.errno == errno.EPERM
        msg = str(info.value)
        assert "bpf(BPF_PROG_ATTACH)" in msg and "EPERM" in msg and "BPF_F_ALLOW_MULTI" in msg and str(cgroup) in msg
        assert bpf_prog_query(cg_fd) == [bpf_prog_info(foreign).prog_id], "the failed admit left nothing behind"
    finally:
        adm.close()
        with contextlib.suppress(DeviceAdmissionError):
            bpf_prog_detach(cg_fd, foreign, BPF_CGROUP_DEVICE)
        os.close(cg_fd)
        os.close(foreign)


@root
@needs_bpf
def test_missing_cgroup_and_non_cgroup_directory(tmp_path: Path, proc_devices: Path) -> None:
    adm = BpfDeviceAdmission(proc_devices)
    try:
        gone = tmp_path / "no-such-cgroup"
        with pytest.raises(DeviceAdmissionError, match="no such cgroup") as info:
            adm.admit(gone, frozenset({0}))
        assert info.value.errno == errno.ENOENT
        adm.revoke(gone)
        assert adm.describe(gone) is None
        with pytest.raises(DeviceAdmissionError, match="not a cgroup v2 directory") as info:
            adm.admit(tmp_path, frozenset({0}))
        assert info.value.errno == errno.EBADF
    finally:
        adm.close()


@root
@needs_bpf
@pytest.mark.parametrize("kernel_has_replace", [True, False], ids=["BPF_F_REPLACE", "attach-then-detach"])
def test_readmit_replaces_in_place_or_falls_back(kernel_has_replace: bool, cgroup: Path, nodes: dict[str, str],
                                                 proc_devices: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int | None]] = []
    real_attach = bpf.bpf_prog_attach

    def attach(cg_fd: int, prog_fd: int, flags: int = bpf.BPF_F_ALLOW_MULTI, replace_fd: int | None = None,
               attach_type: int = BPF_CGROUP_DEVICE, what: str = "") -> None:
        calls.append((flags, replace_fd))
        if replace_fd is not None and not kernel_has_replace:
            raise DeviceAdmissionError("bpf(BPF_PROG_ATTACH) failed: EINVAL (simulated kernel < 5.6)", errno.EINVAL)
        real_attach(cg_fd, prog_fd, flags, replace_fd, attach_type, what)

    monkeypatch.setattr(devices, "bpf_prog_attach", attach)
    adm = BpfDeviceAdmission(proc_devices)
    try:
        adm.admit(cgroup, frozenset({0}))
        adm.admit(cgroup, frozenset({1}))
        assert calls[0] == (bpf.BPF_F_ALLOW_MULTI, None)
        assert calls[1][1] is not None, "re-admitting asks for an atomic swap first"
        assert calls[2:] == ([] if kernel_has_replace else [(bpf.BPF_F_ALLOW_MULTI, None)])
        assert len(ours(cgroup)) == 1, "the old program is gone either way"
        assert_access(probe(cgroup, nodes), denied={"nvidia0"})
    finally:
        adm.revoke(cgroup)
        adm.close()
