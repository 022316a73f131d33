"""fanotify pre-content events through ctypes: the group, marks, events and answers the
native filler (``runtime_shim.lazyfs.filler``) uses.

Linux >= 6.14: a group of class ``FAN_CLASS_PRE_CONTENT`` may mark an inode for
``FAN_PRE_ACCESS`` (and ``FAN_OPEN_PERM``); every read, write or ``mmap`` (open) of it
then waits until the group answers the event (``FAN_ALLOW``, or ``FAN_DENY`` with an errno
the reader gets). Each access event carries a range record (type 6: offset, count). The
constants are spelled here because the C headers of most distributions predate them."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import struct

from envbuild.libc import function

FAN_CLOEXEC = 0x1
FAN_CLASS_PRE_CONTENT = 0x8
FAN_UNLIMITED_QUEUE = 0x10
FAN_MARK_ADD = 0x1
FAN_MARK_REMOVE = 0x2
FAN_MARK_MOUNT = 0x10
#: An ignore mark (``FAN_MARK_IGNORE``) that survives modification (required for a mount).
FAN_MARK_IGNORE_SURV = 0x400 | 0x40
FAN_OPEN_PERM = 0x00010000
FAN_PRE_ACCESS = 0x00100000
#: What the filler marks: the open (a fill before any read or ``mmap`` can happen: an
#: ``mmap`` through overlayfs raises no pre-content event of the lower file) and every access.
FILL_EVENTS = FAN_OPEN_PERM | FAN_PRE_ACCESS
FAN_ALLOW = 0x1
FAN_DENY = 0x2
FAN_EVENT_INFO_TYPE_RANGE = 6
_FAN_ERRNO_SHIFT = 24
_AT_FDCWD = -100
#: ``struct fanotify_event_metadata``: event_len, vers, reserved, metadata_len, mask, fd, pid
_META = struct.Struct("=IBBHQii")
#: ``struct fanotify_event_info_range`` after its header: pad, offset, count
_RANGE = struct.Struct("=BBHIQQ")
_RESPONSE = struct.Struct("=iI")

_init = function("fanotify_init", argtypes=[ctypes.c_uint, ctypes.c_uint])
_mark = function("fanotify_mark", argtypes=[ctypes.c_int, ctypes.c_uint, ctypes.c_uint64,
                                            ctypes.c_int, ctypes.c_char_p])


def deny_errno(err: int) -> int:
    """The answer that fails the access with ``err`` (``FAN_DENY_ERRNO``; the kernel takes
    EIO, EPERM, EBUSY, ETXTBSY, EAGAIN, ENOSPC, EDQUOT)."""
    return FAN_DENY | ((err & 0xFF) << _FAN_ERRNO_SHIFT)


@dataclasses.dataclass(frozen=True)
class Event:
    """One pre-content event: the accessed file (``fd``, ours to close), who accessed it, and
    the byte range (``count`` 0: the whole file, e.g. an open for write)."""

    fd: int
    pid: int
    mask: int
    offset: int
    count: int


def _error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def open_group() -> int:
    """A new pre-content group (its fd); OSError where the kernel has none (EINVAL before
    6.14) or the caller is not root (EPERM)."""
    fd = _init(FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC | FAN_UNLIMITED_QUEUE,
               os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC)
    if fd < 0:
        raise _error("fanotify_init(FAN_CLASS_PRE_CONTENT)")
    return fd


def mark(group: int, path: str, *, remove: bool = False, mask: int = FILL_EVENTS,
         dir_fd: int = _AT_FDCWD) -> None:
    """Add (or remove) the mark of the inode at ``path`` (``FILL_EVENTS``; relative to
    ``dir_fd`` if given: one lookup, not a walk from the root)."""
    flags = FAN_MARK_REMOVE if remove else FAN_MARK_ADD
    if _mark(group, flags, mask, dir_fd, os.fsencode(path)) != 0:
        err = ctypes.get_errno()
        if remove and err == errno.ENOENT:  # no mark there (removed before)
            return
        raise OSError(err, f"fanotify_mark {path}: {os.strerror(err)}")


def ignore_mount(group: int, path: str, mask: int = FILL_EVENTS) -> None:
    """Ignore ``mask`` for every access through the mount at ``path`` (an inode's marks
    still raise events for accesses through any other mount)."""
    if _mark(group, FAN_MARK_ADD | FAN_MARK_MOUNT | FAN_MARK_IGNORE_SURV, mask, _AT_FDCWD,
             os.fsencode(path)) != 0:
        raise _error(f"fanotify_mark (ignore) {path}")


def parse(buf: bytes) -> list[Event]:
    """The events of one ``read`` of the group fd."""
    out = []
    pos = 0
    while pos + _META.size <= len(buf):
        length, _vers, _res, meta_len, mask, fd, pid = _META.unpack_from(buf, pos)
        if length < _META.size or pos + length > len(buf):
            break
        offset = count = 0
        info = pos + meta_len
        while info + 4 <= pos + length:
            itype, _pad, ilen = struct.unpack_from("=BBH", buf, info)
            if ilen < 4:
                break
            if itype == FAN_EVENT_INFO_TYPE_RANGE and ilen >= _RANGE.size:
                *_, offset, count = _RANGE.unpack_from(buf, info)
            info += ilen
        out.append(Event(fd, pid, mask, offset, count))
        pos += length
    return out


def answer(group: int, fd: int, response: int) -> bool:
    """Answer the permission event of ``fd``; False when the group holds no such event
    (answered before, or a stale number)."""
    try:
        os.write(group, _RESPONSE.pack(fd, response))
        return True
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.EINVAL):
            return False
        raise


__all__ = ["FAN_ALLOW", "FAN_DENY", "FAN_OPEN_PERM", "FAN_PRE_ACCESS", "FILL_EVENTS", "Event",
           "answer", "deny_errno", "ignore_mount", "mark", "open_group", "parse"]
