"""The public API of ``runtime_shim`` is exactly ``__all__`` (as httpx's test_exported_members)."""

from __future__ import annotations

import runtime_shim
import runtime_shim.node.packdiff  # noqa: F401
import runtime_shim.sdk.aio  # noqa: F401  (imported at collection: safefs loads libc, see conftest)
from envbuild import errors

EXPECTED = {
    "AdmissionRefused", "AsyncProcess", "AsyncSandbox", "AsyncSandboxAPI", "AsyncShellSession",
    "BackendUnavailable",
    "CheckpointRefused", "ExecResult", "ExecTimeout",
    "FnPool", "Limits", "LockNotFound", "PortRefused", "Process", "RuntimeShimError", "Sandbox",
    "SandboxAPI",
    "SandboxClosed", "SandboxCompromised", "SandboxInfo", "SandboxNotFound", "SandboxOptions",
    "SandboxStartError", "SandboxUsage", "ShellSession", "SnapshotRefused", "Verdict", "grade", "grade_async",
    "list_sandboxes",
    "remove_sandbox", "sweep_sandboxes",
}


def test_exported_members_are_all():
    assert set(runtime_shim.__all__) == EXPECTED
    assert sorted(runtime_shim.__all__) == runtime_shim.__all__
    exported = {name for name in dir(runtime_shim) if not name.startswith("_")}
    assert exported == EXPECTED


def test_every_export_resolves_and_says_where_it_lives():
    for name in runtime_shim.__all__:
        value = getattr(runtime_shim, name)
        assert value.__module__.startswith(("runtime_shim", "envbuild.errors")), name
        assert value.__doc__ or isinstance(value, type), name


def test_the_package_imports_its_exports_lazily():
    # ``import runtime_shim.node.nodecache`` (the CLI) must not load the sandbox code: the package
    # itself imports nothing of it at module level
    import ast
    import inspect

    import envbuild._lazy as lazy

    def top_imports(module) -> set[str]:
        tree = ast.parse(inspect.getsource(module))
        return {getattr(n, "module", None) or n.names[0].name for n in tree.body
                if isinstance(n, (ast.Import, ast.ImportFrom))}

    assert top_imports(runtime_shim) <= {"__future__", "envbuild._lazy", "typing"}
    # the lazy-export helper itself imports only the standard library
    assert top_imports(lazy) <= {"__future__", "importlib", "sys", "collections.abc", "typing"}


def test_sdk_errors_sit_under_runtime_shim_error():
    for cls in (errors.LockNotFound, errors.SandboxNotFound, errors.SandboxStartError,
                errors.BackendUnavailable, errors.SandboxClosed, errors.ExecTimeout,
                errors.SnapshotRefused, errors.SandboxCompromised):
        assert issubclass(cls, errors.RuntimeShimError), cls
        assert cls.reference != errors.RuntimeShimError.reference
    assert issubclass(errors.LockNotFound, errors.RefNotFound)
    assert issubclass(errors.SnapshotRefused, errors.UnsafeLayerError)
    from runtime_shim.node import packdiff

    assert packdiff.SnapshotRefused is errors.SnapshotRefused


def test_error_tree_docstring_names_every_sdk_error():
    for cls in ("LockNotFound", "SandboxNotFound", "SandboxStartError", "BackendUnavailable",
                "SandboxClosed", "ExecTimeout", "SnapshotRefused", "SandboxCompromised"):
        assert f"── {cls}" in errors.__doc__, cls
