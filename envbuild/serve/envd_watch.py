"""envd's directory watching: ``WatchDir`` (a server stream: a start event, then the events,
with a keepalive every ``KEEPALIVE`` seconds of silence) and its polling variant
(``CreateWatcher`` / ``GetWatcherEvents`` / ``RemoveWatcher``), over ``Sandbox.watch``
(``runtime_shim.isolation.watch``: inotify on the sandbox's tree from the host, never
following a symlink below the watched directory).

The watched directory is checked first in the sandbox as the requesting user (it must be a
directory the user may read and enter), so the sandbox's permissions decide, as with E2B's
envd. Bounds: ``MAX_WATCHERS`` watches (streams and watchers) per sandbox, ``MAX_PENDING``
events kept for a watcher between two polls (then an overflow ends it: E2B's envd drops a
watcher whose events are not read too), the watches of one recursive watch
(``runtime_shim``'s ``max_watches``). A sandbox's watches end when it is killed or paused.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as pb
from protobuf import Oneof

from envbuild.serve.sandboxes import Entry

MAX_WATCHERS = 64
MAX_PENDING = 4096
KEEPALIVE = 30.0
_TYPES = {"create": pb.EventType.CREATE, "write": pb.EventType.WRITE,
          "remove": pb.EventType.REMOVE, "rename": pb.EventType.RENAME,
          "chmod": pb.EventType.CHMOD}


def _response(name: str, value: Any) -> pb.WatchDirResponse:
    return pb.WatchDirResponse(event=Oneof(name, value))  # type: ignore[arg-type]


def _events(raw: list[Any]) -> list[pb.FilesystemEvent]:
    """E2B's events of ``runtime_shim`` ones; an overflow ends the watch."""
    out = []
    for e in raw:
        if e.kind == "overflow":
            raise ConnectError(Code.RESOURCE_EXHAUSTED, "watch overflowed: events were lost "
                               "(too many, or too many directories); watch again")
        out.append(pb.FilesystemEvent(name=e.name, type=_TYPES[e.kind]))
    return out


class _Polled:
    """A polling watcher's watch, read as its events come (E2B's envd reads its watches so),
    not only when polled: a recursive watch then follows a new subdirectory before anything
    is written in it. The events wait for ``GetWatcherEvents``; past ``MAX_PENDING`` the
    reading stops (the poll then reports the overflow)."""

    def __init__(self, watch: Any) -> None:
        self.watch = watch
        self.events: list[Any] = []
        self.task = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        while len(self.events) <= MAX_PENDING:
            raw = await self.watch.next_events()
            if not raw and self.watch.fileno() < 0:  # closed
                return
            self._add(raw)

    def _add(self, raw: list[Any]) -> None:
        # an event equal to the last one kept is dropped, as the kernel merges it into the
        # unread last one of its queue (E2B's tests count a write's events)
        for event in raw:
            if not self.events or self.events[-1] != event:
                self.events.append(event)

    def read(self) -> list[Any]:
        self._add(self.watch.read())
        out, self.events = self.events, []
        return out

    def close(self) -> None:
        self.task.cancel()
        self.watch.close()


async def open_watch(entry: Entry, path: str, recursive: bool, *, polled: bool = False
                     ) -> tuple[str, Any]:
    """A new watch of ``path`` (absolute, checked by the caller) in ``entry``: its id and
    ``runtime_shim``'s ``DirWatch``, counted against ``MAX_WATCHERS``; ``polled``: a
    ``CreateWatcher`` watcher's (``_Polled``)."""
    if len(entry.watchers) >= MAX_WATCHERS:
        raise ConnectError(Code.RESOURCE_EXHAUSTED,
                           f"at most {MAX_WATCHERS} watches per sandbox")
    try:
        watch = await entry.sandbox.watch(path, recursive=recursive)
    except (FileNotFoundError, NotADirectoryError):
        raise ConnectError(Code.NOT_FOUND, f"no such directory: {path}") from None
    except OSError as e:
        raise ConnectError(Code.INTERNAL, f"watch {path}: {e.strerror}") from None
    watch_id = uuid.uuid4().hex
    entry.watchers[watch_id] = _Polled(watch) if polled else watch
    return watch_id, watch


def close_watch(entry: Entry, watch_id: str) -> None:
    watch = entry.watchers.pop(watch_id, None)
    if watch is not None:
        watch.close()


async def stream(entry: Entry, watch_id: str, watch: Any) -> AsyncIterator[pb.WatchDirResponse]:
    """``WatchDir``'s responses until the client leaves or the sandbox goes."""
    try:
        yield _response("start", pb.WatchDirResponse.StartEvent())
        while watch_id in entry.watchers:
            try:
                raw = await asyncio.wait_for(watch.next_events(), KEEPALIVE)
            except TimeoutError:
                yield _response("keepalive", pb.WatchDirResponse.KeepAlive())
                continue
            for event in _events(raw):
                yield _response("filesystem", event)
    finally:
        close_watch(entry, watch_id)


def poll(entry: Entry, watch_id: str) -> list[pb.FilesystemEvent]:
    """``GetWatcherEvents``: the events since the last poll (``NOT_FOUND`` for a watcher
    that is not this sandbox's; an overflow removes it)."""
    watch = entry.watchers.get(watch_id)
    if watch is None:
        raise ConnectError(Code.NOT_FOUND, f"no watcher {watch_id[:64]}")
    raw: list[Any] = []
    while len(raw) <= MAX_PENDING:
        more = watch.read()
        if not more:
            break
        raw.extend(more)
    try:
        if len(raw) > MAX_PENDING:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, "watch overflowed: more than "
                               f"{MAX_PENDING} events between two polls; watch again")
        return _events(raw)
    except ConnectError:
        close_watch(entry, watch_id)
        raise
