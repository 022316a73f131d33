"""Counting functions. Pure: strings in, numbers out."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable

# A word is a run of letters or digits, optionally joined by apostrophes or hyphens
# ("don't", "well-known"); punctuation and whitespace separate words.
_WORD = re.compile(r"[^\W_]+(?:['\-][^\W_]+)*")


@dataclasses.dataclass(frozen=True)
class Stats:
    """Counts for one text, the same three numbers `wc` prints."""

    lines: int = 0
    words: int = 0
    chars: int = 0

    def __add__(self, other: Stats) -> Stats:
        return Stats(self.lines + other.lines, self.words + other.words,
                     self.chars + other.chars)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def tokenize(text: str, *, lower: bool = True) -> list[str]:
    """The words of ``text`` in order, lower-cased unless ``lower=False``."""
    words = _WORD.findall(text)
    return [w.lower() for w in words] if lower else words


def analyze(text: str) -> Stats:
    """Line, word and character counts of ``text``.

    Lines are counted like ``wc -l`` counts newlines, except that a last line without a
    trailing newline still counts as a line.
    """
    lines = text.count("\n")
    if text and not text.endswith("\n"):
        lines += 1
    return Stats(lines=lines, words=len(tokenize(text)), chars=len(text))


def merge(stats: Iterable[Stats]) -> Stats:
    """The total of several ``Stats`` (the "total" line of ``wc``)."""
    total = Stats()
    for s in stats:
        total = total + s
    return total


def top_words(text: str, n: int = 10, *, stopwords: Iterable[str] = ()) -> list[tuple[str, int]]:
    """The ``n`` most frequent words, most frequent first; ties in alphabetical order."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    skip = {w.lower() for w in stopwords}
    counts = Counter(w for w in tokenize(text) if w not in skip)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
