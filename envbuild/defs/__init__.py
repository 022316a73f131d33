"""envbuild.defs: definition schemas, the model, and the loader.

``load_definitions(root)`` is the entry point: it reads a definition tree, validates every
document against the JSON Schemas in ``schema/`` and returns a ``DefinitionSet`` of frozen
dataclasses, or raises one ``DefinitionError`` listing every problem found.
"""

from envbuild.defs.hints import closest, suggest
from envbuild.defs.load import definition_files, describe_counts, load_definitions
from envbuild.defs.model import DefinitionSet, Origin

__all__ = [
    "DefinitionSet",
    "Origin",
    "closest",
    "definition_files",
    "describe_counts",
    "load_definitions",
    "suggest",
]
