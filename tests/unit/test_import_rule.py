"""The dependency rule between the packages (issue 12, item 7), by static analysis.

``runtime_shim`` (the sandbox runtime and SDK) never imports ``envbuild.defs``, ``envbuild.plan``,
``envbuild.build`` or ``envbuild.cli``: a training job runs sandboxes without the definition,
planning and build machinery. ``envbuild.layers`` and ``envbuild.store`` never import
``runtime_shim``: they are the foundation both sides stand on.

Every import statement of every module counts, at any depth (function-level imports included,
``if TYPE_CHECKING:`` ones too), with relative imports resolved. Known violations are listed in
``KNOWN`` by module and target, each with who fixes it; a listed violation that no longer exists
fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

RULES: dict[str, tuple[str, ...]] = {
    "runtime_shim": ("envbuild.defs", "envbuild.plan", "envbuild.build", "envbuild.cli"),
    "envbuild.layers": ("runtime_shim",),
    "envbuild.store": ("runtime_shim",),
}

#: (module, imported module) -> why it is still there and who removes it.
KNOWN: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in ``path``; ``from a import b`` yields ``a`` and
    ``a.b`` (``b`` may be a submodule)."""
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
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations() -> dict[tuple[str, str], list[str]]:
    """(module, banned package it reaches) -> ["path:line imports x", ...]."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted([*REPO.glob("envbuild/**/*.py"), *REPO.glob("runtime_shim/**/*.py")]):
        name = module_name(path)
        for owner, banned in RULES.items():
            if not _within(name, owner):
                continue
            for line, target in imported_modules(path):
                for prefix in banned:
                    if _within(target, prefix):
                        # Report the module imported (drop a trailing imported name).
                        key = (name, target if (REPO / (target.replace(".", "/") + ".py"))
                               .exists() else target.rpartition(".")[0])
                        found.setdefault(key, []).append(
                            f"{path.relative_to(REPO)}:{line} imports {target}")
    return found


def test_the_dependency_rule_holds():
    new = {k: v for k, v in violations().items() if k not in KNOWN}
    assert new == {}, "imports that break the dependency rule (see this module's docstring)"


def test_every_known_exception_still_exists():
    # A fixed violation must leave KNOWN too, so the exceptions never hide a silent pass.
    assert set(KNOWN) <= set(violations()), set(KNOWN) - set(violations())


def test_the_checker_sees_function_level_and_relative_imports():
    src = ("import os\n"
           "def f():\n"
           "    if True:\n"
           "        from envbuild.build import executor\n"
           "    from ..plan import graph\n")
    seen = list(imports_in(src, "envbuild.store"))
    assert (4, "envbuild.build.executor") in seen
    assert (5, "envbuild.plan.graph") in seen


def test_envbuild_jobs_uses_only_public_names_of_envbuild_defs():
    """The job-manifest loader shares the definition loader's YAML builder and error wording
    through public names (issue 12, item 7), not ``_private`` ones."""
    private = [f"{path.relative_to(REPO)}:{line} imports {target}"
               for path in sorted(REPO.glob("envbuild/jobs/*.py"))
               for line, target in imported_modules(path)
               if _within(target, "envbuild.defs") and target.rpartition(".")[2].startswith("_")]
    assert private == []
