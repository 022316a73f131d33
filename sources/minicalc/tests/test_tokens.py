import pytest

from minicalc import CalcError, tokenize


def kinds(src):
    return [(t.kind, t.text) for t in tokenize(src)]


def test_numbers_names_ops():
    assert kinds("x1 = 2.5e3 ** .5") == [
        ("name", "x1"), ("op", "="), ("number", "2.5e3"), ("op", "**"), ("number", ".5"),
        ("end", ""),
    ]


def test_floor_division_is_one_token():
    assert [t.text for t in tokenize("7//2")] == ["7", "//", "2", ""]


def test_columns_are_one_based():
    assert [t.column for t in tokenize(" 1 + 2")] == [2, 4, 6, 7]


def test_bad_character():
    with pytest.raises(CalcError) as e:
        tokenize("1 $ 2")
    assert e.value.column == 3
