"""Commands over definitions: ``validate`` (graph, plan and explain live in ``cmd_plan``)."""

from __future__ import annotations

from pathlib import Path

import click

from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json


def register(group: click.Group) -> None:
    group.add_command(validate)


@click.command()
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@json_option("On success, print the tree and its counts of definitions as JSON.")
@click.pass_obj
def validate(app, directory: Path | None, as_json: bool) -> None:
    """Check every definition under DIRECTORY (default: --defs, else ./envdefs).

    Reports every problem, one per line, and exits 1; prints a one-line summary when all is well.
    """
    from envbuild.defs import describe_counts
    from envbuild.plan.graph import check_tree

    root = directory if directory is not None else app.settings.defs_dir
    defs = check_tree(root).defs  # schema and graph problems of every document, in one run
    if as_json:
        echo_json(validate_json(defs))
    else:
        click.echo(f"ok: {describe_counts(defs)} in {defs.root}")


def validate_json(defs) -> dict:
    """``validate --json``: the tree, the number of definitions and of each kind."""
    from envbuild.defs.model import KINDS

    kinds = {k: 0 for k in KINDS}
    for d in defs.by_name.values():
        kinds[d.kind] += 1
    return {"ok": True, "root": str(defs.root), "definitions": len(defs.by_name),
            "kinds": kinds}
