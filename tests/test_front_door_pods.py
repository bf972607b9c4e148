"""A caller outside the daemon's pid namespace (a pod) counts against its pod's bucket, whatever uids root in it
takes, and pods together hold at most their share of the non-admin connections: root in a pod without a user
namespace keeps CAP_SETUID, and when the front door counted it by uid, one pod taking 32 uids filled every
non-admin slot and locked every other user out (real processes in real pid namespaces, a real front door)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from unisched.policy.callers import Pod
from unisched.transport.frontdoor import FrontDoor, FrontDoorLimits, StreamLimits
from unisched.transport.identity import CONTAINED_ROOT, PeerCred, peer_of

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                                   reason="needs root and unshare(1)")]

HOLD = r"""
import os, socket, sys
path, per = sys.argv[1], int(sys.argv[2])
uids = [int(u) for u in sys.argv[3:]]
r, w = os.pipe()
for uid in uids:
    if os.fork() == 0:
        os.close(r)
        os.setgroups([]); os.setgid(uid); os.setuid(uid)
        held = []
        for _ in range(per):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            held.append(s)
        os.write(w, b"x")
        os.read(0, 1)  # hold them until the test closes our stdin
        os._exit(0)
os.close(w)
got = 0
while got < len(uids):
    got += len(os.read(r, 64))
print(os.stat("/proc/self/ns/pid").st_ino, flush=True)
for _ in uids:
    os.wait()
"""
"""Root (in a pod when run under `unshare --pid --fork`) forking one process per uid, each taking that uid and
opening `per` connections, held until stdin closes; prints its pid namespace's inode once all are connected."""


class Holders:
    def __init__(self, door: FrontDoor, path: str) -> None:
        self.door = door
        self.path = path
        self.admitted = 0
        self.procs: list[asyncio.subprocess.Process] = []

    async def serve(self, conn: socket.socket, cred: PeerCred, limits: StreamLimits) -> None:
        self.admitted += 1
        try:
            await asyncio.get_running_loop().sock_recv(conn, 1)  # until the holder goes
        finally:
            conn.close()

    async def hold(self, uids: list[int], per: int, pod: bool) -> int:
        """Connect `per` times as each uid, from one new pid namespace if `pod`; once the door has decided on
        every connection, the holder's pid namespace inode."""
        before = self.admitted + self.door.refused
        argv = [sys.executable, "-c", HOLD, self.path, str(per), *map(str, uids)]
        proc = await asyncio.create_subprocess_exec(*(["unshare", "--pid", "--fork"] if pod else []), *argv,
                                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/")
        self.procs.append(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line, "holder failed"
        for _ in range(6000):  # until the door has decided on each (bounded: 60 s)
            if self.admitted + self.door.refused >= before + len(uids) * per:
                break
            await asyncio.sleep(0.01)
        return int(line)

    async def close(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.close()
            await proc.wait()
        await self.door.close()


async def _with_door(door: FrontDoor, body: object) -> None:
    sockdir = tempfile.mkdtemp(prefix="unisched-pods-")
    os.chmod(sockdir, 0o755)
    path = str(Path(sockdir) / "d.sock")
    holders = Holders(door, path)
    await door.open(path, holders.serve)
    os.chmod(path, 0o777)
    try:
        await body(holders)  # type: ignore[operator]
    finally:
        await holders.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_a_pod_counts_as_one_bucket_whatever_uids_its_root_takes() -> None:
    door = FrontDoor(limits=FrontDoorLimits(per_uid=2))

    async def body(h: Holders) -> None:
        ns = await h.hold([61001, 61002, 61003], per=1, pod=True)
        assert (h.admitted, door.refused) == (2, 1)
        assert dict(door._per_uid) == {Pod(ns): 2}

    asyncio.run(_with_door(door, body))


def test_pods_together_cannot_lock_host_users_out() -> None:
    door = FrontDoor(max_connections=16, limits=FrontDoorLimits(per_uid=2))  # 4 for admins, 6 of 12 for pods

    async def body(h: Holders) -> None:
        for pod in range(4):
            await h.hold([62000 + 10 * pod + i for i in range(3)], per=2, pod=True)
        await h.hold([61000], per=2, pod=False)
        assert door._per_uid[61000] == 2  # a host user still gets in
        assert door._contained == 6  # 3 pods' buckets full, the 4th pod refused at the pods' share

    asyncio.run(_with_door(door, body))


def test_a_full_host_bucket_does_not_refuse_a_pod_process_of_that_uid_early() -> None:
    """The early refusal judges by the raw uid only for callers in the daemon's pid namespace: a host user's full
    bucket must not lock out a pod's process that runs as the same uid (1000 in many images)."""
    door = FrontDoor(limits=FrontDoorLimits(per_uid=2))
    door._per_uid[61000] = 2
    pod = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sh", "-c", "echo up; exec sleep 60"],
                           stdout=subprocess.PIPE)
    try:
        assert pod.stdout is not None and pod.stdout.readline() == b"up\n"  # unshare's child is in its namespace
        (kid,) = map(int, Path(f"/proc/{pod.pid}/task/{pod.pid}/children").read_text().split())
        assert os.stat(f"/proc/{kid}/ns/pid").st_ino != os.stat("/proc/self/ns/pid").st_ino
        assert door._surely_refused(61000, os.getpid())
        assert not door._surely_refused(61000, kid)
    finally:
        pod.kill()
        pod.wait()
        if pod.stdout is not None:
            pod.stdout.close()


CONNECT = r"""
import ctypes, os, socket, sys
path, uid, rootless = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "rootless"
if uid >= 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
if rootless:  # that user's own user namespace, and a pid namespace in it
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x20000000) != 0:  # CLONE_NEWUSER | CLONE_NEWPID
        raise OSError(ctypes.get_errno(), "unshare")
    child = os.fork()
    if child:
        sys.exit(os.waitpid(child, 0)[1])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
print(os.stat("/proc/self/ns/pid").st_ino, flush=True)
os.read(0, 1)  # connected until the test closes our stdin
"""
"""Connects to argv[1] (as uid argv[2] unless it is negative; from a user and a pid namespace of that user's own if
argv[3] says "rootless") and prints its pid namespace's inode."""
POD = ["unshare", "--pid", "--fork"]


@pytest.mark.parametrize(("wrap", "uid", "known", "pod"), [
    ([], 61000, 61000, None),  # a host user
    (POD, 61000, 61000, "own"),  # a pod's process as the host user's uid
    (POD, 0, CONTAINED_ROOT, "own"),  # root in a pod
    ([*POD, *POD], 61000, 61000, "outer"),  # a pid namespace made inside a pod is the pod's
    (["unshare", "--user", "--map-root-user", *POD], -1, CONTAINED_ROOT, "own"),  # a pod with a user namespace
    (["rootless"], 61000, 61000, None),  # a host user's rootless container
], ids=["host", "pod", "pod-root", "nested", "pod-userns", "rootless"])
def test_peer_of_knows_a_caller_by_its_uid_here_and_its_pod(wrap: list[str], uid: int, known: int,
                                                            pod: str | None) -> None:
    """Every book kept per caller keys on PeerCred.caller: a pod's process running as uid 61000 is its pod there,
    not the host's uid 61000; a rootless container is its host user's."""
    sockdir = tempfile.mkdtemp(prefix="unisched-pods-")
    os.chmod(sockdir, 0o755)
    path = str(Path(sockdir) / "c.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(60)
    os.chmod(path, 0o777)
    rootless = wrap == ["rootless"]
    proc = subprocess.Popen([*([] if rootless else wrap), sys.executable, "-c", CONNECT, path, str(uid),
                             "rootless" if rootless else "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/")
    try:
        conn, _ = listener.accept()
        assert proc.stdout is not None
        ns = int(proc.stdout.readline())
        cred = peer_of(conn)
        conn.close()
        if cred.process is not None:
            cred.process.close()
        if pod == "outer":  # the namespace of the outer unshare's child (the inner unshare)
            (inner,) = map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
            ns = os.stat(f"/proc/{inner}/ns/pid").st_ino
        assert (cred.uid, cred.caller) == (known, known if pod is None else Pod(ns))
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        listener.close()
        shutil.rmtree(sockdir, ignore_errors=True)
