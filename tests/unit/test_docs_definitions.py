"""docs/definitions.md covers every field of the definition schemas (envbuild/defs/schema/):
each kind's own fields in that kind's section, every field of the shared parts somewhere on the
page. A field added to a schema and not documented fails here."""

from __future__ import annotations

import json
import re

import pytest

from tests.docblocks import REPO

SCHEMAS = REPO / "envbuild/defs/schema"
PAGE = REPO / "docs/definitions.md"
KINDS = {"base.json": "Base", "workspace.json": "Workspace", "toolkit.json": "Toolkit",
         "env.json": "Env", "task.json": "Task", "jobmanifest.json": "JobManifest"}


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/definitions.md has no '## {title}' section"
    return m.group(1)


def _field_names(node, out: set[str]) -> set[str]:
    """Every property name under a schema node, through oneOf/anyOf/items/$defs."""
    if isinstance(node, dict):
        for name, sub in (node.get("properties") or {}).items():
            out.add(name)
            _field_names(sub, out)
        for key, sub in node.items():
            if key != "properties":
                _field_names(sub, out)
    elif isinstance(node, list):
        for sub in node:
            _field_names(sub, out)
    return out


@pytest.mark.parametrize("schema, kind", sorted(KINDS.items()))
def test_each_kind_documents_its_fields(schema, kind):
    fields = json.loads((SCHEMAS / schema).read_text())["properties"]
    section = _section(PAGE.read_text(encoding="utf-8"), kind)
    missing = [f for f in fields if f"`{f}`" not in section]
    assert not missing, f"docs/definitions.md, section {kind}: no `{missing}`"


def test_every_field_is_on_the_page():
    text = PAGE.read_text(encoding="utf-8")
    names: set[str] = set()
    for schema in sorted(SCHEMAS.glob("*.json")):
        _field_names(json.loads(schema.read_text()), names)
    missing = sorted(n for n in names if f"`{n}`" not in text and f"{n}," not in text
                     and f"{n}}}" not in text and f"{n}:" not in text)
    assert not missing, f"docs/definitions.md never names {missing}"


def test_the_check_can_fail():
    assert _field_names({"properties": {"a": {"oneOf": [{"properties": {"b": {}}}]}}}, set()) == {"a", "b"}
