"""Evaluate parsed statements; variables persist in an ``Interpreter``."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping

from minicalc.errors import CalcError
from minicalc.parser import Assign, BinOp, Call, Node, Num, Unary, Var, parse

Number = float  # ints are kept as ints where Python keeps them

_BINARY: dict[str, Callable[[Number, Number], Number]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "%": operator.mod, "**": operator.pow,
}

FUNCTIONS: dict[str, Callable[..., Number]] = {
    "abs": abs, "min": min, "max": max, "sqrt": math.sqrt, "round": round,
}

CONSTANTS: dict[str, Number] = {"pi": math.pi, "e": math.e}


class Interpreter:
    def __init__(self, env: Mapping[str, Number] | None = None):
        self.env: dict[str, Number] = {**CONSTANTS, **(env or {})}

    def run(self, src: str) -> Number:
        return self.eval(parse(src))

    def eval(self, node: Node) -> Number:
        if isinstance(node, Num):
            return node.value
        if isinstance(node, Var):
            try:
                return self.env[node.name]
            except KeyError:
                raise CalcError(f"unknown name {node.name!r}", node.column) from None
        if isinstance(node, Unary):
            v = self.eval(node.operand)
            return -v if node.op == "-" else +v
        if isinstance(node, BinOp):
            left, right = self.eval(node.left), self.eval(node.right)
            try:
                return _BINARY[node.op](left, right)
            except ZeroDivisionError:
                raise CalcError("division by zero", node.column) from None
            except OverflowError:
                raise CalcError("result too large", node.column) from None
        if isinstance(node, Call):
            fn = FUNCTIONS.get(node.name)
            if fn is None:
                raise CalcError(f"unknown function {node.name!r}", node.column)
            args = [self.eval(a) for a in node.args]
            try:
                return fn(*args)
            except (TypeError, ValueError) as e:
                raise CalcError(f"{node.name}: {e}", node.column) from None
        if isinstance(node, Assign):
            value = self.eval(node.value)
            self.env[node.name] = value
            return value
        raise TypeError(f"not a node: {node!r}")


def evaluate(src: str, env: Mapping[str, Number] | None = None) -> Number:
    """Evaluate one statement in a fresh interpreter."""
    return Interpreter(env).run(src)
