"""Files of a sandbox read and written in pieces: ``Sandbox.read_stream`` / ``write_stream``
and their ``AsyncSandbox`` forms.

``read_stream(path)`` is a binary file object of the sandbox's regular file (``read(n)``,
``readinto``, ``seek``, a context manager; ``os.fstat`` of its ``fileno()`` for the size, or
``loop.sendfile`` it to a socket). ``write_stream(path, mode, user)`` is a ``FileWriter``:
``write`` pieces, then ``commit`` finishes the file, ``abort`` (or an exception in its
``with`` block) leaves the path as it was (a new file is written under its name and removed
again; an existing one keeps its bytes until ``commit``); the file is owned by ``user``
(``"uid[:gid]"``, default the lock's user) from its creation, no ``chown`` after. Paths are
resolved inside the sandbox's root as for ``read_file`` / ``write_file``
(``runtime_shim.isolation.fsaccess``).

Memory stays bounded whatever the file's size on a backend whose handle has ``FileStreams``
(container, fncall). On the others (microVM) the stream is the whole file held in memory: the
reader is a ``BytesIO`` of ``read_file``, the writer collects its pieces and calls
``write_file`` at ``commit`` (so its owner is the lock's user: another ``user`` is refused).
"""

from __future__ import annotations

import asyncio
import functools
import io
import os
from typing import Any, BinaryIO

from envbuild.errors import BackendUnavailable, RuntimeShimError
from runtime_shim.backends.base import FileStreams, SandboxHandle
from runtime_shim.isolation.fsaccess import CommitOnExit, FileWriter
from runtime_shim.isolation.spec import parse_user


class BufferedWriter(CommitOnExit):
    """``FileWriter``'s interface over ``write_file`` (a backend without ``FileStreams``)."""

    def __init__(self, handle: SandboxHandle, path: str, mode: int) -> None:
        self._handle, self.path, self.mode = handle, path, mode
        self._buf: io.BytesIO | None = io.BytesIO()
        self.written = 0

    #: its pieces are copied into one buffer as they come (``FileWriter.holding``'s sense:
    #: no existing file's bytes wait for the commit)
    holding = False

    def write(self, data: bytes | bytearray | memoryview, *, lent: bool = False) -> None:
        if self._buf is None:
            raise RuntimeShimError(f"write {self.path} in sandbox: the write has ended")
        self.written += self._buf.write(data)

    def commit(self) -> None:
        if self._buf is None:
            raise RuntimeShimError(f"write {self.path} in sandbox: the write has ended")
        data, self._buf = self._buf.getvalue(), None
        self._handle.write_file(self.path, data, self.mode)

    def abort(self) -> None:
        self._buf = None


Writer = FileWriter | BufferedWriter


def read_stream(sandbox: Any, path: str) -> BinaryIO:
    """``Sandbox.read_stream(path)``: regular file ``path`` open for reading in pieces."""
    sandbox._check_open()
    return open_read(sandbox.handle, path)


def write_stream(sandbox: Any, path: str, mode: int = 0o644, user: str | None = None,
                 hold: int = 0) -> Writer:
    """``Sandbox.write_stream(path, mode, user, hold)``: ``path`` written in pieces, finished
    at ``commit``, owned by ``user`` (None: the lock's user); an existing file's new bytes
    are held in memory up to ``hold`` and written straight into it at ``commit`` (no hidden
    file unless they grow past it: the caller bounds its memory)."""
    sandbox._check_open()
    return open_write(sandbox.handle, path, mode, user, sandbox.lock.user, hold)


def open_read(handle: SandboxHandle, path: str) -> BinaryIO:
    """A handle's file open for reading in pieces (whole, without ``FileStreams``)."""
    if isinstance(handle, FileStreams):
        return os.fdopen(handle.open_read(path), "rb", buffering=0)
    return io.BytesIO(handle.read_file(path))


def open_write(handle: SandboxHandle, path: str, mode: int, user: str | None,
               lock_user: str | None, hold: int = 0) -> Writer:
    """A handle's writer of ``path`` owned by ``user`` (None: ``lock_user``)."""
    uid, gid = parse_user(user or lock_user)
    if isinstance(handle, FileStreams):
        return handle.open_write(path, mode, uid, gid, hold)
    if user is not None and (uid, gid) != parse_user(lock_user):
        raise BackendUnavailable(f"write {path}: this backend writes files as the lock's user "
                                 f"only, not {user}",
                                 hint="write it, then exec chown; or use a container sandbox")
    return BufferedWriter(handle, path, mode)


class AsyncWriter:
    """A ``Writer`` for asyncio: each step in the default executor. ``async with``: committed
    when the block ends, aborted when it raises."""

    def __init__(self, writer: Writer) -> None:
        self.sync = writer

    @property
    def written(self) -> int:
        return self.sync.written

    @property
    def holding(self) -> bool:
        return self.sync.holding

    async def write(self, data: bytes | bytearray | memoryview, *, lent: bool = False) -> None:
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.sync.write, data, lent=lent))

    async def commit(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.sync.commit)

    async def abort(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.sync.abort)

    async def __aenter__(self) -> AsyncWriter:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            await self.commit()
        else:
            await self.abort()
