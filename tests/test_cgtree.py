"""folders_below: a cgroup tree walked without recursion, links or more than its bound (real directories)."""

from __future__ import annotations

import os
from pathlib import Path

from unisched.enforce.cgtree import folders_below


def test_a_chain_deeper_than_python_s_recursion_is_walked_in_order_and_within_its_bound(tmp_path: Path) -> None:
    deep = tmp_path / "top"
    path = str(deep)
    os.mkdir(path)
    for _ in range(1100):  # a delegated tenant's mkdir -p a/a/a/...: os.walk on 3.11 raised RecursionError
        path += "/a"
        os.mkdir(path)  # (os.makedirs would recurse itself)
    try:
        got = list(folders_below(str(deep), 10_000))
        assert len(got) == 1101 and got[0] == str(deep) and got[-1] == path
        assert len(list(folders_below(str(deep), 7))) == 7
    finally:  # bottom up, without recursion (pytest's own clean-up of tmp_path would recurse too deep)
        while path != str(tmp_path):
            os.rmdir(path)
            path = os.path.dirname(path)


def test_parents_come_first_siblings_in_name_order_and_links_are_not_followed(tmp_path: Path) -> None:
    for d in ("t/b/x", "t/a", "elsewhere/secret"):
        (tmp_path / d).mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere", tmp_path / "t" / "link")
    got = [str(Path(f).relative_to(tmp_path)) for f in folders_below(str(tmp_path / "t"), 100)]
    assert got == ["t", "t/a", "t/b", "t/b/x"]
    assert list(folders_below(str(tmp_path / "gone"), 100)) == [str(tmp_path / "gone")]  # skipped, not raised
