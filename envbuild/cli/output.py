"""The one JSON printer of the CLI: every ``--json`` goes through ``echo_json``.

The contract of ``--json`` (``docs/cli-json.md``): one JSON document on stdout, its keys
stable (a key is added, never renamed or removed without a new major version); progress and
warnings stay on stderr. Errors are not JSON: as without ``--json``, a failed command prints
its one-line cause (and hint) on stderr and exits 1 (``envbuild.cli.main.main``), so a caller
tells failure by the exit code and never parses a half-written document.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import click


def echo_json(obj: Any) -> None:
    """Print ``obj`` as one JSON document on stdout (``dumps_lines``)."""
    click.echo(dumps_lines(obj))


def dumps_lines(obj: Any) -> str:
    """``obj`` as JSON with each top-level key, and each item of a top-level list, on a line
    of its own (the items themselves compact). The same document as ``json.dumps(obj,
    indent=2)``, but written by the C encoder, which ``indent`` turns off: the plan of 100,000
    definitions is 20-30 MB of JSON, 0.84 s in the pure-Python indenting encoder, 0.46 s so."""
    if isinstance(obj, list) and obj:
        return "[\n" + ",\n".join("  " + json.dumps(x) for x in obj) + "\n]"
    if not isinstance(obj, dict) or not obj:
        return json.dumps(obj)
    parts = []
    for key, value in obj.items():
        if isinstance(value, list) and value:
            items = ",\n".join("    " + json.dumps(x) for x in value)
            parts.append(f"  {json.dumps(key)}: [\n{items}\n  ]")
        else:
            parts.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}"


def remove_each(ids: Iterable[str], remove: Callable[[str], None], as_json: bool) -> int:
    """``sandbox rm`` and ``fleet rm``: ``remove`` each id, one failure (a
    ``RuntimeShimError``) never stopping the others; a line per id (``removed ID`` or
    ``failed  ID: cause — hint``), or with ``as_json`` ``{"removed": [ID...], "failed":
    [{"id", "error", "hint"}...]}``. Returns the exit code: 1 if any failed."""
    from envbuild.errors import RuntimeShimError

    removed: list[str] = []
    failed: list[dict[str, str | None]] = []
    for i in ids:
        try:
            remove(i)
        except RuntimeShimError as e:
            failed.append({"id": i, "error": e.message, "hint": e.hint})
            if not as_json:
                click.echo(f"failed  {i}: {e.message}" + (f" — {e.hint}" if e.hint else ""))
        else:
            removed.append(i)
            if not as_json:
                click.echo(f"removed {i}")
    if as_json:
        echo_json({"removed": removed, "failed": failed})
    return 1 if failed else 0
