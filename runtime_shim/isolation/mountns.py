"""A step run in a mount namespace of its own, so what it mounts never reaches the host's.

A sandbox's overlay mounted in the host's namespace makes the host's mount table grow with
every live sandbox, and every new container's mount namespace starts as a copy of that table
(measured: 1,500 extra host mounts took runc's create from 33 to 41 ms and its delete from
10.6 to 12.2 ms). ``in_own_mount_ns`` runs a step on a new thread that unshared its mount
namespace (a mount namespace belongs to a thread, as a network namespace does) and made every
mount in it private: what the step mounts there is seen by no other namespace, and a process
it spawns (``runc run``) starts in that namespace, so the container's mount namespace, copied
from it, holds the sandbox's overlay — its own mounts and no other sandbox's. The thread's
namespace goes with the thread and the processes it spawned; the container's goes with the
container, and takes the overlay with it (nothing to unmount on the host, nothing to leak).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from envbuild.errors import RuntimeShimError
from envbuild.libc import function
from runtime_shim.isolation.mount import raw_mount

T = TypeVar("T")

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

_unshare = function("unshare", argtypes=[ctypes.c_int])


def in_own_mount_ns(step: Callable[[], T]) -> T:
    """``step()`` run on a thread in a new mount namespace with private propagation (a copy
    of this process's mounts: the step sees the host's files); its result, or its exception
    re-raised here. Needs root (``CAP_SYS_ADMIN``)."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            _enter_private_namespace()
            out.append(step())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            err.append(e)

    t = threading.Thread(target=run, name="envbuild-mountns")
    t.start()
    try:
        t.join()
    except BaseException:
        t.join()  # interrupted: the step (a runtime starting a container) still finishes
        raise
    if err:
        raise err[0]
    return out[0]


def _enter_private_namespace() -> None:
    """Unshare this thread's mount namespace and make every mount in it private, so no mount
    made here propagates to a peer in the host's namespace (``/`` is shared there)."""
    if _unshare(CLONE_NEWNS) != 0:
        e = ctypes.get_errno()
        raise RuntimeShimError(f"unshare the mount namespace: {os.strerror(e)}",
                               hint="sandboxes need root (CAP_SYS_ADMIN)")
    if raw_mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        e = ctypes.get_errno()
        raise RuntimeShimError(f"make the sandbox's mount namespace private: {os.strerror(e)}")
