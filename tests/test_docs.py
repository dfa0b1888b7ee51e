"""The markdown a clone carries links only to files the clone has: no relative link leaves the
repository or names a missing file, and the README does not point at the ../shared folder
that only this project's workspace has."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.tools import files_git_lists

REPO = Path(__file__).resolve().parent.parent

# [text](target) and ![alt](target), and reference definitions "[label]: target".
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    """README.md, docs/ and bench/results/: every markdown file git tracks or would track."""
    return files_git_lists(REPO, "*.md")


def relative_links(text: str) -> list[str]:
    """Link targets that are paths, not URLs or in-page anchors; code is not markdown."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [t for t in targets if not re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*:|#|//)", t)]


def test_the_docs_are_found():
    assert {REPO / "README.md", REPO / "docs" / "facts.md"} <= set(markdown_files())


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_stay_in_the_repository_and_exist(doc):
    problems = []
    for target in relative_links(doc.read_text()):
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(REPO):
            problems.append(f"{target}: outside the repository")
        elif not path.exists():
            problems.append(f"{target}: no such file")
    assert not problems, f"{doc.relative_to(REPO)}: " + "; ".join(problems)


def test_readme_does_not_point_at_the_workspace():
    assert "../shared" not in (REPO / "README.md").read_text()


@pytest.mark.parametrize("text, links", [
    ("[a](docs/facts.md) and ![b](../x.png \"title\")", ["docs/facts.md", "../x.png"]),
    ("[a](https://example.com/x.md) [b](#section) [c](mailto:x@y)", []),
    ("[ref]: ../shared/FACTS.md\n[web]: https://github.com/moby/moby", ["../shared/FACTS.md"]),
    ("`[a](../code.md)` and\n```\n[b](../fenced.md)\n```\n[c](real.md#anchor)", ["real.md#anchor"]),
])
def test_relative_links_are_the_path_links(text, links):
    assert relative_links(text) == links
