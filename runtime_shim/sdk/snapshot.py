"""Pack-diff of a running sandbox (``Sandbox.pack_diff``): its changes become a layer under
the hostile-content policy (``runtime_shim.node.packdiff``), stored with a derived lock = its
lock + that layer, published under a ref if asked, squashed when the lock would end in too
many snapshot layers. Kept apart from ``runtime_shim.sdk.sandbox`` as ``checkpoint.take`` is.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from envbuild.errors import RuntimeShimError
from envbuild.store import Store, put_file
from runtime_shim.backends.base import Snapshottable
from runtime_shim.node import packdiff
from runtime_shim.node.locks import ResolvedLock, resolve

if TYPE_CHECKING:
    from runtime_shim.node.layout import SandboxPaths
    from runtime_shim.node.model import Limits


def take(handle: Snapshottable, *, sandbox_id: str, lock: ResolvedLock, paths: SandboxPaths,
         limits: Limits, store: Store, publish: str | None,
         policy: packdiff.SnapshotPolicy | None, max_chain: int | None,
         source_date_epoch: int) -> packdiff.SnapshotResult:
    """Snapshot the sandbox of ``handle`` (its id, lock, dir, limits and store given; see
    ``Sandbox.pack_diff``). Its processes are paused while the upper dir is read."""
    started = time.monotonic()
    name = publish or sandbox_id
    blob = paths.root / "snapshot.tar.zst"
    try:
        with handle.quiesce(), open(blob, "wb") as out:
            info, report = packdiff.pack_upper(
                handle.upper_dir(), out,
                policy or packdiff.SnapshotPolicy.for_limits(limits),
                name=name, source_date_epoch=source_date_epoch)
        stored = put_file(store, blob)
        if stored.digest == info.digest:   # its pycs' imports, for lazy sandboxes of it
            from runtime_shim.lazyfs.pyindex import index_layer_file

            index_layer_file(store, str(blob), info.digest)
    finally:
        blob.unlink(missing_ok=True)
    if stored.digest != info.digest:
        raise RuntimeShimError(f"snapshot stored as {stored.digest}, packed {info.digest}")
    layer = {"digest": info.digest, "size": info.size, "diff_id": info.diff_id,
             "toc_digest": info.toc_digest, "name": name}
    manifest, config = packdiff.derive_lock(lock, [layer], keep=len(lock.layers))
    squash = max_chain is not None and packdiff.snapshot_chain(lock) + 1 > max_chain
    digest = packdiff.publish_lock(store, manifest, config, None if squash else publish)
    if squash:
        digest = packdiff.squash_snapshots(store, resolve(store, digest), scratch=paths.root,
                                           ref=publish, name=name) or digest
    return packdiff.SnapshotResult(layer=info.digest, lock=digest, ref=publish,
                                   size=info.size, report=report, squashed=squash,
                                   seconds=time.monotonic() - started)
