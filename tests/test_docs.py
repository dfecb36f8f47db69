"""The README and docs/ hold together: every relative link resolves (the file, and the
heading a ``#anchor`` names), every ``docs/....md`` a page mentions exists, and no page
points outside the repository (``../shared/...``) or at an issue number ("issue 36"),
which mean nothing to a reader of a clone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")])

# [text](target) or [text](target "title"); images too. Targets with a scheme are skipped.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# A repository path to a doc written as text or code, e.g. `docs/guide/fp8.md`.
DOC_MENTION = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md)\b")
ISSUE = re.compile(r"\bissue[ -]?#?\d+|\bissues #?\d+(?:(?:, | and |/)#?\d+)+"
                   r"|(?<![\w&/])#\d+\b", re.IGNORECASE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _rel(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline markup and punctuation dropped
    (hyphens and underscores kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link: its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file (GitHub numbers repeats: -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not SCHEME.match(t)]


def broken_links(path: Path, root: Path = REPO_ROOT) -> list[str]:
    """The relative links of one page that do not resolve inside ``root``, each with the
    reason."""
    bad = []
    for target in links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        root = root.resolve()
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif not dest.is_relative_to(root):
            bad.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return bad


def test_the_checks_see_what_they_check(tmp_path):
    """The link and anchor parsing on a page made for it: a good link, a missing file, a
    missing anchor, a link with a title, a web link (skipped), one inside a code fence
    (skipped)."""
    (tmp_path / "other.md").write_text("# A `code` title, with punctuation!\n## Twice\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-code-title-with-punctuation) [2](other.md#twice-1)\n"
                    "[gone](missing.md) [anchor](other.md#nope) [t](other.md \"title\")\n"
                    "[web](https://example.com/x.md) ![img](other.md)\n"
                    "```\n[in a fence](missing-too.md)\n```\n")
    assert links(page) == ["other.md#a-code-title-with-punctuation", "other.md#twice-1",
                           "missing.md", "other.md#nope", "other.md", "other.md"]
    assert [b.split(":")[0] for b in broken_links(page, tmp_path)] == ["missing.md",
                                                                       "other.md#nope"]
    assert broken_links(page, tmp_path / "elsewhere")[0] == ("other.md#a-code-title-with-"
                                                             "punctuation: outside the "
                                                             "repository")
    assert ISSUE.findall("see issue 36, Issue #4, issue-5 and #12") == [
        "issue 36", "Issue #4", "issue-5", "#12"]
    assert ISSUE.findall("issues 36 and 38, issues 6/14") == ["issues 36 and 38", "issues 6/14"]
    assert ISSUE.findall("not #define, page 36, &#39;, item-36 or: each thread issues 32 "
                         "loads") == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_docs_mentioned_by_path_exist(page):
    text = page.read_text(encoding="utf-8")
    missing = sorted({m for m in DOC_MENTION.findall(text) if not (REPO_ROOT / m).exists()})
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_page_points_outside_the_repository_or_at_issue_numbers(page):
    text = page.read_text(encoding="utf-8")
    assert "../shared" not in text
    assert ISSUE.findall(text) == []
