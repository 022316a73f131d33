"""The lower dirs of a sandbox's layers and how they are served: unpacked in the node cache,
lazily by the native filler (``runtime_shim.lazyfs.native``), or by the FUSE stacks
(``lazy="fuse"``, until they are deleted); the lazy mode recorded as ``Sandbox.info().lazy``.
"""

from __future__ import annotations

import logging

from envbuild.errors import RuntimeShimError
from envbuild.store import Store
from runtime_shim.node.locks import ResolvedLock
from runtime_shim.node.nodecache import NodeCache

_log = logging.getLogger("envbuild.sandbox")


def layer_dirs(node: NodeCache, store: Store, lock: ResolvedLock, lazy: bool | str,
               note: str = "") -> tuple[list[str], str]:
    """The lower dirs of ``lock``'s layers, bottom first, and how they are served (the
    record's ``lazy``): lazy (True, ``"auto"``, ``"native"``): the kernel-served layers of
    ``runtime_shim.lazyfs.native`` (``native``), where the host and node dir cannot (``"auto"``:
    where anything, the store too, stands in the way), a full pull with one logged line
    (``full pull: why``; ``"native"``: refused); ``"fuse"``: the
    FUSE mounts of ``runtime_shim.lazyfs``; else the node cache's unpacked dirs (``note``:
    why a lazy request is not, or ``""``)."""
    if lazy == "fuse":
        return _fuse_layer_dirs(node, store, lock)
    if lazy:
        from runtime_shim.lazyfs.native import NativeUnavailable, native_layer_dirs

        try:
            return native_layer_dirs(str(node.root), store, lock.layers), "native"
        except RuntimeShimError as e:
            # True: only where the host or node dir cannot; "auto": wherever it cannot
            if lazy == "native" or (lazy is True and not isinstance(e, NativeUnavailable)):
                raise
            why = e.message.removeprefix("lazy='native': ")
            _log.warning("lazy=%r: %s; pulling the layers in full instead", lazy, why)
            note = f"full pull: {why}"
    return [str(node.ensure(store, layer.digest, layer.toc_digest, media_type=layer.media_type))
            for layer in lock.layers], note


def _fuse_layer_dirs(node: NodeCache, store: Store, lock: ResolvedLock
                     ) -> tuple[list[str], str]:
    """``lazy="fuse"``: the FUSE mounts of the node's lazy daemon and their mode."""
    from runtime_shim.lazyfs import lazy_layer_dirs
    from runtime_shim.lazyfs.control import daemon_mode

    dirs = lazy_layer_dirs(node, store, lock.layers, lock.env, lock.cmd)
    mode = daemon_mode(node.root) or "fuse"
    if any(d.startswith(f"{node.root}/meta/") for d in dirs):
        mode += "+meta"
    return dirs, mode
