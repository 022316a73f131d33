"""Every fenced block of README.md and docs/ says what it is (tests/docblocks.py's convention,
docs/contributing-docs.md); the pages link only to files of this repository; the README stays
a first document (at most 250 lines); docs/benchmarks.md names every benchmark. The blocks
themselves run in tests/integration/test_docs.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.docblocks import REPO, blocks, pages


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return page


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_block_is_tagged(page):
    problems = [f"{b.where}: {b.problem}" for b in blocks(page) if b.problem]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_yaml_and_json_blocks_parse(page):
    for b in blocks(page):
        if b.problem or "norun" in b.attrs:
            continue
        if b.lang == "yaml":
            assert yaml.safe_load(b.text) is not None, b.where
        elif b.lang == "json":
            json.loads(b.text)


@pytest.mark.parametrize("text, problem", [
    ("```\necho hi\n```\n", "no language"),
    ("```bash\necho hi\n```\n", "unknown language 'bash'"),
    ("```sh skip\necho hi\n```\n", "unknown attribute 'skip'"),
    ("```sh title=x.sh\necho hi\n```\n", "title=PATH is for yaml blocks only"),
    ("```yaml title=../x.yaml\na: 1\n```\n", "inside the project dir"),
    ("```dockerfile\nFROM scratch\n```\n", "needs norun=REASON"),
    ("```sh\necho never closed\n", "fence never closed"),
])
def test_bad_blocks_are_refused(tmp_path, text, problem):
    (b,) = blocks(_page(tmp_path, text))
    assert problem in b.problem


def test_good_blocks_are_read(tmp_path):
    page = _page(tmp_path, "x\n\n````text\n```sh\n````\n\n  ```yaml title=envdefs/a.yaml\n"
                           "  a: 1\n  ```\n```sh norun=cluster\nray start\n```\n")
    text, yml, norun = blocks(page)
    assert (text.lang, text.text, text.runs) == ("text", "```sh\n", False)
    assert (yml.lang, yml.attrs, yml.text, yml.runs) == ("yaml", {"title": "envdefs/a.yaml"}, "a: 1\n", True)
    assert (norun.attrs, norun.runs, norun.line) == ({"norun": "cluster"}, False, 10)


def test_the_lab_notebooks_are_not_pages():
    assert REPO / "docs/notes/lazy-loading-log.md" not in pages()
    assert REPO / "docs/sdk.md" in pages() and REPO / "README.md" in pages()


def test_readme_is_a_first_document():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move reference material into docs/"


_LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s]+)\)")


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_stay_in_the_repository(page):
    text = page.read_text(encoding="utf-8")
    bad = []
    for target in _LINK.findall(text):
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.is_relative_to(REPO) or not path.exists():
            bad.append(target)
    assert "../shared" not in text and not bad, f"{page.relative_to(REPO)}: {bad}"


def test_benchmarks_page_names_every_benchmark():
    text = (REPO / "docs/benchmarks.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((REPO / "benchmarks").glob("*.py")) if f"`{p.name}`" not in text]
    assert not missing, f"docs/benchmarks.md does not name {missing}"
