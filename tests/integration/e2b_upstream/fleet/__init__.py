"""envbuild: a subset of upstream's tests against ``envbuild serve --fleet`` (./conftest.py):
each module of this directory takes the tests of some upstream modules, unchanged."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def upstream(*modules: str) -> dict[str, Callable[..., object]]:
    """The tests (``test_*``) of ``modules`` (``sync.files.test_read``: under e2b_upstream),
    for a module here to take as its own (``globals().update``); pytest collects them there,
    and ``sandbox`` still knows their module (``SHARED_SANDBOX``)."""
    package = __name__.rsplit(".", 1)[0]
    tests: dict[str, Callable[..., object]] = {}
    for name in modules:
        module = importlib.import_module(f"{package}.{name}")
        tests.update((k, v) for k, v in vars(module).items()
                     if k.startswith("test_") and callable(v))
    return tests
