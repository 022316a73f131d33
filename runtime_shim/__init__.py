"""runtime_shim: the sandbox SDK. Turns locks into running, isolated, disposable sandboxes.

::

    from runtime_shim import Sandbox
    with Sandbox.create("env/NAME", store="cache", ttl=600) as sb:
        print(sb.exec("make test", on_stdout=print).exit_code)

    from runtime_shim import AsyncSandbox
    async with await AsyncSandbox.create("env/NAME") as sb:
        result = await sb.exec("pytest -q")

The names below are the public API (``__all__``, pinned by tests/unit/test_sdk_exports.py);
everything else in the package is internal. They are imported on first use, so
``import runtime_shim.node.nodecache`` (as the CLI does) does not load the sandbox code.

Imports only envbuild.layers, envbuild.store, envbuild.errors, envbuild.safefs and
envbuild.settings (the dependency rule, docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from envbuild._lazy import lazy_exports

__all__ = [
    "AdmissionRefused",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSandboxAPI",
    "AsyncShellSession",
    "BackendUnavailable",
    "CheckpointRefused",
    "ExecResult",
    "ExecTimeout",
    "FnPool",
    "Limits",
    "LockNotFound",
    "PortRefused",
    "Process",
    "RuntimeShimError",
    "Sandbox",
    "SandboxAPI",
    "SandboxClosed",
    "SandboxCompromised",
    "SandboxInfo",
    "SandboxNotFound",
    "SandboxOptions",
    "SandboxStartError",
    "SandboxUsage",
    "ShellSession",
    "SnapshotRefused",
    "Verdict",
    "grade",
    "grade_async",
    "list_sandboxes",
    "remove_sandbox",
    "sweep_sandboxes",
]

_WHERE = {
    "AsyncProcess": "runtime_shim.sdk.process",
    "AsyncSandbox": "runtime_shim.sdk.aio",
    "ExecResult": "runtime_shim.node.model",
    "FnPool": "runtime_shim.sdk.fnpool",
    "Limits": "runtime_shim.node.model",
    "Process": "runtime_shim.sdk.process",
    "SandboxInfo": "runtime_shim.node.model",
    "SandboxUsage": "runtime_shim.node.model",
    "Sandbox": "runtime_shim.sdk.sandbox",
    "SandboxOptions": "runtime_shim.sdk.options",
    "SandboxAPI": "runtime_shim.sdk.protocol",
    "ShellSession": "runtime_shim.sdk.session",
    "AsyncShellSession": "runtime_shim.sdk.session",
    "AsyncSandboxAPI": "runtime_shim.sdk.protocol",
    "list_sandboxes": "runtime_shim.sdk.sandbox",
    "Verdict": "runtime_shim.grading.verdict",
    "grade": "runtime_shim.grading.grader",
    "grade_async": "runtime_shim.grading.aio",
    "remove_sandbox": "runtime_shim.sdk.sweep",
    "sweep_sandboxes": "runtime_shim.sdk.sweep",
    **{name: "envbuild.errors" for name in (
        "AdmissionRefused", "BackendUnavailable", "CheckpointRefused", "ExecTimeout",
        "LockNotFound", "PortRefused", "RuntimeShimError",
        "SandboxClosed", "SandboxCompromised", "SandboxNotFound", "SandboxStartError",
        "SnapshotRefused")},
}

if TYPE_CHECKING:
    from envbuild.errors import (
        AdmissionRefused,
        BackendUnavailable,
        CheckpointRefused,
        ExecTimeout,
        LockNotFound,
        PortRefused,
        RuntimeShimError,
        SandboxClosed,
        SandboxCompromised,
        SandboxNotFound,
        SandboxStartError,
        SnapshotRefused,
    )
    from runtime_shim.grading.aio import grade_async
    from runtime_shim.grading.grader import grade
    from runtime_shim.grading.verdict import Verdict
    from runtime_shim.node.model import ExecResult, Limits, SandboxInfo, SandboxUsage
    from runtime_shim.sdk.aio import AsyncSandbox
    from runtime_shim.sdk.fnpool import FnPool
    from runtime_shim.sdk.options import SandboxOptions
    from runtime_shim.sdk.process import AsyncProcess, Process
    from runtime_shim.sdk.protocol import AsyncSandboxAPI, SandboxAPI
    from runtime_shim.sdk.sandbox import Sandbox, list_sandboxes
    from runtime_shim.sdk.session import AsyncShellSession, ShellSession
    from runtime_shim.sdk.sweep import remove_sandbox, sweep_sandboxes


__getattr__, _ = lazy_exports(__name__, _WHERE)  # __dir__ below: the public names only


def __dir__() -> list[str]:
    return sorted(__all__)
