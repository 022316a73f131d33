"""The rooms of envbuild and runtime_shim and the imports between their modules, by static
analysis: the one copy ``tests/unit/test_import_rule.py`` checks and ``scripts/gen-architecture``
draws ``docs/architecture.md`` from.

Every import statement counts, at any depth (function-level imports included, ``if
TYPE_CHECKING:`` ones too), with relative imports resolved: a lazy import is still an arrow a
reader has to follow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Top to bottom. A room is a package (every module under it) or one module; a module's room
#: is the longest match. Rooms on one line are peers: neither imports the other.
ROOMS: tuple[tuple[str, ...], ...] = (
    ("envbuild.cli", "envbuild.harness"),
    ("envbuild.serve",),                      # the E2B-compatible server (issue 37)
    ("envbuild.jobs", "runtime_shim.fleet"),
    ("envbuild.build",),
    ("envbuild.dockerd", "envbuild.plan"),
    ("envbuild.defs",),
    ("runtime_shim",),                        # the package: the SDK's public names
    ("runtime_shim.grading",),
    ("runtime_shim.sdk",),
    ("runtime_shim.backends",),
    ("runtime_shim.node",),
    ("runtime_shim.lazyfs",),
    ("runtime_shim.isolation",),
    ("envbuild.export",),
    ("envbuild.store",),
    ("envbuild.layers",),
    ("envbuild", "envbuild.oci", "envbuild.canonical", "envbuild.safefs", "envbuild._lazy"),
    ("envbuild.settings",),
    ("envbuild.sizes",),
    ("envbuild.errors",),
    ("envbuild._version", "envbuild.libc", "envbuild.atomic"),
)

def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def all_modules() -> dict[str, Path]:
    paths = [*REPO.glob("envbuild/**/*.py"), *REPO.glob("runtime_shim/**/*.py")]
    return {module_name(p): p for p in sorted(paths)}


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, name) for every import in ``path``: ``import a.b`` yields ``a.b``; ``from a
    import b`` yields ``a.b`` (a submodule, or a name that ``resolve`` maps to ``a``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports_in(path.read_bytes(), package)


def imports_in(source: bytes | str, package: str) -> Iterator[tuple[int, str]]:
    """``imported_modules`` of ``source``, a module of ``package``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def resolve(target: str) -> str | None:
    """The module of ours ``target`` names (``a.b.name`` → ``a.b``), or None (not ours)."""
    modules = all_modules()
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def arrows() -> Iterator[tuple[str, str, str]]:
    """(module, imported module of ours, "path:line") for every import between two modules."""
    for name, path in all_modules().items():
        for line, target in imported_modules(path):
            found = resolve(target)
            if found and found != name and not (path.name == "__init__.py"
                                                and found == name.rpartition(".")[0]):
                yield name, found, f"{path.relative_to(REPO)}:{line}"


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def room(module: str) -> tuple[int, str]:
    """(rank from the top, room) of ``module``: its longest matching room."""
    best: tuple[int, str] | None = None
    for rank, peers in enumerate(ROOMS):
        for prefix in peers:
            if within(module, prefix) and (best is None or len(prefix) > len(best[1])):
                best = (rank, prefix)
    assert best is not None, f"{module} is in no room: add it to ROOMS"
    return best


def violations() -> dict[tuple[str, str], list[str]]:
    """(module, imported module) -> ["path:line", ...] for every import of a room above or
    of a peer room."""
    found: dict[tuple[str, str], list[str]] = {}
    for module, target, where in arrows():
        (mine, my_room), (theirs, their_room) = room(module), room(target)
        if theirs < mine or (theirs == mine and their_room != my_room):
            found.setdefault((module, target), []).append(where)
    return found


def cycles() -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in all_modules()}
    for module, target, _ in arrows():
        graph[module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        scc.append(top)
                        if top == node:
                            break
                    if len(scc) > 1:
                        found.append(sorted(scc))
    return found
