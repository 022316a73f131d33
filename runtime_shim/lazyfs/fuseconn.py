"""The ``/dev/fuse`` connection of a passthrough mount: mount, INIT, backing files, the probe.

``mount(2)`` of a FUSE filesystem on an fd of our own, ``FUSE_INIT`` asking for
``FUSE_PASSTHROUGH``, the backing-file ioctls, and ``probe``: whether this kernel serves
passthrough for us at all (``$ENVBUILD_LAZY_PASSTHROUGH`` can force the answer). Used by
``runtime_shim.lazyfs.passthrough``."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import threading

from envbuild import libc
from envbuild.errors import EnvbuildError, RuntimeShimError
from runtime_shim.lazyfs.fusewire import (
    _BACKING_MAP,
    _BUFSIZE,
    _IN_HEADER,
    _INIT_IN,
    _INIT_OUT,
    _WANT,
    FUSE_DO_READDIRPLUS,
    FUSE_INIT_EXT,
    FUSE_KERNEL_MINOR,
    FUSE_KERNEL_VERSION,
    FUSE_PASSTHROUGH,
    readdirplus_wanted,
    reply_bytes,
)

log = logging.getLogger("envbuild.lazyfs")

def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (229 << 8) | nr   # _IOW(FUSE_DEV_IOC_MAGIC=229, nr, size)


FUSE_DEV_IOC_BACKING_OPEN = _iow(1, _BACKING_MAP.size)
FUSE_DEV_IOC_BACKING_CLOSE = _iow(2, 4)

_mount = libc.function("mount", argtypes=[ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.c_ulong, ctypes.c_char_p])
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4

#: Where the mode choice can be forced: ``0``/``off`` (always the libfuse path), ``1``/``on``
#: (passthrough or fail), unset/``auto`` (passthrough when the kernel offers it).
PASSTHROUGH_ENV = "ENVBUILD_LAZY_PASSTHROUGH"


class _Conn:
    """One mounted FUSE connection: the ``/dev/fuse`` fd and what INIT negotiated."""

    def __init__(self, mountpoint: str, fsname: str) -> None:
        self.mountpoint = mountpoint
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        data = (f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other,"
                "default_permissions").encode()
        if _mount(fsname.encode(), mountpoint.encode(), b"fuse.envbuild",
                       MS_RDONLY | MS_NOSUID | MS_NODEV, data) != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise RuntimeShimError(f"mount FUSE at {mountpoint}: {os.strerror(err)}")
        self.passthrough = False
        self.kernel_minor = 0
        self.lock = threading.Lock()

    def reply(self, unique: int, payload: bytes = b"", error: int = 0) -> None:
        try:
            os.write(self.fd, reply_bytes(unique, payload, error))
        except OSError as e:   # ENOENT: the request was interrupted; ENODEV: unmounted
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("fuse reply on %s: %s", self.mountpoint, e.strerror)

    def init(self, unique: int, body: bytes, want_passthrough: bool) -> None:
        major, minor, max_readahead, flags, flags2 = _INIT_IN.unpack_from(body)
        kflags = flags | (flags2 << 32 if flags & FUSE_INIT_EXT else 0)
        self.kernel_minor = minor
        want = _WANT | (FUSE_PASSTHROUGH if want_passthrough else 0) \
            | (FUSE_DO_READDIRPLUS if readdirplus_wanted() else 0)
        got = want & kflags
        self.passthrough = bool(got & FUSE_PASSTHROUGH)
        self.reply(unique, _INIT_OUT.pack(
            FUSE_KERNEL_VERSION, FUSE_KERNEL_MINOR, max_readahead, got & 0xFFFFFFFF,
            64, 48, 1 << 20, 1, 256, 0, got >> 32, 1 if self.passthrough else 0, 0))

    def backing_open(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _ioctl_int(self.fd, FUSE_DEV_IOC_BACKING_OPEN, _BACKING_MAP.pack(fd, 0, 0))
        finally:
            os.close(fd)

    def backing_close(self, backing_id: int) -> None:
        try:
            _ioctl_int(self.fd, FUSE_DEV_IOC_BACKING_CLOSE, struct.pack("<I", backing_id))
        except OSError as e:
            log.warning("backing close %d on %s: %s", backing_id, self.mountpoint, e.strerror)

    def close(self) -> None:
        os.close(self.fd)


_ioctl = libc.function("ioctl", argtypes=[ctypes.c_int, ctypes.c_ulong, ctypes.c_char_p])


def _ioctl_int(fd: int, request: int, arg: bytes) -> int:
    """``ioctl`` returning its (non-negative) result: ``fcntl.ioctl`` with a buffer returns the
    buffer, not the value, and the backing id is the value."""
    buf = ctypes.create_string_buffer(arg, len(arg))
    r = _ioctl(fd, request, buf)
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return r


def passthrough_wanted() -> bool | None:
    """``$ENVBUILD_LAZY_PASSTHROUGH``: False (off), True (on: required), None (auto)."""
    raw = os.environ.get(PASSTHROUGH_ENV, "auto").strip().lower()
    if raw in ("0", "off", "no", "false"):
        return False
    if raw in ("1", "on", "yes", "true"):
        return True
    return None


def probe(scratch: str, files_dir: str) -> tuple[bool, str]:
    """Whether this kernel serves FUSE passthrough for us: mount an empty filesystem at
    ``scratch`` (created and removed here), answer INIT asking for ``FUSE_PASSTHROUGH``, and
    register a file of ``files_dir`` as a backing file. ``(ok, why not)``."""
    from runtime_shim.isolation.mount import unmount

    if passthrough_wanted() is False:
        return False, f"disabled by ${PASSTHROUGH_ENV}"
    if not os.path.exists("/dev/fuse"):
        return False, "no /dev/fuse"
    os.makedirs(scratch, exist_ok=True)
    os.makedirs(files_dir, exist_ok=True)
    try:
        conn = _Conn(scratch, "envbuild-lazy-probe")
    except (RuntimeShimError, OSError) as e:
        os.rmdir(scratch)
        return False, str(e)
    result: list[tuple[bool, str]] = []
    try:
        def answer_init() -> None:
            buf = os.read(conn.fd, _BUFSIZE)
            length, opcode, unique, *_ = _IN_HEADER.unpack_from(buf)
            conn.init(unique, buf[_IN_HEADER.size:length], True)
            if not conn.passthrough:
                result.append((False, f"the kernel (FUSE 7.{conn.kernel_minor}) did not "
                                      "offer FUSE_PASSTHROUGH"))
                return
            probe_file = os.path.join(files_dir, ".probe")
            with open(probe_file, "wb") as f:
                f.write(b"probe")
            try:
                bid = conn.backing_open(probe_file)
            except OSError as e:
                result.append((False, f"FUSE_DEV_IOC_BACKING_OPEN refused: {e.strerror}"))
                return
            finally:
                os.unlink(probe_file)
            conn.backing_close(bid)
            result.append((True, ""))

        # the kernel sends INIT as it mounts; nothing else arrives unless someone looks
        t = threading.Thread(target=answer_init, daemon=True)
        t.start()
        t.join(10)
    except OSError as e:
        result.append((False, f"probe mount: {e.strerror}"))
    finally:
        try:
            unmount(scratch)
        except EnvbuildError as e:
            log.warning("%s", e)
        conn.close()
        try:
            os.rmdir(scratch)
        except OSError:
            pass
    return result[0] if result else (False, "the probe mount did not answer INIT")
