"""Commands over definitions: ``validate`` (graph, plan and explain live in ``cmd_plan``)."""

from __future__ import annotations

from pathlib import Path

import click


def register(group: click.Group) -> None:
    group.add_command(validate)


@click.command()
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@click.pass_obj
def validate(app, directory: Path | None) -> None:
    """Check every definition under DIRECTORY (default: --defs, else ./envdefs).

    Reports every problem, one per line, and exits 1; prints a one-line summary when all is well.
    """
    from envbuild.defs import describe_counts
    from envbuild.plan.graph import check_tree

    root = directory if directory is not None else app.settings.defs_dir
    defs = check_tree(root).defs  # schema and graph problems of every document, in one run
    click.echo(f"ok: {describe_counts(defs)} in {defs.root}")
