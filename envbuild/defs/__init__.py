"""envbuild.defs: definition schemas, the model, and the loader.

``load_definitions(root)`` is the entry point: it reads a definition tree, validates every
document against the JSON Schemas in ``schema/`` and returns a ``DefinitionSet`` of frozen
dataclasses, or raises one ``DefinitionError`` listing every problem found.
``collect_definitions(root)`` returns what parsed together with the problems (a ``LoadResult``),
so the graph checks can run over every valid document in the same run
(``envbuild.plan.graph.check_tree``).
"""

from envbuild.defs.hints import closest, suggest
from envbuild.defs.load import (
    LoadResult,
    collect_definitions,
    definition_files,
    describe_counts,
    load_definitions,
)
from envbuild.defs.model import DefinitionSet, Origin

__all__ = [
    "DefinitionSet",
    "LoadResult",
    "Origin",
    "closest",
    "collect_definitions",
    "definition_files",
    "describe_counts",
    "load_definitions",
    "suggest",
]
