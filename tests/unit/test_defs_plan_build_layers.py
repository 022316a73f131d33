"""The layering of the build side (issue 38, item 1): ``envbuild.defs`` → ``envbuild.plan`` →
``envbuild.build``. Definitions import nothing from planning or building, planning imports
definitions only (never the build), and no module of the three is in an import cycle. Every
import counts, function-level ones too (``tests/unit/test_import_rule.py`` reads them)."""

from __future__ import annotations

from tests.conftest import REPO
from tests.unit.test_import_rule import imported_modules, module_name

LAYERS = ("envbuild.defs", "envbuild.plan", "envbuild.build")


def _layer(module: str) -> int | None:
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def _graph() -> dict[str, set[str]]:
    """module -> the modules of the three packages it imports (a name imported from a module
    counts as that module)."""
    paths = {module_name(p): p for pkg in LAYERS
             for p in REPO.glob(pkg.replace(".", "/") + "/**/*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        deps = set()
        for _line, target in imported_modules(path):
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != name and _layer(target) is not None:
                deps.add(target)
        graph[name] = deps
    return graph


def test_a_layer_imports_only_the_layers_below_it():
    upward = sorted(f"{m} imports {t}" for m, deps in _graph().items() for t in deps
                    if _layer(t) > _layer(m))  # type: ignore[operator]
    assert upward == []


def test_no_import_cycle_between_modules_of_defs_plan_and_build():
    graph = _graph()
    cycles = []
    for start in graph:  # a path from a module back to itself, through modules (not __init__)
        seen, todo = set(), [(d, (start, d)) for d in graph[start]]
        while todo:
            node, path = todo.pop()
            if node == start and node not in LAYERS:
                cycles.append(" -> ".join(path))
                break
            if node in seen:
                continue
            seen.add(node)
            todo.extend((d, (*path, d)) for d in graph.get(node, ()))
    assert cycles == []
