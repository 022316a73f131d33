"""Recursive-descent parser.

Grammar (lowest precedence first)::

    statement := NAME "=" expr | expr
    expr      := term (("+" | "-") term)*
    term      := unary (("*" | "/" | "//" | "%") unary)*
    unary     := "-" unary | "+" unary | power
    power     := atom ("**" unary)?          # right-associative, binds tighter than unary minus on its left
    atom      := NUMBER | NAME | NAME "(" args ")" | "(" expr ")"
"""

from __future__ import annotations

import dataclasses
from typing import Union

from minicalc.errors import CalcError
from minicalc.tokens import Token, tokenize


@dataclasses.dataclass(frozen=True)
class Num:
    value: float


@dataclasses.dataclass(frozen=True)
class Var:
    name: str
    column: int


@dataclasses.dataclass(frozen=True)
class Unary:
    op: str
    operand: Node


@dataclasses.dataclass(frozen=True)
class BinOp:
    op: str
    left: Node
    right: Node
    column: int


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    args: tuple[Node, ...]
    column: int


@dataclasses.dataclass(frozen=True)
class Assign:
    name: str
    value: Node


Node = Union[Num, Var, Unary, BinOp, Call, Assign]


class _Parser:
    def __init__(self, tokens: list[Token]):
        self.tokens = tokens
        self.i = 0

    @property
    def tok(self) -> Token:
        return self.tokens[self.i]

    def take(self) -> Token:
        t = self.tokens[self.i]
        self.i += 1
        return t

    def accept(self, *ops: str) -> Token | None:
        if self.tok.kind == "op" and self.tok.text in ops:
            return self.take()
        return None

    def expect(self, op: str) -> Token:
        t = self.accept(op)
        if t is None:
            raise CalcError(f"expected {op!r}, found {self.tok.text or 'end of input'!r}",
                            self.tok.column)
        return t

    def statement(self) -> Node:
        nxt = self.tokens[self.i + 1] if self.i + 1 < len(self.tokens) else None
        if self.tok.kind == "name" and nxt is not None and nxt.kind == "op" and nxt.text == "=":
            name = self.take().text
            self.take()
            node: Node = Assign(name, self.expr())
        else:
            node = self.expr()
        if self.tok.kind != "end":
            raise CalcError(f"unexpected {self.tok.text!r}", self.tok.column)
        return node

    def expr(self) -> Node:
        node = self.term()
        while (t := self.accept("+", "-")) is not None:
            node = BinOp(t.text, node, self.term(), t.column)
        return node

    def term(self) -> Node:
        node = self.unary()
        while (t := self.accept("*", "/", "//", "%")) is not None:
            node = BinOp(t.text, node, self.unary(), t.column)
        return node

    def unary(self) -> Node:
        t = self.accept("-", "+")
        if t is not None:
            return Unary(t.text, self.unary())
        return self.power()

    def power(self) -> Node:
        node = self.atom()
        t = self.accept("**")
        if t is not None:
            node = BinOp("**", node, self.unary(), t.column)
        return node

    def atom(self) -> Node:
        t = self.tok
        if t.kind == "number":
            self.take()
            return Num(float(t.text) if any(c in t.text for c in ".eE") else int(t.text))
        if t.kind == "name":
            self.take()
            if self.accept("("):
                args: list[Node] = []
                if not self.accept(")"):
                    args.append(self.expr())
                    while self.accept(","):
                        args.append(self.expr())
                    self.expect(")")
                return Call(t.text, tuple(args), t.column)
            return Var(t.text, t.column)
        if self.accept("("):
            node = self.expr()
            self.expect(")")
            return node
        raise CalcError(f"expected a number, name or '(', found {t.text or 'end of input'!r}",
                        t.column)


def parse(src: str) -> Node:
    """Parse one statement (an expression or ``name = expression``)."""
    return _Parser(tokenize(src)).statement()
