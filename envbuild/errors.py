"""The one exception tree of envbuild and runtime_shim.

Every error a user can cause is an ``EnvbuildError``. The CLI boundary (``envbuild.cli.main``)
turns it into a one-line cause plus an optional hint on stderr and exit code 1; anything else is a
bug and exits 2 with a traceback and a request to report it.

::

    EnvbuildError                  reference, message, hint, context
    ├── SettingsError              bad flag, environment variable or store URL
    │   └── SizeError              not a size (envbuild.sizes); also a RuntimeShimError
    ├── DefinitionError            one or more problems in envdefs/ (each a ``Problem``)
    │   ├── PlanError              graph problems: cycles, missing references, ABI mismatches
    │   └── JobManifestError       problems in a job manifest (envbuild.jobs.load)
    ├── SourceError                a source cannot be read or hashed (path, git, archive)
    ├── LayerError                 a layer blob cannot be written or read
    │   ├── CorruptLayerError      truncated, tampered, wrong magic, digest mismatch
    │   ├── UnsupportedFormatError a format version this reader does not know
    │   └── UnsafeLayerError       a member that would escape the root, or is refused by policy
    │       └── SnapshotRefused    (also a RuntimeShimError, see below)
    ├── StoreError                 the store failed an operation
    │   ├── BlobNotFound           no blob with that digest
    │   ├── RefNotFound            no ref with that name
    │   ├── RefConflict            a compare-and-swap ref update lost (envbuild.store.base)
    │   ├── DigestMismatch         bytes do not hash to the digest they were stored under
    │   └── StoreUnavailable       the store cannot be reached or opened
    ├── BuildError                 a build step or importer failed
    │   └── StepFailed             a ``run`` step exited non-zero (argv, exit code, output tail)
    └── RuntimeShimError           sandboxes: fetch, compose, launch, exec (the SDK's root)
        ├── LockNotFound           no lock by that ref or digest in the store (also a
        │                          RefNotFound): raised before anything is created on disk
        ├── SandboxNotFound        no sandbox with that id on this node (attach, rm)
        ├── NodeLost               a fleet node daemon died or stopped answering: its
        │                          sandboxes are gone with it (runtime_shim.fleet)
        ├── FleetUnavailable       the Ray cluster cannot be reached, or no node of it runs
        │                          a fleet daemon (runtime_shim.fleet)
        ├── SandboxStartError      the sandbox was composed but did not start (runc or QEMU
        │                          exited, the agent never answered); nothing of it is left
        ├── BackendUnavailable     the backend is unknown, cannot run here (no runc, no QEMU),
        │                          or cannot do what was asked (keep/attach a microVM)
        ├── AdmissionRefused       the node's budget (file table, tasks, disk) has no room
        │                          for this sandbox or build disk (runtime_shim.node.admission)
        ├── SandboxClosed          a method of a sandbox that was closed (or reaped at its TTL)
        ├── PortRefused            nothing listens on that port inside the sandbox
        │                          (``connect_port``); also a ConnectionRefusedError
        ├── ExecTimeout            a command ran past its timeout, raised only for
        │                          ``exec(..., check_timeout=True)`` (else ``timed_out``)
        ├── SnapshotRefused        pack-diff policy: a sandbox's changes exceed a size cap or
        │                          hold links out of the upper dir (runtime_shim.node.packdiff);
        │                          also an UnsafeLayerError
        ├── CheckpointRefused      a memory checkpoint cannot be taken (a process CRIU cannot
        │                          dump: named, with the reason) or restored (an image that
        │                          does not match envbuild's record of it); nothing is left
        └── SandboxCompromised     the exec channel broke the protocol (a forged, short or
                                   out-of-order frame): nothing it said is trusted

Messages are written for the person at the terminal: say what failed and on what, lower case,
no trailing period; put what to do about it in ``hint``. Wrap lower-level errors with a short
"verb object: cause" (``raise StoreError(f"rename temporary blob: {e}") from e``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any


class EnvbuildError(Exception):
    """Root of every error envbuild reports to a user.

    ``reference`` is a stable kebab-case name for the error class (for docs and scripts),
    ``message`` the one-line cause, ``hint`` what to do about it, ``context`` extra lines
    (such as the tail of a failed command's output) printed after the cause.
    """

    reference = "envbuild-error"

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        context: str | None = None,
        reference: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.context = context
        if reference is not None:
            self.reference = reference

    def __str__(self) -> str:
        return self.message

    def render_lines(self) -> list[str]:
        """The lines the CLI prints: cause first, then context, then the hint."""
        lines = [f"error: {self.message}"]
        if self.context:
            lines.extend(self.context.rstrip("\n").splitlines())
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return lines


class SettingsError(EnvbuildError):
    reference = "settings-error"


@dataclasses.dataclass(frozen=True, order=True)
class Problem:
    """One problem found in a definition file.

    Sorted by (file, line, column) so reports are stable. ``path`` is the location inside the
    YAML document, such as ``steps[2].run``; ``line`` and ``column`` are 1-based (0 = unknown).
    """

    file: str
    line: int
    column: int
    message: str
    path: str = ""
    hint: str | None = None

    def render(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}" if self.line else self.file
        text = f"{where}: {self.message}"
        if self.path:
            text += f" (at {self.path})"
        if self.hint:
            text += f" — {self.hint}"
        return text


class DefinitionError(EnvbuildError):
    """Problems in definition files; all of them are collected before this is raised."""

    reference = "definition-error"

    def __init__(self, problems: list[Problem] | Problem, *, hint: str | None = None) -> None:
        if isinstance(problems, Problem):
            problems = [problems]
        self.problems = sorted(problems)
        count = len(self.problems)
        summary = f"{count} problem{'s' if count != 1 else ''} in definitions"
        super().__init__(summary, hint=hint)

    def render_lines(self) -> list[str]:
        lines = [p.render() for p in self.problems]
        lines.append(f"error: {self.message}")
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return lines


class PlanError(DefinitionError):
    """Problems in the graph of definitions (cycles, missing references, ABI mismatches).

    A subclass of ``DefinitionError`` because each one is reported against a definition file and
    line, in the same one-line-per-problem format.
    """

    reference = "plan-error"


class SourceError(EnvbuildError):
    reference = "source-error"


class LayerError(EnvbuildError):
    reference = "layer-error"


class CorruptLayerError(LayerError):
    reference = "corrupt-layer"


class UnsupportedFormatError(LayerError):
    reference = "unsupported-format"


class UnsafeLayerError(LayerError):
    reference = "unsafe-layer"


class StoreError(EnvbuildError):
    reference = "store-error"


class BlobNotFound(StoreError):
    reference = "blob-not-found"


class RefNotFound(StoreError):
    reference = "ref-not-found"


class DigestMismatch(StoreError):
    reference = "digest-mismatch"


class StoreUnavailable(StoreError):
    reference = "store-unavailable"


class BuildError(EnvbuildError):
    reference = "build-error"


class StepFailed(BuildError):
    """A ``run`` step exited non-zero. Carries the argv, exit code and the tail of its output."""

    reference = "step-failed"

    def __init__(
        self,
        message: str,
        *,
        argv: list[str],
        exit_code: int,
        output_tail: str,
        log_path: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.argv = argv
        self.exit_code = exit_code
        self.output_tail = output_tail
        self.log_path = log_path
        if hint is None and log_path:
            hint = f"full log: {log_path}"
        super().__init__(message, hint=hint, context=output_tail)


class RuntimeShimError(EnvbuildError):
    reference = "runtime-shim-error"


class SizeError(SettingsError, RuntimeShimError):
    """A value that is not a size (``envbuild.sizes.parse_size``): a setting's or the runtime's
    (a limit, a snapshot cap), so code that handles either catches it."""

    reference = "not-a-size"


class LockNotFound(RuntimeShimError, RefNotFound):
    """No lock by that ref or digest in the store; a ``RefNotFound`` too, so code that handles
    a missing ref of the store catches it."""

    reference = "lock-not-found"


class SandboxNotFound(RuntimeShimError):
    reference = "sandbox-not-found"


class NodeLost(RuntimeShimError):
    """A fleet node (its daemon actor, ``runtime_shim.fleet``) died or did not answer in
    time; ``node_id`` names it. Its sandboxes are lost with it."""

    reference = "node-lost"

    def __init__(self, message: str, *, node_id: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.node_id = node_id


class FleetUnavailable(RuntimeShimError):
    """The fleet's Ray cluster cannot be reached, or none of its nodes runs a daemon."""

    reference = "fleet-unavailable"


class SandboxStartError(RuntimeShimError):
    reference = "sandbox-start-error"


class BackendUnavailable(RuntimeShimError):
    reference = "backend-unavailable"


class AdmissionRefused(RuntimeShimError):
    """The node cannot take this sandbox (or build disk) within its budget of a host-wide
    table: the message names the budget, the hint what to change. Nothing was created."""

    reference = "admission-refused"


class SandboxClosed(RuntimeShimError):
    reference = "sandbox-closed"


class PortRefused(RuntimeShimError, ConnectionRefusedError):
    """``Sandbox.connect_port``: nothing listens on that port inside the sandbox. Also a
    ``ConnectionRefusedError``, so code written for sockets catches it."""

    reference = "port-refused"


class ExecTimeout(RuntimeShimError):
    """A command ran past its timeout and its caller asked for an exception
    (``exec(..., check_timeout=True)``); ``result`` is the ``ExecResult`` (output so far)."""

    reference = "exec-timeout"

    # Any: the ExecResult lives in runtime_shim.node.model, a room above this module
    def __init__(self, message: str, *, result: Any = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.result = result


class SnapshotRefused(RuntimeShimError, UnsafeLayerError):
    """pack-diff's policy refused a sandbox's changes (``runtime_shim.node.packdiff``)."""

    reference = "snapshot-refused"


class CheckpointRefused(RuntimeShimError):
    """A checkpoint with memory (``Sandbox.checkpoint`` / ``restore`` / ``fork``) was refused:
    the dump failed (the process and the reason are in the message), or an image does not
    match the record envbuild made when it dumped it."""

    reference = "checkpoint-refused"


class SandboxCompromised(RuntimeShimError):
    """What came back on a sandbox's exec channel is not what the agent sends: the result of
    that exec (and of the sandbox) must not be trusted (``runtime_shim/isolation/agent/README.md``)."""

    reference = "sandbox-compromised"


def bug(message: str) -> AssertionError:
    """An invariant was violated: envbuild itself is wrong. Raise the returned error."""
    import platform  # only for this message: keeps it out of every CLI start-up

    from envbuild._version import __version__

    return AssertionError(
        f"{message}\nthis is a bug in envbuild {__version__} "
        f"(python {sys.version.split()[0]}, {platform.platform()}); please report it"
    )
