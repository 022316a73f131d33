"""The sandbox protocols: what every sandbox class of the SDK offers, one declaration each.

``SandboxAPI`` is implemented by ``Sandbox`` (this node) and ``runtime_shim.fleet``'s
``FleetSandbox`` (a node of a Ray fleet); ``AsyncSandboxAPI`` by ``AsyncSandbox`` and
``AsyncFleetSandbox``. Code written against a protocol runs on either, and
``tests/unit/test_sandbox_protocol.py`` checks that every class keeps every signature (names,
kinds and defaults of the parameters) exactly as declared here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from runtime_shim.isolation.agent import OutputCallback
from runtime_shim.node.model import ExecResult, SandboxInfo


@runtime_checkable
class SandboxAPI(Protocol):
    """A running sandbox, driven from a blocking program."""

    id: str

    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             user: str | None = None, stdin: bytes | None = None,
             on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None,
             check_timeout: bool = False) -> ExecResult:
        """Run ``cmd`` (a string through ``/bin/sh -c``) and wait for it."""
        ...

    def read_file(self, path: str) -> bytes:
        """A regular file of the sandbox, resolved inside its root."""
        ...

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Create or replace a regular file of the sandbox."""
        ...

    def set_network(self, network: bool | Sequence[str]) -> None:
        """Change what the running sandbox may reach (as ``SandboxOptions.network``)."""
        ...

    def pack_diff(self, publish: str | None = None, **kwargs: Any) -> Any:
        """The sandbox's changes as a new layer and lock (``runtime_shim.node.packdiff``)."""
        ...

    def info(self) -> SandboxInfo:
        """What the sandbox is (its node's record of it)."""
        ...

    def close(self) -> None:
        """Remove the sandbox and everything it holds; safe to call twice."""
        ...


@runtime_checkable
class AsyncSandboxAPI(Protocol):
    """``SandboxAPI`` for asyncio programs: the same methods, awaited."""

    id: str

    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   user: str | None = None, stdin: bytes | None = None,
                   on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None,
                   check_timeout: bool = False) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None: ...

    async def set_network(self, network: bool | Sequence[str]) -> None: ...

    async def pack_diff(self, publish: str | None = None, **kwargs: Any) -> Any: ...

    async def info(self) -> SandboxInfo: ...

    async def close(self) -> None: ...
