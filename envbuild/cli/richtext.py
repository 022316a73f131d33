"""The one way data reaches rich: ``literal(value)``.

rich reads ``[...]`` in a string as markup, and a build's data is full of it: a failing
Dockerfile ``RUN`` names ``[/…]`` paths, which rich takes for closing tags (a
``MarkupError`` that crashed ``envbuild build`` on a terminal, issue 34). Every name, detail,
node, title or cell a command passes to rich goes through ``literal``; only the styles a
command writes itself (``[red]failed[/red]``) stay markup.
"""

from __future__ import annotations


def literal(value: object) -> str:
    """``value`` as rich markup that renders as exactly its text."""
    from rich.markup import escape  # rich is the optional `cli` extra: imported where drawn

    return escape(str(value))
