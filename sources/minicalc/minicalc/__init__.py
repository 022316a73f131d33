"""minicalc: tokenizer, parser and evaluator for arithmetic expressions."""

from minicalc.errors import CalcError
from minicalc.evaluator import Interpreter, evaluate
from minicalc.parser import parse
from minicalc.tokens import Token, tokenize

__all__ = ["CalcError", "Interpreter", "Token", "evaluate", "parse", "tokenize"]
__version__ = "0.2.0"
