"""Overlay mounts by system call (side effects; needs root).

``mount(2)`` takes all overlay options in one string limited to a page (4096 bytes), which
long lower-dir lists overflow (~120 layers of typical node-cache paths). Linux >= 6.8 accepts
lower dirs one at a time through the new mount API (``fsconfig(..., "lowerdir+", ...)``), with
no length limit; we use it when the option string would not fit and fall back to a clear error
on older kernels. Calls go through libc with ctypes: ~0.8 ms per mount, against ~5 ms for the
``mount`` command.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import io
import os

from envbuild.errors import RuntimeShimError
from envbuild.libc import function

# mount(2) and syscall(2) with their types (scratchfs and fncall_ns call them too)
raw_mount = function("mount", argtypes=[ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                     ctypes.c_ulong, ctypes.c_char_p])
raw_umount2 = function("umount2", argtypes=[ctypes.c_char_p, ctypes.c_int])
raw_syscall = function("syscall", ctypes.c_long)

PAGE_LIMIT = 4095  # mount(2) copies at most one page of options, NUL included
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
MS_RDONLY = 1

# x86_64 / generic syscall numbers of the new mount API (same on every architecture since 5.2)
_SYS_MOVE_MOUNT = 429
_SYS_FSOPEN = 430
_SYS_FSCONFIG = 431
_SYS_FSMOUNT = 432
_FSCONFIG_SET_FLAG = 0
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_AT_FDCWD = -100

# Overlay features that write metadata OCI layers cannot express (redirects for renamed dirs,
# metacopy-only files, index/xino bookkeeping): off, so an upper dir is always a plain diff.
OVERLAY_PLAIN_OPTIONS = ("index=off", "xino=off", "redirect_dir=off", "metacopy=off")


@dataclasses.dataclass(frozen=True)
class OverlaySpec:
    """One overlay: ``lowerdirs`` topmost first; no upper means a read-only overlay."""

    target: str
    lowerdirs: tuple[str, ...]
    upperdir: str | None = None
    workdir: str | None = None

    def options(self) -> str:
        opts = [f"lowerdir={':'.join(self.lowerdirs)}"]
        if self.upperdir is not None:
            opts += [f"upperdir={self.upperdir}", f"workdir={self.workdir}"]
        return ",".join(opts + list(OVERLAY_PLAIN_OPTIONS))


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _check_lowerdir(path: str) -> None:
    # ':' and ',' separate overlay options; a path holding them would be misparsed.
    if any(c in path for c in ":,\\"):
        raise RuntimeShimError(f"overlay lower dir path has a ':' ',' or '\\': {path}",
                               hint="move the node cache to a plain path")


def mount_overlay(spec: OverlaySpec) -> None:
    """Mount ``spec``; raise ``RuntimeShimError`` naming the target and the kernel's reason."""
    if not spec.lowerdirs:
        raise RuntimeShimError(f"overlay at {spec.target} has no lower dirs")
    for d in spec.lowerdirs:
        _check_lowerdir(d)
    options = spec.options()
    try:
        if len(options.encode()) <= PAGE_LIMIT:
            if raw_mount(b"overlay", spec.target.encode(), b"overlay", 0,
                           options.encode()) != 0:
                raise _os_error("mount")
        else:
            _mount_overlay_new_api(spec)
    except OSError as e:
        hint = "check dmesg for 'overlayfs:' lines"
        if e.errno == errno.EPERM:
            hint = "mounting needs root (CAP_SYS_ADMIN)"
        raise RuntimeShimError(f"mount overlay at {spec.target}: {e.strerror}",
                               hint=hint) from e


def _mount_overlay_new_api(spec: OverlaySpec) -> None:
    sc = raw_syscall
    sc.argtypes = None
    fsfd = sc(_SYS_FSOPEN, b"overlay", 0)
    if fsfd < 0:
        raise _os_error("fsopen (the kernel lacks the new mount API; too many layers for mount(2))")
    try:
        def set_string(key: str, value: str) -> None:
            if sc(_SYS_FSCONFIG, fsfd, _FSCONFIG_SET_STRING, key.encode(), value.encode(), 0) < 0:
                raise _os_error(f"fsconfig {key}")

        for lower in spec.lowerdirs:
            set_string("lowerdir+", lower)
        if spec.upperdir is not None:
            set_string("upperdir", spec.upperdir)
            set_string("workdir", spec.workdir or "")
        for opt in OVERLAY_PLAIN_OPTIONS:
            key, _, value = opt.partition("=")
            set_string(key, value)
        if sc(_SYS_FSCONFIG, fsfd, _FSCONFIG_CMD_CREATE, None, None, 0) < 0:
            raise _os_error("fsconfig create")
        mfd = sc(_SYS_FSMOUNT, fsfd, 0, 0)
        if mfd < 0:
            raise _os_error("fsmount")
        try:
            if sc(_SYS_MOVE_MOUNT, mfd, b"", _AT_FDCWD, spec.target.encode(),
                  _MOVE_MOUNT_F_EMPTY_PATH) < 0:
                raise _os_error("move_mount")
        finally:
            os.close(mfd)
    finally:
        os.close(fsfd)


def unmount(target: str, *, lazy_fallback: bool = True, nofollow: bool = False) -> None:
    """Unmount ``target``; if it is busy, detach it lazily. A target not mounted is fine.
    ``nofollow``: a symlink in its last component is not followed (``UMOUNT_NOFOLLOW``), for
    targets under a directory hostile code could write (a dead build's scratch dir)."""
    path, flags = os.fsencode(target), UMOUNT_NOFOLLOW if nofollow else 0
    if raw_umount2(path, flags) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
        return
    if err == errno.EBUSY and lazy_fallback and raw_umount2(path, flags | MNT_DETACH) == 0:
        return
    raise RuntimeShimError(f"unmount {target}: {os.strerror(err)}",
                           hint="find users with `fuser -vm PATH`")


def mounted_targets_under(prefix: str) -> list[str]:
    """Mount points at or below ``prefix`` (from /proc/self/mountinfo), deepest first."""
    prefix = prefix.rstrip("/")
    found = []
    # io.open: the builtin open is gone while the interpreter finalizes (a close in __del__)
    with io.open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:  # noqa: UP020
        for line in f:
            mount_point = line.split(" ", 5)[4].replace("\\040", " ")
            if mount_point == prefix or mount_point.startswith(prefix + "/"):
                found.append(mount_point)
    return sorted(found, key=len, reverse=True)


def bind_mount_readonly(source: str, target: str) -> None:
    """Bind ``source`` at ``target`` read-only (two calls: bind, then remount ro)."""
    MS_BIND, MS_REMOUNT = 4096, 32
    if raw_mount(source.encode(), target.encode(), None, MS_BIND, None) != 0:
        raise RuntimeShimError(f"bind mount {source} at {target}: {_os_error('mount').strerror}")
    if raw_mount(None, target.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None) != 0:
        err = _os_error("remount")
        unmount(target)
        raise RuntimeShimError(f"remount {target} read-only: {err.strerror}")
