"""textstats: word, line and character statistics for text."""

from textstats.core import Stats, analyze, merge, tokenize, top_words

__all__ = ["Stats", "analyze", "merge", "tokenize", "top_words"]
__version__ = "0.3.0"
