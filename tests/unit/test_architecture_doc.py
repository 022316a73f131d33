"""docs/architecture.md is generated from the code (``scripts/gen-architecture``): it must be
what the script writes today, so the page cannot drift from the rooms and docstrings."""

from __future__ import annotations

import importlib.machinery
import importlib.util

from tests.conftest import REPO


def test_architecture_page_is_up_to_date():
    path = str(REPO / "scripts" / "gen-architecture")
    loader = importlib.machinery.SourceFileLoader("gen_architecture", path)
    spec = importlib.util.spec_from_loader("gen_architecture", loader)
    assert spec is not None
    script = importlib.util.module_from_spec(spec)
    loader.exec_module(script)
    assert script.PAGE.read_text() == script.render(), \
        "docs/architecture.md is out of date: run scripts/gen-architecture"
