"""``AsyncSandbox``: the SDK for asyncio programs (RL rollouts drive sandboxes from one loop).

It wraps a ``Sandbox`` and shares its code: the same backend handle, request building and
result checks; ``exec`` is the same agent exchange (``runtime_shim.isolation.agent._Exchange``) waited on
with the event loop's ``add_reader``/``add_writer`` instead of ``poll(2)``, so one loop drives
any number of execs without a thread each. ``start`` runs a command that outlives the call
(``runtime_shim.sdk.process.AsyncProcess``: stdin, signals, wait). ``create``, ``close`` and
file access are blocking host work (fetching layers, mounting, runc, the microVM's file
execs) and run in the loop's default thread executor.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from runtime_shim.backends.base import StatelessCalls
from runtime_shim.isolation import agent
from runtime_shim.node.model import ExecResult, SandboxInfo, SandboxUsage
from runtime_shim.sdk.filestream import AsyncWriter
from runtime_shim.sdk.process import AsyncProcess
from runtime_shim.sdk.sandbox import Sandbox

if TYPE_CHECKING:
    from runtime_shim.isolation.watch import DirWatch
    from runtime_shim.node.locks import ResolvedLock
    from runtime_shim.node.packdiff import SnapshotResult
    from runtime_shim.sdk.checkpoint import CheckpointResult


class AsyncSandbox:
    """A ``Sandbox`` whose methods are coroutines. ``async with`` closes it."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sync = sandbox

    @property
    def id(self) -> str:
        return self.sync.id

    @property
    def lock(self) -> ResolvedLock:
        return self.sync.lock

    @classmethod
    async def create(cls, lock: str, **kwargs: Any) -> AsyncSandbox:
        """``Sandbox.create`` (same arguments) in the default executor."""
        loop = asyncio.get_running_loop()
        sb = await loop.run_in_executor(None, functools.partial(Sandbox.create, lock, **kwargs))
        return cls(sb)

    @classmethod
    async def attach(cls, sandbox_id: str, **kwargs: Any) -> AsyncSandbox:
        loop = asyncio.get_running_loop()
        sb = await loop.run_in_executor(None, functools.partial(Sandbox.attach, sandbox_id,
                                                                **kwargs))
        return cls(sb)

    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   user: str | None = None, stdin: bytes | None = None,
                   on_stdout: agent.OutputCallback | None = None,
                   on_stderr: agent.OutputCallback | None = None,
                   check_timeout: bool = False) -> ExecResult:
        """``Sandbox.exec`` on the event loop (callbacks run in the loop's thread)."""
        sb = self.sync
        # a stateless backend (fncall): every exec is a call wrapped in the sandbox's reset
        # (blocking host work; the callbacks then run in an executor thread)
        if isinstance(sb._backend, StatelessCalls):
            return await asyncio.get_running_loop().run_in_executor(None, functools.partial(
                sb.exec, cmd, timeout=timeout, env=env, cwd=cwd, user=user, stdin=stdin,
                on_stdout=on_stdout, on_stderr=on_stderr, check_timeout=check_timeout))
        req = sb._request(cmd, timeout=timeout, env=env, cwd=cwd, user=user, stdin=stdin)
        started = time.monotonic()
        handle = sb._backend
        done = await agent.run_async(handle.connect, req, handle.limits.output_bytes,
                                     deadline=handle.limits.exec_timeout, on_stdout=on_stdout,
                                     on_stderr=on_stderr)
        return sb._result(done, started, check_timeout)

    async def start(self, cmd: str | Sequence[str], *, timeout: float | None = None,
                    env: Mapping[str, str] | None = None, cwd: str | None = None,
                    user: str | None = None, stdin: bytes | None = None,
                    on_stdout: agent.OutputCallback | None = None,
                    on_stderr: agent.OutputCallback | None = None,
                    pty: tuple[int, int] | None = None, detachable: bool = False
                    ) -> AsyncProcess:
        """Start ``cmd`` and return at once: an ``AsyncProcess`` whose stdin stays open
        (``stdin`` is written first), which can be signalled and waited for
        (``runtime_shim.sdk.process``). ``timeout``, ``pty`` and ``detachable`` as
        ``Sandbox.start``'s."""
        sb = self.sync
        session = sb._open_session(cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                                   stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr,
                                   pty=pty, detachable=detachable)
        return AsyncProcess(session, lambda done, started: sb._result(done, started, False))

    async def reattach(self, detach_id: int, *, on_stdout: agent.OutputCallback | None = None,
                       on_stderr: agent.OutputCallback | None = None,
                       pty: tuple[int, int] | None = None, timeout: float | None = None
                       ) -> AsyncProcess:
        """``Sandbox.reattach`` on the event loop: an ``AsyncProcess``."""
        sb = self.sync
        req = agent.ExecRequest(argv=(), attach=detach_id, pty=pty, timeout=timeout)
        return AsyncProcess(sb._connect_session(req, on_stdout, on_stderr),
                            lambda done, started: sb._result(done, started, False))

    async def connect_port(self, port: int, timeout: float = 10.0) -> socket.socket:
        """``Sandbox.connect_port`` in the default executor; the socket is non-blocking, for
        ``loop.create_connection(..., sock=)`` or ``asyncio.open_connection(sock=)``."""
        sock = await asyncio.get_running_loop().run_in_executor(
            None, self.sync.connect_port, port, timeout)
        sock.setblocking(False)
        return sock

    async def call(self, argv: str | Sequence[str], **kwargs: Any) -> ExecResult:
        """``Sandbox.call`` (an fncall sandbox's stateless call) in the default executor."""
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.sync.call, argv, **kwargs))

    async def read_file(self, path: str) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(None, self.sync.read_file, path)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.sync.write_file, path, data,
                                                         mode)

    async def read_stream(self, path: str) -> BinaryIO:
        """``Sandbox.read_stream`` opened in the default executor; read it there too, or
        ``loop.sendfile`` it to a socket."""
        return await asyncio.get_running_loop().run_in_executor(None, self.sync.read_stream,
                                                                path)

    async def write_stream(self, path: str, mode: int = 0o644, user: str | None = None,
                           hold: int = 0) -> AsyncWriter:
        """``Sandbox.write_stream`` for asyncio (``runtime_shim.sdk.filestream.AsyncWriter``)."""
        return AsyncWriter(await asyncio.get_running_loop().run_in_executor(
            None, self.sync.write_stream, path, mode, user, hold))

    async def pack_diff(self, publish: str | None = None, **kwargs: Any) -> SnapshotResult:
        """``Sandbox.pack_diff`` in the default executor."""
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.sync.pack_diff, publish, **kwargs))

    async def watch(self, path: str, *, recursive: bool = False) -> DirWatch:
        """``Sandbox.watch`` in the default executor; wait with ``await w.next_events()``."""
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.sync.watch, path, recursive=recursive))

    async def set_network(self, network: bool | Sequence[str]) -> None:
        """``Sandbox.set_network`` in the default executor."""
        await asyncio.get_running_loop().run_in_executor(None, self.sync.set_network, network)

    async def checkpoint(self, publish: str | None = None, *,
                         leave_running: bool = False) -> CheckpointResult:
        """``Sandbox.checkpoint`` in the default executor."""
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.sync.checkpoint, publish, leave_running=leave_running))

    @classmethod
    async def restore(cls, checkpoint: str, **kwargs: Any) -> AsyncSandbox:
        """``Sandbox.restore`` (same arguments) in the default executor."""
        loop = asyncio.get_running_loop()
        sb = await loop.run_in_executor(None, functools.partial(Sandbox.restore, checkpoint,
                                                                **kwargs))
        return cls(sb)

    async def fork(self, n: int, **kwargs: Any) -> list[AsyncSandbox]:
        """``Sandbox.fork`` in the default executor."""
        children = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.sync.fork, n, **kwargs))
        return [AsyncSandbox(c) for c in children]

    async def info(self) -> SandboxInfo:
        return self.sync.info()

    async def usage(self) -> SandboxUsage:
        """``Sandbox.usage`` in the default executor (file reads and an ioctl)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.sync.usage)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.sync.close)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.sync!r}>"


__all__ = ["AsyncSandbox"]
