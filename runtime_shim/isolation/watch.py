"""Watching a directory inside a sandbox from the host: inotify on the sandbox's own tree.

``DirWatch.open(root, path)`` resolves ``path`` inside ``root`` (a host path that is the
sandbox's ``/``: ``/proc/<init>/root`` of a container, so its bind mounts such as ``/tmp`` are
seen as its commands see them) with ``openat2(RESOLVE_IN_ROOT)`` to an ``O_PATH`` fd, and
puts an inotify watch on that inode (through ``/proc/self/fd``: the path is never resolved
again, a symlink the sandbox swaps in later changes nothing). Changes made through the
sandbox's overlay and bind mounts are reported; nothing runs in the sandbox.

**Recursive** watches add the subdirectories found at the start and those created later,
each opened from its parent's fd without following a symlink (``open_beneath``: a symlink to
``/`` is never descended); at most ``max_watches`` of them.

**Bounds.** A sandbox controls the rate of events, so: the kernel queue is the host's
(``fs.inotify.max_queued_events``; an overflow is reported as an ``overflow`` event, not
lost silently), events are read at most ``READ_BYTES`` at a time, and the watches of one
``DirWatch`` are at most ``max_watches`` (more subdirectories are not watched; an
``overflow`` event says so once). A name is at most ``NAME_MAX`` bytes (the kernel's bound).

Events (``WatchEvent``): ``kind`` is ``create``, ``write``, ``remove``, ``rename`` (the old
name: E2B reports a rename's new name as a ``create``), ``chmod`` or ``overflow``; ``name`` is
the path relative to the watched directory (``/``-joined, never with ``..``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import os
import select
import struct

from envbuild.errors import RuntimeShimError
from envbuild.libc import function
from envbuild.safefs import open_beneath, open_in_root

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED, IN_ONLYDIR, IN_DONT_FOLLOW, IN_ISDIR = (
    0x4000, 0x8000, 0x01000000, 0x02000000, 0x40000000)
IN_EXCL_UNLINK = 0x04000000
_MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
         | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)
_HEADER = struct.Struct("iIII")
#: One read of the inotify fd at most (about 200 events of long names).
READ_BYTES = 64 << 10
DEFAULT_MAX_WATCHES = 1024

_init = function("inotify_init1", argtypes=[ctypes.c_int])
_add_watch = function("inotify_add_watch", argtypes=[ctypes.c_int, ctypes.c_char_p,
                                                      ctypes.c_uint32])


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    kind: str
    name: str


def _kind(mask: int) -> str | None:
    if mask & IN_Q_OVERFLOW:
        return "overflow"
    if mask & (IN_CREATE | IN_MOVED_TO):
        return "create"
    if mask & (IN_DELETE | IN_DELETE_SELF):
        return "remove"
    if mask & (IN_MOVED_FROM | IN_MOVE_SELF):
        return "rename"
    if mask & IN_MODIFY:
        return "write"
    if mask & IN_ATTRIB:
        return "chmod"
    return None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class DirWatch:
    """Inotify watches on one directory of a sandbox (see the module docstring): ``fileno``
    for a poll loop, ``read`` for the events ready, ``close``."""

    def __init__(self, fd: int, top: int, recursive: bool, max_watches: int) -> None:
        self._fd = fd
        self._top = top  # the watched directory (O_PATH), for the subdirectories made later
        self._recursive = recursive
        self._max = max_watches
        self._dirs: dict[int, str] = {}  # watch descriptor -> relative dir ("" is the top)
        self._overflowed = False
        self._pending: list[WatchEvent] = []
        # the loop and future of a ``next_events`` waiting on ``_fd`` (``close`` wakes it)
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    @classmethod
    def open(cls, root: str, path: str, *, recursive: bool = False,
             max_watches: int = DEFAULT_MAX_WATCHES) -> DirWatch:
        """Watch ``path`` (inside ``root``); ``FileNotFoundError`` / ``NotADirectoryError``
        if it is not a directory there."""
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            top = open_in_root(root_fd, path, os.O_PATH | os.O_DIRECTORY)
        finally:
            os.close(root_fd)
        fd = _init(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            os.close(top)
            raise RuntimeShimError(f"watch {path}: inotify_init1: {os.strerror(e)}",
                                   hint="fs.inotify.max_user_instances may be exhausted")
        watch = cls(fd, top, recursive, max(1, max_watches))
        try:
            watch._add(top, "")
        except BaseException:
            watch.close()
            raise
        return watch

    def _add(self, dir_fd: int, rel: str) -> None:
        """Watch the directory ``dir_fd`` (``rel`` below the top) and, if recursive, its
        subdirectories (iteratively, never through a symlink)."""
        todo = [(os.dup(dir_fd), rel)]
        while todo:
            fd, where = todo.pop()
            try:
                if len(self._dirs) >= self._max:
                    self._overflow()
                    continue
                wd = _add_watch(self._fd, f"/proc/self/fd/{fd}".encode(), _MASK)
                if wd < 0:
                    e = ctypes.get_errno()
                    if where == "":
                        raise RuntimeShimError(f"watch: inotify_add_watch: {os.strerror(e)}",
                                               hint="fs.inotify.max_user_watches may be "
                                                    "exhausted")
                    self._overflow()
                    continue
                self._dirs[wd] = where
                if self._recursive:
                    todo.extend(self._subdirs(fd, where))
            finally:
                os.close(fd)

    def _subdirs(self, fd: int, where: str) -> list[tuple[int, str]]:
        found = []
        with contextlib.suppress(OSError):
            listing = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for name in os.listdir(listing):
                    with contextlib.suppress(OSError):
                        sub = open_beneath(listing, name, os.O_PATH | os.O_DIRECTORY)
                        found.append((sub, f"{where}/{name}" if where else name))
                    if len(found) + len(self._dirs) > self._max:
                        break
            finally:
                os.close(listing)
        return found

    def _overflow(self) -> None:
        if not self._overflowed:
            self._overflowed = True
            self._pending.append(WatchEvent("overflow", ""))

    def fileno(self) -> int:
        return self._fd

    def wait(self, timeout: float | None = None) -> list[WatchEvent]:
        """The events ready, waiting up to ``timeout`` seconds (None: for ever) for one."""
        if not self._pending and self._fd >= 0:
            select.select([self._fd], [], [], timeout)
        return self.read()

    async def next_events(self) -> list[WatchEvent]:
        """The next events, waited for on the running event loop (an empty list once
        ``close`` is called, at once if it is called while this waits)."""
        loop = asyncio.get_running_loop()
        while True:
            events = self.read()
            if events or self._fd < 0:
                return events
            ready: asyncio.Future[None] = loop.create_future()
            fd = self._fd
            loop.add_reader(fd, _resolve, ready)
            self._waiter = (loop, ready)
            try:
                await ready
            finally:
                if self._waiter is not None:  # not taken down by ``close``
                    self._waiter = None
                    loop.remove_reader(fd)

    def read(self) -> list[WatchEvent]:
        """The events ready now (an empty list if none; never blocks)."""
        out, self._pending = self._pending, []
        try:
            data = os.read(self._fd, READ_BYTES)
        except BlockingIOError:
            return out
        except OSError as e:
            if e.errno == errno.EBADF:
                return out
            raise
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            raw = data[offset + _HEADER.size: offset + _HEADER.size + length]
            offset += _HEADER.size + length
            self._event(out, wd, mask, raw.split(b"\0", 1)[0].decode("utf-8", "replace"))
        return out

    def _event(self, out: list[WatchEvent], wd: int, mask: int, name: str) -> None:
        if mask & IN_IGNORED:
            self._dirs.pop(wd, None)
            return
        kind = _kind(mask)
        where = self._dirs.get(wd)
        if kind is None or (where is None and kind != "overflow"):
            return
        if name in ("", ".", "..") or "/" in name:
            name = ""
        rel = "/".join(p for p in (where, name) if p)
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF) and where != "":
            return  # its parent reports it by name
        out.append(WatchEvent(kind, rel))
        if kind == "create" and mask & IN_ISDIR and self._recursive and name:
            self._add_new(rel)

    def _add_new(self, rel: str) -> None:
        """A directory created under a watched one: watched too (recursive), opened from the
        top without following a symlink on the way."""
        with contextlib.suppress(OSError):
            sub = open_beneath(self._top, rel, os.O_PATH | os.O_DIRECTORY)
            try:
                self._add(sub, rel)
            finally:
                os.close(sub)

    def close(self) -> None:
        """Close the watch; a ``next_events`` waiting (on this thread's loop) returns."""
        if self._waiter is not None:
            loop, ready = self._waiter
            self._waiter = None
            loop.remove_reader(self._fd)  # before the close: the fd number may be reused
            _resolve(ready)
        for fd in (self._fd, self._top):
            if fd >= 0:
                os.close(fd)
        self._fd = self._top = -1
