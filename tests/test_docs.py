"""The user docs stay short, linked and self-contained: README.md and docs/.

Why: a README that grows back into a chronicle, a link to a moved page, or a picture whose source is lost are the
ways these docs rot; each is cheap to catch here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 200
"""The README is an overview: what it is, when to use it, a tour, installing, links. Detail lives in docs/."""
RESULTS_BEGIN, RESULTS_END = "<!-- results:begin -->", "<!-- results:end -->"
"""The generated at-a-glance table sits between these (bench/run.py --table writes it)."""
FIGURES = {
    "docs/figures/architecture.png": ("docs/figures/architecture.py", "README.md"),
    "docs/figures/share-over-time.png": ("docs/figures/share_timeline.py", "docs/concepts.md"),
}
"""Each committed picture: the script that makes it and the page that shows it."""

_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_SRC = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")
_WEB = ("http://", "https://", "mailto:")


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def links(text: str) -> list[str]:
    """Every link target of a markdown page (markdown links and images, HTML src/href), fenced code left out."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return _LINK.findall(prose) + _HTML_SRC.findall(prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", page.read_text(), flags=re.M)}


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Links of `page` that leave the repository, name a missing file, or a missing heading of a markdown file."""
    bad = []
    for target in links(page.read_text()):
        if target.startswith(_WEB) or target == "#":
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors(page):
                bad.append(f"{target}: no such heading")
            continue
        if path.startswith(("/", "file:", "~")):
            bad.append(f"{target}: an absolute path")
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(root.resolve()):
            bad.append(f"{target}: outside the repository")
        elif not resolved.exists():
            bad.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            bad.append(f"{target}: no such heading")
    return bad


def test_the_readme_is_an_overview_not_a_chronicle() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    prose = README.read_text()
    if RESULTS_BEGIN in prose and RESULTS_END in prose:  # the generated table may name dated result folders
        prose = prose[: prose.index(RESULTS_BEGIN)] + prose[prose.index(RESULTS_END):]
    dated = re.findall(r"\b20\d\d-\d\d-\d\d\b", prose)
    assert not dated, f"README.md tells dates of runs outside the generated table: {dated}"


def test_the_readme_has_the_generated_results_block_once() -> None:
    text = README.read_text()
    assert text.count(RESULTS_BEGIN) == 1 and text.count(RESULTS_END) == 1
    assert text.index(RESULTS_BEGIN) < text.index(RESULTS_END)
    assert "bench/run.py --table" in text  # says what fills it


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_points_into_the_repository(page: Path) -> None:
    assert not broken_links(page), broken_links(page)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_cites_files_outside_the_repository(page: Path) -> None:
    """Not even in prose or code: ../shared/ (the project's working notes) is not shipped."""
    text = page.read_text()
    assert "../shared" not in text and "/work/" not in text, page


def test_the_checker_catches_what_it_should(tmp_path: Path) -> None:
    """A missing file, a file outside the repository, an absolute path and a missing heading are caught; web links,
    existing files, headings that exist, and links inside fenced code are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Watching it\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("# Top `here`\n[a](gone.png) [b](https://example.org/x) [c](#top-here) [d](other.md#watching-it)\n"
                    "[e](../../outside.md) [f](/etc/passwd) [g](other.md#nope) [h](#nope) ![i](other.md)\n"
                    '<img src="missing.svg">\n```\n[j](not-checked.md)\n```\n')
    assert sorted(broken_links(page, tmp_path)) == sorted([
        "gone.png: no such file", "../../outside.md: outside the repository", "/etc/passwd: an absolute path",
        "other.md#nope: no such heading", "#nope: no such heading", "missing.svg: no such file"])


@pytest.mark.parametrize("figure", sorted(FIGURES))
def test_each_figure_is_committed_with_its_source_and_shown(figure: str) -> None:
    source, page = FIGURES[figure]
    assert (ROOT / figure).stat().st_size > 10_000, f"{figure} is missing or empty"
    assert (ROOT / source).is_file(), f"{figure}: its source {source} is missing"
    shown = {(ROOT / page).parent.joinpath(t.partition("#")[0]).resolve() for t in links((ROOT / page).read_text())}
    assert (ROOT / figure).resolve() in shown, f"{page} does not show {figure}"
    assert Path(figure).name in (ROOT / source).read_text(), f"{source} does not write {figure} by default"


def test_docs_index_links_every_page() -> None:
    index = ROOT / "docs" / "index.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index.read_text())}
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")) if p != index and
               p.resolve() not in linked]
    assert not missing, f"docs/index.md does not link {missing}"


def config_blocks(text: str) -> list[str]:
    """The fenced TOML blocks of a page that are daemon configs (they open a [daemon], [policy] or [[tenants]] table)."""
    blocks = re.findall(r"^\s*```toml\n(.*?)^\s*```", text, flags=re.S | re.M)
    return [b for b in blocks if re.search(r"^\[(daemon|policy)\]|^\[\[(tenants|tidal)\]\]", b, flags=re.M)]


def test_config_blocks_finds_daemon_configs_only() -> None:
    page = "```toml\n[policy]\nmode = \"shared\"\n```\n\n  ```toml\n  other-tool = true\n  ```\n"
    assert config_blocks(page) == ['[policy]\nmode = "shared"\n']


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_example_loads(page: Path, tmp_path: Path) -> None:
    """A config a user copies from the docs is one the daemon accepts (its parse and cross-key checks)."""
    from unisched.scheduler.config import ConfigError, load_config

    for i, block in enumerate(config_blocks(page.read_text())):
        f = tmp_path / f"example{i}.toml"
        f.write_text(block)
        try:
            load_config(f)
        except ConfigError as e:
            pytest.fail(f"{page.relative_to(ROOT)}, config example {i + 1}: {e}")


def test_every_tuning_the_docs_name_exists() -> None:
    """`Tuning.name` in a doc is a field of the policy's tuning: a renamed or removed one fails here, not in a reader."""
    from dataclasses import fields

    from unisched.policy.tuning import Tuning

    known = {f.name for f in fields(Tuning)}
    named = {(p.name, m) for p in pages() for m in re.findall(r"`Tuning\.(\w+)`", p.read_text())}
    assert named, "no doc names a Tuning field: the pattern is wrong"
    assert sorted(n for n in named if n[1] not in known) == []
