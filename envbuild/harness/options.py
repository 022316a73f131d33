"""Harness keyword arguments, split into an adapter's own settings and ``SandboxOptions``.

A harness builds its adapter from one flat mapping (mini-swe-agent's ``environment:`` config,
SWE-ReX's keyword arguments): the names of the adapter's config dataclass are its own, every
other name is a ``SandboxOptions`` field for the sandbox it creates. ``split_options`` is that
split, done once for every adapter; ``sandbox_option_values`` turns the rest into what
``SandboxOptions`` takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from runtime_shim import Limits, SandboxOptions


def split_options(cls: type, fields: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(own, options)`` of ``fields`` for the config dataclass ``cls``: ``own`` its fields
    (all but ``options``; an ``env`` mapping made str to str), ``options`` the rest. A name in
    neither is a ``RuntimeShimError`` naming both lists (``SandboxOptions.of``'s refusal)."""
    names = {f.name for f in dataclasses.fields(cls)} - {"options"}
    options = {k: v for k, v in fields.items() if k not in names}
    SandboxOptions.of(None, sandbox_option_values(options))  # refuses unknown names
    own = {k: v for k, v in fields.items() if k in names}
    if "env" in names:
        own["env"] = {str(k): str(v) for k, v in (own.get("env") or {}).items()}
    return own, options


def sandbox_option_values(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` as ``SandboxOptions`` takes them: a ``limits`` mapping becomes ``Limits``,
    a ``network`` list a tuple."""
    values = dict(options)
    if isinstance(values.get("limits"), Mapping):
        values["limits"] = Limits(**values["limits"])
    if isinstance(values.get("network"), list):
        values["network"] = tuple(values["network"])
    return values
