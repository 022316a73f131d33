"""The layering of envbuild and runtime_shim, by static analysis (issue 38, item 1).

Every module belongs to one **room** (``ROOMS``, top to bottom). A module may import modules
of its own room and of rooms below it, never of a room above: the CLI drives jobs, builds and
the fleet; builds drive the runtime; the runtime's SDK drives its backends, which use the
node's state, the lazy package and the isolation layer; everything stands on the store, the
layer format and the few foundation modules. And no import cycle between modules, in a room or
across rooms.

Every import statement counts, at any depth (function-level imports included, ``if
TYPE_CHECKING:`` ones too), with relative imports resolved: a lazy import is still an arrow a
reader has to follow. Known violations are listed in ``KNOWN`` by module and target, each with
who fixes it; a listed violation that no longer exists fails too, so the list only shrinks.
``docs/architecture.md`` shows the rooms (``scripts/gen-architecture``; checked in
``test_architecture_doc``).
"""

from __future__ import annotations

import ast

from tests.conftest import REPO
from tests.layering import all_modules, cycles, imported_modules, imports_in, room, violations, within

#: (module, imported module) -> why it is still there and who removes it.
KNOWN: dict[tuple[str, str], str] = {
}


def test_every_module_is_in_a_room():
    for module in all_modules():
        room(module)


def test_no_room_imports_a_room_above_it():
    new = {k: v for k, v in violations().items() if k not in KNOWN}
    assert new == {}, "imports that break the layering (see this module's docstring)"


def test_every_known_exception_still_exists():
    # A fixed violation must leave KNOWN too, so the exceptions never hide a silent pass.
    assert set(KNOWN) <= set(violations()), set(KNOWN) - set(violations())


def test_no_import_cycle():
    known = {frozenset(k) for k in KNOWN}
    left = [c for c in cycles() if not any(k <= set(c) for k in known)]
    assert left == [], "import cycles between modules"


def test_the_checker_sees_function_level_and_relative_imports():
    src = ("import os\n"
           "def f():\n"
           "    if True:\n"
           "        from envbuild.build import executor\n"
           "    from ..plan import graph\n")
    seen = list(imports_in(src, "envbuild.store"))
    assert (4, "envbuild.build.executor") in seen
    assert (5, "envbuild.plan.graph") in seen


def test_the_checker_finds_what_it_must():
    # The rules would have failed on the arrows of the last wave (issue 38's evidence).
    assert room("runtime_shim.node.reclaim")[0] > room("runtime_shim.sdk.sandbox")[0]
    assert room("envbuild.settings")[0] > room("runtime_shim.node.admission")[0]
    assert room("runtime_shim.backends.fncall")[0] > room("runtime_shim.sdk.sandbox")[0]
    assert room("envbuild.defs.load")[0] > room("envbuild.build.pin")[0]
    assert room("envbuild.layers._tools")[0] > room("envbuild.store.base")[0]
    assert room("runtime_shim.fleet.client")[0] > room("envbuild.jobs.model")[0] \
        or room("runtime_shim.fleet.client")[0] == room("envbuild.jobs.model")[0]


def test_envbuild_jobs_uses_only_public_names_of_envbuild_defs():
    """The job-manifest loader shares the definition loader's YAML builder and error wording
    through public names (issue 12, item 7), not ``_private`` ones."""
    private = [f"{path.relative_to(REPO)}:{line} imports {target}"
               for path in sorted(REPO.glob("envbuild/jobs/*.py"))
               for line, target in imported_modules(path)
               if within(target, "envbuild.defs") and target.rpartition(".")[2].startswith("_")]
    assert private == []


#: The packages of runtime_shim the rest of envbuild may import from, by name in ``__all__``.
PUBLIC_SURFACES = ("runtime_shim", "runtime_shim.backends", "runtime_shim.fleet", "runtime_shim.grading",
                   "runtime_shim.isolation", "runtime_shim.lazyfs", "runtime_shim.node")


def surface_violations() -> list[str]:
    """``path:line imports x`` for every import of runtime_shim outside it that is not a name
    of a package's public surface (``__all__``)."""
    import importlib

    found = []
    for path in sorted(REPO.glob("envbuild/**/*.py")):
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.Import):
                names = [(a.name, None) for a in node.names if within(a.name, "runtime_shim")]
            elif isinstance(node, ast.ImportFrom) and within(node.module or "", "runtime_shim"):
                names = [(node.module or "", a.name) for a in node.names]
            else:
                continue
            for module, name in names:
                public = module in PUBLIC_SURFACES and name is not None and \
                    name in getattr(importlib.import_module(module), "__all__", ())
                if not public:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports "
                                 f"{module}{'.' + name if name else ''}")
    return found


def test_envbuild_uses_the_runtime_only_through_its_public_surfaces():
    """The build, the CLI and jobs depend on the runtime's layers (isolation, node, the SDK)
    through what each package declares public, so the runtime can move its insides freely."""
    assert surface_violations() == []
