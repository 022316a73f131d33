"""Validate documents against the OCI JSON Schemas vendored in ``tests/schemas/``.

They are copies of the opencontainers image-spec and runtime-spec schema folders (Apache-2.0,
``LICENSE`` beside each), vendored so a fresh clone runs every test with nothing beside it.

The schema files reference each other by relative file name (``defs.json#/...``) or by their
``$id``s; we register every file of a folder under its ``file://`` URI (and its ``$id`` where it
has one) so the references resolve without network access.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT4

SCHEMAS = Path(__file__).resolve().parent / "schemas"
RUNTIME_SPEC = SCHEMAS / "oci-runtime-spec"
IMAGE_SPEC = SCHEMAS / "oci-image-spec"


@cache
def _registry(folder: Path) -> Registry:
    def retrieve(uri: str) -> Resource:
        # The schemas' ids (https://opencontainers.org/schema/...) and nested ids make relative
        # refs resolve to several different URIs; every one ends in a file name of the folder.
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        path = folder / name
        if not path.is_file():
            from referencing.exceptions import NoSuchResource

            raise NoSuchResource(ref=uri)
        return Resource.from_contents(json.loads(path.read_text()), default_specification=DRAFT4)

    return Registry(retrieve=retrieve)


def validator(folder: Path, schema_file: str):
    """A validator for ``folder/schema_file``; a missing vendored schema fails the test."""
    path = folder / schema_file
    if not path.exists():
        pytest.fail(f"OCI schema {path} not found (tests/schemas/ is vendored in the repo)",
                    pytrace=False)
    schema = json.loads(path.read_text())
    schema.setdefault("id", path.as_uri())
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft4Validator)
    return cls(schema, registry=_registry(folder))


def assert_valid(folder: Path, schema_file: str, document) -> None:
    errors = sorted(validator(folder, schema_file).iter_errors(document), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])
