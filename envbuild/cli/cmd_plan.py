"""Commands over the graph: graph, plan, explain (filled in by the foundation issue)."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    pass
