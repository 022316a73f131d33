"""The size gate's measure, one copy for ``tests/unit/test_code_shape.py``: modules over
``MAX_MODULE_LINES`` lines and functions over ``MAX_FUNCTION_LINES`` (from the ``def`` line to
the last, docstring included), in envbuild/ and runtime_shim/.

Why these numbers: a function of 60 lines is about one screen, what a reader holds in their
head at once; a module of 600 is one concern a newcomer reads in a sitting. A function or
module that truly should stay bigger says why in a comment starting ``# shape:`` — on the line
above the ``def`` (or above its decorators) for a function, anywhere in its first 30 lines for a
module — and is then not reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
EXEMPT = "# shape:"


def _sources() -> Iterator[tuple[str, Path]]:
    for path in sorted([*REPO.glob("envbuild/**/*.py"), *REPO.glob("runtime_shim/**/*.py")]):
        yield str(path.relative_to(REPO)), path


def oversized(text: str, name: str) -> Iterator[tuple[str, int]]:
    """(``name`` or ``name:function``, lines) for what in ``text`` is over the limits and not
    exempt."""
    lines = text.splitlines()
    if len(lines) > MAX_MODULE_LINES and not any(ln.lstrip().startswith(EXEMPT)
                                                 for ln in lines[:30]):
        yield name, len(lines)
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        above = lines[first - 2].strip() if first >= 2 else ""
        if length > MAX_FUNCTION_LINES and not above.startswith(EXEMPT):
            yield f"{name}:{node.name}", length


def report() -> dict[str, int]:
    """Everything over the limits in the repository, by ``path`` or ``path:function``."""
    found: dict[str, int] = {}
    for name, path in _sources():
        for key, length in oversized(path.read_text(), name):
            found[key] = max(length, found.get(key, 0))
    return found
