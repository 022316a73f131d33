"""The fenced code blocks of README.md and docs/, as the doc tests read them.

The convention (docs/contributing-docs.md): every block's info string says what it is —
``LANG [norun=REASON] [title=PATH]``:

- ``sh``: run with bash (``set -euo pipefail``) in the page's project dir, in page order;
- ``python``: run with the repository's Python, each block a fresh process, in the same dir;
- ``yaml title=PATH``: written to PATH in the project dir, then ``envbuild validate``;
  ``yaml`` without a title: parsed; ``json``: parsed;
- ``text``: shown, never run (output samples, diagrams, pseudo-code);
- ``norun=REASON`` on ``sh``/``python``/``yaml``/``dockerfile``: shown, not run, with the
  reason in one word (``dockerfile`` blocks always need one: no dockerd in the doc test).

A block with no language, an unknown one, an unknown attribute or a ``title=`` anywhere but on
``yaml`` is an error (tests/unit/test_docs_blocks.py). Pages under ``docs/notes/`` are lab
notebooks kept verbatim as history, not documentation: they are not read.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Languages a block may have; what the doc test does with each is in the module docstring.
RUN = {"sh", "python"}
CHECKED = {"yaml", "json"}
SHOWN = {"text", "dockerfile"}
LANGS = RUN | CHECKED | SHOWN
ATTRS = {"norun", "title"}

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int            # 1-based line of the opening fence
    lang: str
    attrs: dict[str, str]
    text: str
    problem: str = ""    # why the info string is not valid ("" when it is)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def runs(self) -> bool:
        return not self.problem and self.lang in RUN | CHECKED and "norun" not in self.attrs


def pages() -> list[Path]:
    """README.md and every page under docs/ but the lab notebooks in docs/notes/."""
    docs = sorted(p for p in (REPO / "docs").rglob("*.md")
                  if "notes" not in p.relative_to(REPO / "docs").parts[:-1])
    return [REPO / "README.md", *docs]


def _info(info: str) -> tuple[str, dict[str, str], str]:
    words = info.split()
    if not words:
        return "", {}, "no language: tag it (sh, python, yaml, json, text, … see docs/contributing-docs.md)"
    lang, attrs = words[0], {}
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if key not in ATTRS or not eq or not value:
            return lang, attrs, f"unknown attribute {word!r} (known: norun=REASON, title=PATH)"
        attrs[key] = value
    if lang not in LANGS:
        return lang, attrs, f"unknown language {lang!r} (known: {', '.join(sorted(LANGS))})"
    if "title" in attrs and lang != "yaml":
        return lang, attrs, "title=PATH is for yaml blocks only"
    if "title" in attrs and (attrs["title"].startswith("/") or ".." in attrs["title"].split("/")):
        return lang, attrs, "title=PATH must be relative, inside the project dir"
    if lang == "dockerfile" and "norun" not in attrs:
        return lang, attrs, "a dockerfile block needs norun=REASON (the doc test has no dockerd)"
    return lang, attrs, ""


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks in order; an unclosed fence is a block with a problem."""
    out: list[Block] = []
    lines = page.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m["fence"], i
        lang, attrs, problem = _info(m["info"])
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and not lines[i].strip().strip(fence[0])):
            body.append(lines[i][len(m["indent"]):] if lines[i].startswith(m["indent"]) else lines[i])
            i += 1
        if i >= len(lines):
            problem = problem or "fence never closed"
        out.append(Block(page, start + 1, lang, attrs, "\n".join(body) + "\n", problem))
        i += 1
    return out
