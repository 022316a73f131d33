"""The JSON Schemas themselves: valid, shipped, strict, and in step with the model."""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator

from envbuild.defs.hints import closest, suggest
from envbuild.defs.model import KINDS
from envbuild.defs.validate import load_schema, validators


@pytest.mark.parametrize("name", ["common.json", *KINDS])
def test_schemas_are_valid_draft_2020_12(name):
    Draft202012Validator.check_schema(load_schema(name))


@pytest.mark.parametrize("kind, required", [
    ("Base", {"name", "abi", "from"}),
    ("Toolkit", {"name", "build_on", "prefix"}),
    ("Workspace", {"name", "build_on", "source"}),
    ("Env", {"name", "base"}),
])
def test_required_keys_per_kind(kind, required):
    assert set(load_schema(kind)["required"]) == {"apiVersion", "kind", *required}


def _objects(schema):
    if isinstance(schema, dict):
        if schema.get("type") == "object" or "properties" in schema:
            yield schema
        for key, value in schema.items():
            if key in ("if", "then", "else"):
                # a rule between keys of the mapping around it (which refuses unknown keys):
                # additionalProperties: false there would change the rule, not the mapping
                assert schema.get("additionalProperties") is False, schema
                continue
            yield from _objects(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _objects(value)


@pytest.mark.parametrize("kind", KINDS)
def test_every_fixed_key_mapping_refuses_unknown_keys(kind):
    for obj in _objects(validators()[kind].schema):
        if "properties" in obj or obj.get("additionalProperties") is False:
            assert obj.get("additionalProperties") is False, obj


def test_compiled_validators_have_no_refs_left():
    assert "$ref" not in repr(validators())
    assert all("$ref" not in repr(v.schema) for v in validators().values())


def test_suggest_and_closest():
    assert suggest("toolkit", ["base", "toolkits"]) == "did you mean 'toolkits'?"
    assert closest("toolkit", ["base", "toolkits"]) == "toolkits"
    assert suggest("zzz", ["base", "toolkits"]) is None
