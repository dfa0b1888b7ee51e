"""The markdown a clone carries links only to files the clone has: no relative link leaves the
repository or names a missing file, and the README does not point at the ../shared folder
that only this project's workspace has. The documentation site builds with MkDocs in strict
mode, where a broken link or anchor is an error, and its references say what the program has.
A test a document names as its proof (`tests/test_x.py::test_y`) is there to run."""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.tools import files_git_lists

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
_spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks" / "reference.py")
hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hooks)

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


NAMED_TEST = re.compile(r"tests/(test_\w+\.py)::(test_\w+)")


def _test_names(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_every_test_a_document_names_is_there():
    """A proof that moved or was renamed leaves its rows pointing at nothing: each one is found."""
    named = {(doc.relative_to(REPO), m[1], m[2]) for doc in markdown_files() for m in NAMED_TEST.finditer(doc.read_text())}
    assert len(named) > 50  # the docs name their proofs (a pattern that found none would pass)
    found = {f: _test_names(REPO / "tests" / f) for f in {f for _, f, _ in named}}
    missing = sorted(f"{doc}: tests/{f}::{t}" for doc, f, t in named if t not in found[f])
    assert not missing, "\n".join(missing)


def test_the_docs_are_found():
    assert {REPO / "README.md", REPO / "docs" / "facts.md"} <= set(markdown_files())


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_stay_in_the_repository_and_exist(doc):
    problems = []
    for target in relative_links(doc.read_text()):
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(REPO):
            problems.append(f"{target}: outside the repository")
        elif not path.exists() and not _generated(path):
            problems.append(f"{target}: no such file")
    assert not problems, f"{doc.relative_to(REPO)}: " + "; ".join(problems)


def _generated(path: Path) -> bool:
    """A page the site's build makes (docs/hooks/reference.py), which a checkout does not hold."""
    return path.is_relative_to(DOCS) and path.relative_to(DOCS).as_posix() in hooks.GENERATED


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


# ---------------------------------------------------------------- the site


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, not a problem
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=config.parent)


def test_the_site_builds_strict(tmp_path):
    proc = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    nav_pages = [p for p in _nav_pages(nav())]
    for page in nav_pages:
        html = "index.html" if page == "index.md" else page.removesuffix("index.md").removesuffix(".md") + "/index.html"
        assert html.replace("//", "/") in built, f"{page} was not built"
    reference = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    for key in yaml.safe_load((REPO / "Pulumi.yaml").read_text())["config"]:
        assert f'id="{key.lower()}"' in reference, f"the configuration reference has no section for {key}"
    # The pictures are Mermaid sources that the theme draws in the browser.
    assert (tmp_path / "site" / "design" / "architecture" / "index.html").read_text().count('class="mermaid"') >= 1


class _MkdocsLoader(yaml.SafeLoader):
    """mkdocs.yml names Python objects (!!python/name:...), which only MkDocs itself imports."""


_MkdocsLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


def nav() -> list:
    return yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_MkdocsLoader)["nav"]


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        for value in (item.values() if isinstance(item, dict) else [item]):
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav():
    in_nav = set(_nav_pages(nav()))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "hooks" not in p.parts}
    assert pages | hooks.GENERATED == in_nav


BROKEN = {  # a link the strict build must refuse -> what its error names
    "[gone](../aws/no-such-page.md)": "no-such-page.md",
    "[no anchor](../aws/spot.md#no-such-section)": "no-such-section",
    "[outside](../../node/contract.py)": "node/contract.py",
}


def test_broken_links_fail_the_build(tmp_path):
    """The build the test above runs catches each of these: a copy of the site, with the links broken
    (strict mode reports every warning before it stops, so one build shows all three)."""
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    for top in (*REPO.glob("*.md"), *REPO.glob("*.y*ml")):  # mkdocs.yml, README.md, Pulumi*.yaml the pages include
        shutil.copy(top, copy / top.name)
    page = copy / "docs" / "operations" / "day-2.md"
    page.write_text(page.read_text() + "".join(f"\n\nSee {link}.\n" for link in BROKEN))
    proc = mkdocs_build(copy / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    for said in BROKEN.values():
        assert [w for w in warnings if "operations/day-2.md" in w and said in w], proc.stderr
    assert len(warnings) == len(BROKEN), proc.stderr


def test_the_configuration_reference_needs_a_description_for_every_key(tmp_path):
    project = tmp_path / "Pulumi.yaml"
    project.write_text("config:\n  vpcId: {type: string, default: ''}\n  gpuKind: {type: string, description: The kind.}\n")
    with pytest.raises(ValueError, match="without a description: vpcId"):
        hooks.config_reference(project)


def documented_outputs() -> set[str]:
    page = (DOCS / "reference" / "outputs.md").read_text()
    table = page.split("## ", 1)[0]
    return set(re.findall(r"^\| `([A-Za-z]+)` \|", table, re.MULTILINE))


def test_the_outputs_page_names_exactly_what_the_program_exports():
    """Under the mocks, with prod's config (a generated key, so privateKey too) and monitoring on."""
    from tests.conftest import run_program, stack_config
    run = run_program(stack_config("prod", monitoring="true"), stack="prod")
    assert documented_outputs() == set(run.exports)
