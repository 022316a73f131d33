import pytest

from textstats import Stats, analyze, merge, tokenize, top_words


def test_empty_text():
    assert analyze("") == Stats(0, 0, 0)


def test_counts_like_wc():
    assert analyze("one two\nthree\n") == Stats(lines=2, words=3, chars=14)


def test_last_line_without_newline_counts():
    assert analyze("a\nb").lines == 2


def test_tokenize_keeps_contractions_and_hyphens():
    assert tokenize("Don't stop, well-known -- end.") == ["don't", "stop", "well-known", "end"]


def test_tokenize_case():
    assert tokenize("Hello World", lower=False) == ["Hello", "World"]


def test_tokenize_unicode_letters():
    assert tokenize("café über naïve") == ["café", "über", "naïve"]


def test_top_words_orders_by_count_then_alphabet():
    assert top_words("b a c b a b", 3) == [("b", 3), ("a", 2), ("c", 1)]


def test_top_words_stopwords():
    assert top_words("the cat the hat", 2, stopwords=["THE"]) == [("cat", 1), ("hat", 1)]


def test_top_words_rejects_negative_n():
    with pytest.raises(ValueError):
        top_words("x", -1)


def test_merge_sums():
    assert merge([Stats(1, 2, 3), Stats(4, 5, 6)]) == Stats(5, 7, 9)
    assert merge([]) == Stats()
