"""Hidden test of the textstats-empty-input task: laid over /workspace when grading only."""

from textstats import analyze, top_words


def test_empty_text_has_no_lines():
    stats = analyze("")
    assert (stats.lines, stats.words, stats.chars) == (0, 0, 0)


def test_whitespace_only_has_no_words():
    stats = analyze("  \n\t\n")
    assert stats.words == 0 and stats.lines == 2
    assert top_words("   ") == []
