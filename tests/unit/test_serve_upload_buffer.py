"""``envbuild serve``'s upload over an existing file gathers the part in a reused buffer of
``files.HOLD`` and lends it to the writer: the buffer goes back for the next upload only once
the writer is done with it — never when the request is cancelled while its commit still runs
in the executor (the next upload would write into the bytes being committed)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from envbuild.serve import files
from runtime_shim.sdk.filestream import AsyncWriter


class _Writer:
    """A held write whose commit waits for ``release``."""

    holding = True

    def __init__(self) -> None:
        self.written, self.got = 0, b""
        self.committing, self.release = threading.Event(), threading.Event()

    def write(self, data, *, lent: bool = False) -> None:
        assert lent, "a gathered part is lent whole"
        self.got += bytes(data)

    def commit(self) -> None:
        self.committing.set()
        self.release.wait(10)

    def abort(self) -> None:
        pass


def _store(writer: _Writer, pieces: list[bytes]):
    async def write_stream(path, user=None, hold=0):
        return AsyncWriter(writer)

    async def read() -> bytes:
        return pieces.pop(0) if pieces else b""

    entry = SimpleNamespace(sandbox=SimpleNamespace(write_stream=write_stream))
    return files._store(read, entry, "/f", SimpleNamespace(spec=None), 0, (1 << 20, 1000))


@pytest.fixture
def hold(monkeypatch):
    budget = files.HoldBudget(total=4 << 20, one=1 << 20)
    monkeypatch.setattr(files, "HOLD", budget)
    return budget


def test_a_finished_upload_gives_its_buffer_back(hold):
    writer = _Writer()
    writer.release.set()
    assert asyncio.run(_store(writer, [b"ab", b"cd"])) == 4
    assert writer.got == b"abcd"
    assert len(hold.idle) == 1


def test_a_cancelled_upload_never_gives_back_a_buffer_still_being_committed(hold):
    writer = _Writer()

    async def main() -> None:
        task = asyncio.ensure_future(_store(writer, [b"ab"]))
        await asyncio.get_running_loop().run_in_executor(None, writer.committing.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert hold.idle == []  # the commit still reads it
        writer.release.set()

    asyncio.run(main())
