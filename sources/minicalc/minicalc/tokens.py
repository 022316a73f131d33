"""Tokenizer: source text -> list of Token."""

from __future__ import annotations

import dataclasses
import re

from minicalc.errors import CalcError

# Longest operators first so that "**" is not read as two "*".
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<op>\*\*|//|[-+*/%(),=])
""", re.VERBOSE)


@dataclasses.dataclass(frozen=True)
class Token:
    kind: str      # "number", "name", "op", "end"
    text: str
    column: int    # 1-based


def tokenize(src: str) -> list[Token]:
    """Split ``src`` into tokens, ending with an ``end`` token."""
    tokens: list[Token] = []
    pos = 0
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if m is None:
            raise CalcError(f"unexpected character {src[pos]!r}", pos + 1)
        if m.lastgroup != "ws":
            tokens.append(Token(m.lastgroup, m.group(), pos + 1))
        pos = m.end()
    tokens.append(Token("end", "", len(src) + 1))
    return tokens
