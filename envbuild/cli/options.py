"""Options more than one command module takes, written once: ``--json`` and ``--backend``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def json_option(help: str = "Print the result as one JSON document (docs/cli-json.md).",
                ) -> Callable[[F], F]:
    """``--json`` (as the ``as_json`` parameter): the command prints one document with
    ``envbuild.cli.output.echo_json``; errors stay one line on stderr with exit 1."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def backend_names() -> tuple[str, ...]:
    """Every sandbox backend the SDK accepts (``Sandbox.create(backend=...)``): the built-in
    ones and any registered since. The registry is ``runtime_shim.backend``; this is the
    CLI's one reading of it."""
    from runtime_shim.backend import backend_names as registered

    return registered()


class BackendName(click.ParamType):
    """A sandbox backend's name, checked against ``backend_names()`` when the command runs
    (or its help is drawn), so loading a command module imports no backend code."""

    name = "backend"

    def get_metavar(self, param: click.Parameter, ctx: click.Context) -> str:
        return "[" + "|".join(backend_names()) + "]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        names = backend_names()
        if value not in names:
            self.fail(f"{value!r} is not a sandbox backend; choose one of: {', '.join(names)}",
                      param, ctx)
        return str(value)


def backend_option(help: str = "The kind of sandbox: an OCI container, a QEMU microVM, or "
                                "fncall (stateless calls on a warm container).",
                   ) -> Callable[[F], F]:
    """``--backend NAME`` (default ``container``), any backend the SDK accepts."""
    return click.option("--backend", type=BackendName(), default="container",
                        show_default=True, help=help)
