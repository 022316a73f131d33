"""Commands over definitions: ``validate`` (graph, plan and explain live in ``cmd_plan``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from envbuild.defs import describe_counts, load_definitions


def register(group: click.Group) -> None:
    group.add_command(validate)


@click.command()
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@click.pass_obj
def validate(app, directory: Path | None) -> None:
    """Check every definition under DIRECTORY (default: --defs, else ./envdefs).

    Reports every problem, one per line, and exits 1; prints a one-line summary when all is well.
    """
    root = directory if directory is not None else app.settings.defs_dir
    defs = load_definitions(root)
    # The graph checks (references, cycles, ABI) run when envbuild.plan.graph exists; an
    # ImportError from inside it is a real bug and must not be swallowed here.
    if importlib.util.find_spec("envbuild.plan.graph") is not None:
        from envbuild.plan.graph import build_graph

        build_graph(defs)
    click.echo(f"ok: {describe_counts(defs)} in {defs.root}")
