"""Adopt takes one spelling per cgroup and refuses cgroups whose freezing would stop the daemon or that another
tenant already governs: the parent of every tenant, the daemon's own cgroup and its ancestors, and any cgroup
equal to or nested with a governed one. Real daemon, real cgroups (root)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon, needs_freezer, wait_until

from unisched.enforce.cgroups import CgroupError, adopt_refusal, canonical_cgroup

pytestmark = [needs_freezer, pytest.mark.root]


@pytest.fixture
def outside(daemon: Daemon, tenant_prefix: str) -> Iterator[Path]:
    """A cgroup beside the daemon's subtree (as a container's is), removed afterwards with anything below it."""
    root = Path(daemon.status()["cgroup_root"])
    top = root / f"{tenant_prefix}ctr"
    top.mkdir()
    yield top
    if daemon.proc.poll() is None:
        daemon.stop()  # thaws what it governed
    for d in [*sorted(top.rglob("*"), key=lambda p: -len(p.parts)), top]:
        if d.is_dir():
            _thaw(d)
            with contextlib.suppress(OSError):
                d.rmdir()


def _thaw(d: Path) -> None:
    for name, value in (("cgroup.freeze", "0"), ("freezer.state", "THAWED")):
        if (d / name).exists():
            (d / name).write_text(value)


def adopt(d: Daemon, tenant: str, cgroup: str) -> tuple[int, str]:
    out = d.cli("adopt", "--tenant", tenant, "--cgroup", cgroup)
    return out.returncode, out.stderr


def test_two_spellings_of_one_cgroup_are_one_tenant(daemon: Daemon, tenant_prefix: str, outside: Path) -> None:
    rc, err = adopt(daemon, f"{tenant_prefix}a", f"/{outside.name}")
    assert rc == 0, err
    for spelling in (f"//{outside.name}", f"{outside.name}/", f"/{outside.name}//", str(outside)):
        rc, err = adopt(daemon, f"{tenant_prefix}b", spelling)
        assert rc == 1 and f"is already tenant '{tenant_prefix}a'" in err, (spelling, err)
    assert [t["cgroup"] for t in daemon.tenants()] == [f"/{outside.name}"]


def test_the_parent_of_every_tenant_is_refused(daemon: Daemon, tenant_prefix: str) -> None:
    sub = daemon.subtree
    for spelling in (f"/{sub}", sub, f"//{sub}/", "/"):
        rc, err = adopt(daemon, f"{tenant_prefix}all", spelling)
        assert rc == 1 and ("holds every tenant" in err or "must name a cgroup below" in err), (spelling, err)
    assert daemon.tenants() == []


def test_a_cgroup_nested_with_a_governed_one_is_refused(daemon: Daemon, tenant_prefix: str, outside: Path) -> None:
    (outside / "inner").mkdir()
    run = f"{tenant_prefix}run"
    daemon.cli("run", "--tenant", run, "--keep", "--", "true", check=True)
    assert adopt(daemon, f"{tenant_prefix}in", f"/{outside.name}/inner")[0] == 0
    rc, err = adopt(daemon, f"{tenant_prefix}up", f"/{outside.name}")  # the parent of a governed cgroup
    assert rc == 1 and "is nested with tenant" in err, err
    (outside / "inner" / "deeper").mkdir()
    rc, err = adopt(daemon, f"{tenant_prefix}down", f"/{outside.name}/inner/deeper")  # a child of one
    assert rc == 1 and "is nested with tenant" in err, err
    rc, err = adopt(daemon, f"{tenant_prefix}dup", daemon.cgroup(run))  # a run tenant's own cgroup
    assert rc == 1 and f"is already tenant '{run}'" in err, err
    assert sorted(t["name"] for t in daemon.tenants()) == sorted([run, f"{tenant_prefix}in"])


def test_the_daemons_own_cgroup_and_its_ancestors_are_refused(daemon: Daemon, tenant_prefix: str,
                                                              outside: Path) -> None:
    """Adopting a cgroup that holds the daemon let it freeze itself: status timed out until someone thawed it."""
    home = outside / "daemon"
    home.mkdir()
    root = Path(daemon.status()["cgroup_root"])
    (home / "cgroup.procs").write_text(str(daemon.proc.pid))
    try:
        for cgroup in (f"/{outside.name}/daemon", f"/{outside.name}"):
            rc, err = adopt(daemon, f"{tenant_prefix}self", cgroup)
            assert rc == 1 and "contains the daemon itself" in err, (cgroup, err)
        assert daemon.tenants() == []
    finally:
        _thaw(home)
        _thaw(outside)
        (root / "cgroup.procs").write_text(str(daemon.proc.pid))
        wait_until(lambda: not (home / "cgroup.procs").read_text().split(), 10, "the daemon to leave the test cgroup")


# --- the rules alone --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["", "/", ".", "a/./b", "a/../b", "../etc", "a\0b", "/sys/fs/cgroup", "//"])
def test_paths_that_are_not_one_cgroup_below_the_mount_are_refused(path: str) -> None:
    with pytest.raises(CgroupError):
        canonical_cgroup(path, Path("/sys/fs/cgroup"))


def test_one_spelling_per_cgroup() -> None:
    mount = Path("/sys/fs/cgroup")
    assert {canonical_cgroup(p, mount) for p in ("//a//b/", "a/b", "/a/b", "/sys/fs/cgroup/a/b")} == {"/a/b"}


def test_refusals() -> None:
    governed = [("t", "/pods/p1")]
    assert adopt_refusal("/pods/p2", "/unisched", "/system.slice/unisched.service", governed) is None
    assert "holds every tenant" in str(adopt_refusal("/unisched", "/unisched", None, ()))
    assert "contains the daemon" in str(adopt_refusal("/system.slice", "/unisched", "/system.slice/u.service", ()))
    assert "nested with" in str(adopt_refusal("/pods", "/unisched", None, governed))
    assert "nested with" in str(adopt_refusal("/pods/p1/c", "/unisched", None, governed))
    assert "already tenant 't'" in str(adopt_refusal("/pods/p1", "/unisched", None, governed))
