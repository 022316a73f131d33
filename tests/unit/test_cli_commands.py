"""The CLI's lazy command table (``envbuild.cli.main.COMMAND_MODULES``) names every command
its modules register, and each under the module that registers it."""

from __future__ import annotations

import importlib
import pkgutil

import click

import envbuild.cli as cli_pkg
from envbuild.cli import main


def test_command_table_matches_what_the_modules_register():
    registered: dict[str, str] = {}
    for module in sorted(set(main.COMMAND_MODULES.values()) | {
            m.name.removeprefix("envbuild.cli.")
            for m in pkgutil.iter_modules(cli_pkg.__path__, "envbuild.cli.")
            if m.name.startswith("envbuild.cli.cmd_")}):
        group = click.Group()
        importlib.import_module(f"envbuild.cli.{module}").register(group)
        for name in group.commands:
            assert name not in registered, f"{name} registered by {registered.get(name)} too"
            registered[name] = module
    assert registered == main.COMMAND_MODULES


def test_help_lists_every_command():
    ctx = click.Context(main.cli)
    assert main.cli.list_commands(ctx) == sorted(main.COMMAND_MODULES)
    for name in main.COMMAND_MODULES:
        assert main.cli.get_command(ctx, name) is not None, name
