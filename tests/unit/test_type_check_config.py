"""The type check the test command runs (``pyproject.toml`` ``[tool.mypy]``, run by
``scripts/test.sh``) covers every package, and every module a public SDK name lives in
strictly: a new package or a new public name cannot slip out of it."""

from __future__ import annotations

import tomllib

import runtime_shim
from tests.layering import REPO, all_modules

#: mypy's --strict, as per-module flags (``strict`` itself is global-only); the global ones
#: (warn_unused_ignores, warn_redundant_casts) are checked in the [tool.mypy] section.
STRICT_FLAGS = {
    "disallow_any_generics", "disallow_incomplete_defs", "disallow_subclassing_any",
    "disallow_untyped_calls", "disallow_untyped_decorators", "disallow_untyped_defs",
    "extra_checks", "strict_equality", "warn_return_any",
}


def _mypy() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]


def _matches(pattern: str, module: str) -> bool:
    if pattern.endswith(".*"):  # mypy: the package and everything below it
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def _strict(module: str) -> bool:
    for override in _mypy().get("overrides", []):
        patterns = override["module"]
        if isinstance(patterns, str):
            patterns = [patterns]
        if any(_matches(p, module) for p in patterns):
            return all(override.get(flag) is True for flag in STRICT_FLAGS)
    return False


def test_every_package_is_type_checked_with_unannotated_bodies_too():
    config = _mypy()
    packages = sorted({name.partition(".")[0] for name in all_modules()})
    assert sorted(config["files"]) == packages
    assert "follow_imports" not in config  # every module reported, none checked silently
    for flag in ("check_untyped_defs", "warn_unused_ignores", "warn_redundant_casts"):
        assert config.get(flag) is True, flag


def test_every_module_of_a_public_sdk_name_is_checked_strictly():
    homes = {"runtime_shim"} | {getattr(runtime_shim, name).__module__
                                for name in runtime_shim.__all__}
    assert "runtime_shim.sdk.sandbox" in homes and "envbuild.errors" in homes
    assert sorted(m for m in homes if not _strict(m)) == []
