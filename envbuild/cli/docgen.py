"""The CLI reference, ``docs/cli.md``, generated from the click commands.

``python -m envbuild.cli.docgen`` rewrites it; ``--check`` exits 1 (and says how to fix it)
when it is out of date, and ``tests/unit/test_cli_docs.py`` fails then, so the reference can
never drift from ``envbuild --help``. Each command gets its usage line, its help, its
arguments and every option with its help and default, as ``--help`` would print them with
every default shown.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from envbuild.cli.main import cli

#: Where the reference lives, from the repository root.
DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"

HEADER = """\
# envbuild command reference

<!-- Generated from the click commands by `python -m envbuild.cli.docgen`: do not edit by
hand. tests/unit/test_cli_docs.py fails when it is out of date. -->

Every command below takes the global options of `envbuild` before its name
(`envbuild --store s3://bucket/prefix build`). A command given `--json` prints one JSON
document on stdout; its keys are described in [cli-json.md](cli-json.md). A command that fails
prints its cause (and a hint) on stderr and exits 1, with or without `--json`; a usage error
exits 2. Every command takes `-h`/`--help`.
"""


def _commands(cmd: click.Command, ctx: click.Context) -> Iterator[tuple[click.Command,
                                                                       click.Context]]:
    """``cmd`` and, depth first in name order, every command under it."""
    yield cmd, ctx
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _commands(sub, click.Context(sub, info_name=name, parent=ctx,
                                                        show_default=True))


def _section(cmd: click.Command, ctx: click.Context) -> list[str]:
    path = ctx.command_path
    lines = [f"## {path}", "", "```", f"{path} {' '.join(cmd.collect_usage_pieces(ctx))}",
             "```", ""]
    if cmd.help:
        lines += [inspect.cleandoc(cmd.help.split("\f")[0]), ""]
    args = [p.make_metavar(ctx) for p in cmd.params if isinstance(p, click.Argument)]
    if args:
        lines += ["Arguments: " + ", ".join(f"`{a}`" for a in args), ""]
    if isinstance(cmd, click.Group):
        subs = [n for n in cmd.list_commands(ctx)
                if (sub := cmd.get_command(ctx, n)) is not None and not sub.hidden]
        lines += ["Commands: " + ", ".join(f"`{n}`" for n in subs), ""]
    help_option = cmd.get_help_option(ctx)  # the same on every command: in the header
    options = [r for p in cmd.get_params(ctx) if isinstance(p, click.Option)
               and p is not help_option and (r := p.get_help_record(ctx)) is not None]
    if options:
        lines += ["Options:", ""]
        lines += [f"- `{opts}`" + (f": {' '.join(text.split())}" if text else "")
                  for opts, text in options]
        lines.append("")
    return lines


def render() -> str:
    """The whole reference, as ``docs/cli.md`` should hold it."""
    root = click.Context(cli, info_name="envbuild", show_default=True)
    out = [HEADER]
    for cmd, ctx in _commands(cli, root):
        out += _section(cmd, ctx)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envbuild.cli.docgen",
                                     description="Write the CLI reference (docs/cli.md).")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the file is out of date")
    parser.add_argument("-o", "--output", type=Path, default=DOC, help=f"default: {DOC}")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"error: {args.output} is out of date with the click commands\n"
                  "hint: run python -m envbuild.cli.docgen and commit the result",
                  file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
