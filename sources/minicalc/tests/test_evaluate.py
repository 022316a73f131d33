import math

import pytest

from minicalc import CalcError, Interpreter, evaluate, parse
from minicalc.__main__ import main


@pytest.mark.parametrize("src, expected", [
    ("1 + 2 * 3", 7),
    ("(1 + 2) * 3", 9),
    ("2 ** 3 ** 2", 512),        # right-associative
    ("-2 ** 2", -4),             # ** binds tighter than unary minus
    ("7 // 2", 3),
    ("7 % 3", 1),
    ("10 / 4", 2.5),
    ("--3", 3),
    ("max(1, 7, 3) - min(4, 2)", 5),
    ("abs(-3.5)", 3.5),
    ("round(2.567, 2)", 2.57),
])
def test_expressions(src, expected):
    assert evaluate(src) == expected


def test_constants_and_sqrt():
    assert evaluate("sqrt(16) + pi") == pytest.approx(4 + math.pi)


def test_variables_persist_in_an_interpreter():
    calc = Interpreter()
    assert calc.run("r = 2") == 2
    assert calc.run("r * r + 1") == 5


def test_env_argument():
    assert evaluate("x * y", {"x": 3, "y": 4}) == 12


@pytest.mark.parametrize("src, message, column", [
    ("1 / 0", "division by zero", 3),
    ("foo + 1", "unknown name 'foo'", 1),
    ("nope(1)", "unknown function 'nope'", 1),
    ("(1 + 2", "expected ')'", 7),
    ("1 +", "expected a number", 4),
    ("1 2", "unexpected '2'", 3),
    ("sqrt(-1)", "sqrt: math domain error", 1),
])
def test_errors(src, message, column):
    with pytest.raises(CalcError) as e:
        evaluate(src)
    assert message in str(e.value)
    assert e.value.column == column


def test_parse_returns_ast():
    tree = parse("a = 1 + 2")
    assert type(tree).__name__ == "Assign"
    assert tree.name == "a"


def test_cli_args(capsys):
    assert main(["r = 3", "r * 2", "10 / 4"]) == 0
    assert capsys.readouterr().out.splitlines() == ["3", "6", "2.5"]


def test_cli_error_status(capsys):
    assert main(["1 / 0", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["2"]
    assert "division by zero" in captured.err
