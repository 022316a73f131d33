"""``envbuild layer ...``: pack, ls, cat, unpack, verify (filled in by the layer-format issue)."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    pass
