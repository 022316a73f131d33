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

from tests.conftest import REPO
from tests.layering import all_modules, cycles, imported_modules, imports_in, room, violations, within

#: (module, imported module) -> why it is still there and who removes it.
KNOWN: dict[tuple[str, str], str] = {
    ("envbuild.defs.load", "envbuild.build.pin"):
        "issue 38: the build helper moves the shared fact into defs",
    ("envbuild.defs.load", "envbuild.build.dockerfile"):
        "issue 38: the build helper moves the shared fact into defs",
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
