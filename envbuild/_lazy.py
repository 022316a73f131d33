"""Package names imported on first use (PEP 562), written once for every package that keeps
its start-up light: ``envbuild.layers`` (the CLI reads a TOC without loading the writer),
``envbuild.jobs`` (the model without the loader), ``runtime_shim`` (the node cache without the
SDK). Imports only the standard library."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str,
                 where: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``where`` maps each name to the module that
    defines it (absolute, or relative to ``package`` like ``"._reader"``). A name is imported
    the first time it is asked for, then cached in the package's namespace."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
