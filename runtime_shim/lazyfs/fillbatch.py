"""The native filler's per-object calls, made for a batch of objects at once through the
object store's data dir opened once (``ObjectDir``): a window's or a prediction's objects
claimed with one ``getxattr`` each (where an ``exists`` and a ``complete`` were a ``stat``
and a ``getxattr`` by full path), written and recorded complete on the written file's own
fd, and unmarked by name in the data dir.

The guarantees are the fill's own (``filler``): the fill state is set on an object only
after its verified bytes are written, through the same fd; its mark is removed only after
that; an object whose state is not ``1`` or this boot's tag is unfilled."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from envbuild.oci import is_hex64
from runtime_shim.lazyfs import fanotify
from runtime_shim.lazyfs.objects import FILLED_XATTR, write_into


class ObjectDir:
    """The data dir of an object store (``data``, where marks and fill state are read),
    and the worker's write view of it (``wdata``: ``writer_mount``), each opened once."""

    def __init__(self, data: str, wdata: str, tag: bytes, group: int,
                 xattr: str = FILLED_XATTR) -> None:
        self.prefix = data.rstrip("/") + "/"
        self.group = group
        self.state = (xattr, tag)
        self._done = (b"1", tag)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        self.fd = os.open(data, flags)
        self.wfd = self.fd if os.path.realpath(wdata) == os.path.realpath(data) \
            else os.open(wdata, flags)

    def close(self) -> None:
        if self.wfd != self.fd:
            os.close(self.wfd)
        os.close(self.fd)

    def unfilled(self, names: Iterable[str]) -> set[str]:
        """Those of ``names`` that are placeholders: present, their fill state neither ``1``
        nor this boot's tag (one ``getxattr`` each: a missing object is ENOENT, a
        placeholder ENODATA). A name that is not an object's is refused (ValueError)."""
        xattr, done, prefix = self.state[0], self._done, self.prefix
        getxattr = os.getxattr
        out: set[str] = set()
        for name in names:
            if len(name) != 64 or not is_hex64(name):
                raise ValueError(f"bad object name {name!r}")
            try:
                if getxattr(prefix + name, xattr) in done:
                    continue
            except OSError as e:
                if e.errno == errno.ENOENT:
                    continue
            out.add(name)
        return out

    def write(self, name: str, data: bytes) -> None:
        """Write the verified ``data`` of object ``name`` and set its fill state (this
        boot's tag) on the written fd: complete, still marked (``unmark``)."""
        write_into(name, data, dir_fd=self.wfd, state=self.state)

    def unmark(self, names: Iterable[str]) -> None:
        """Remove the marks of the complete objects ``names`` (by name in the data dir)."""
        group, fd, mark = self.group, self.fd, fanotify.mark
        for name in names:
            mark(group, name, remove=True, dir_fd=fd)


__all__ = ["ObjectDir"]
