"""README.md for the person who deploys it, and the links of every page.

The word count includes code blocks and tables (everything between whitespace), so the limit is
the stricter one. Links: every relative link in README.md and docs/*.md names a file that exists,
and a ``#anchor`` on a Markdown page names one of its headings (GitHub's slugs).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trtllm_liveness._config import parse_value

pytestmark = [pytest.mark.timeout(30)]

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_WORDS = 2000
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```$", re.MULTILINE | re.DOTALL)
# Narration of how the project came to be, which a reader deploying it does not need.
_HISTORY = re.compile(r"this landing|previous landing|earlier landing|review mends|before the fix|"
                      r"before the last", re.IGNORECASE)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {slug(match) for match in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def relative_links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text())
    return [target for target in _LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def test_readme_is_under_the_word_limit_code_blocks_included() -> None:
    words = len(README.read_text().split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words (limit {MAX_README_WORDS}, code blocks included)"


def test_readme_opens_with_the_two_commands_and_the_system_packages_the_setup_adds() -> None:
    text = README.read_text()
    opening = text.split("\n## ", 1)[0]
    assert "bash scripts/demo.sh" in opening and "bash scripts/test.sh" in opening
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    packages = set(re.findall(r"apt_packages\+=\((\S+)\)", setup))
    assert packages == {"prometheus", "slurm-wlm", "munge", "nftables"}, packages
    for package in packages:
        assert f"`{package}`" in opening, f"the README's opening does not name {package}"


def test_every_liveness_value_in_the_readme_is_valid_and_sets_the_recommended_stall_timeout() -> None:
    values = re.findall(r'TRTLLM_WORKER_LIVENESS="([^"]+)"', README.read_text())
    assert len(values) >= 3
    for value in values:
        config = parse_value(value)
        assert config.exit_on_fatal and config.stall_timeout_s == 120, value


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_points_to_an_existing_file(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(target)
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(target)
    assert broken == [], f"{page.name}: broken links {broken}"


def test_the_link_check_finds_links_and_broken_ones(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Top Part\n[a](page.md#top-part) [b](missing.md) [c](https://example.com) [d](#nowhere)\n")
    assert relative_links(page) == ["page.md#top-part", "missing.md", "#nowhere"]
    assert anchors(page) == {"top-part"}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_pages_do_not_narrate_history(page: Path) -> None:
    found = _HISTORY.findall(page.read_text())
    assert found == [], f"{page.name}: {found}"
