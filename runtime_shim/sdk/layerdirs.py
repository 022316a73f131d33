"""The lower dirs of a sandbox's layers and how they are served: unpacked in the node cache,
or lazily by the native filler (``runtime_shim.lazyfs.native``); the lazy mode recorded as
``Sandbox.info().lazy``.
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
    (``full pull: why``; ``"native"``: refused); else the node cache's
    unpacked dirs (``note``: why a lazy request is not, or ``""``)."""
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

