"""Mount management, client side: what ``Sandbox.create(lazy=True)`` calls to get the lazy
mounts of a layer stack from the node daemon (through ``NodeCache.ensure_lazy``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from envbuild.errors import RuntimeShimError
from envbuild.oci import MEDIA_TYPE_LAYER_ZSTD
from envbuild.store import PYIMPORT_RECORDS, Store
from envbuild.store.base import Locatable, Presigner
from runtime_shim.lazyfs.control import daemon_request
from runtime_shim.lazyfs.profile import (
    PROFILE_NAMESPACE,
    PROFILE_PUT_EXPIRES,
    profile_key,
    read_profile,
)

_log = logging.getLogger("envbuild.lazyfs")


class LazyNode(Protocol):
    """What ``lazy_layer_dirs`` needs of the node cache (``runtime_shim.node.nodecache.NodeCache``;
    a protocol so this package does not import the module that imports it)."""

    root: Path

    def lazy_mounted(self, digest: str) -> bool: ...

    def ensure_lazy(self, store_url: str, digest: str, toc_digest: str | None = None, *,
                    s3_endpoint: str | None = None, size: int | None = None,
                    ranges_url: str | None = None,
                    record_profile: dict | None = None,
                    index_url: str | None = None) -> Path: ...


def store_location(store: Store) -> tuple[str, str | None]:
    """``(url, s3_endpoint)`` another process can open ``store`` with (the daemon's
    ``--store``/``--s3-endpoint``): its ``Locatable.location()`` — a ``LocalStore``'s absolute
    root, an ``S3Store``'s URL and endpoint. Credentials are not passed: the daemon inherits
    the environment."""
    if isinstance(store, Locatable):
        loc = store.location()
        return loc.url, loc.s3_endpoint
    raise RuntimeShimError(f"lazy mode cannot serve layers from {store!r}: the FUSE daemon is "
                           "another process and must open the store by URL",
                           hint="use a store directory or an s3:// store, or drop --lazy")


def lazy_layer_dirs(node: LazyNode, store: Store, layers: Sequence[Any],
                    env: Mapping[str, str] | None = None,
                    cmd: Sequence[str] | None = ()) -> list[str]:
    """``Sandbox.create(lazy=True)``: the lazy mounts of ``layers`` (``LayerRef``s, bottom to
    top) in node cache ``node``, asked of the node daemon in parallel. An ``S3Store`` hands the
    daemon a presigned URL per blob, so it reads ranges without loading boto3. Layers not
    mounted yet get the stack's lazy profile prefetched in the background (``read_profile``,
    read while they mount), or, without one, have their reads recorded as the profile. A layer
    whose fetched files have a meta layer (``runtime_shim.lazyfs.metalayer``) gets its dir
    right above the FUSE mount: those files are then opened and read without the daemon.
    A stack mounted for the first time without a profile has its start-up files fetched
    ahead (``runtime_shim.lazyfs.startup``: what runc and a program's libc start-up read under
    the lock's environment ``env``, then the lock's command ``cmd``'s program) while the
    container is made."""

    for x in layers:
        # the FUSE daemon serves envbuild's framed layers only (it reads their TOC); a lock's
        # envbuild layers always carry the TOC annotation, so this costs no request
        media_type = getattr(x, "media_type", MEDIA_TYPE_LAYER_ZSTD)
        if media_type != MEDIA_TYPE_LAYER_ZSTD or not x.toc_digest:
            raise RuntimeShimError(
                f"lazy mode needs envbuild layers: layer {x.digest} ({media_type}) is not in "
                "envbuild's format (no envbuild TOC)",
                hint="run it without lazy (the node cache unpacks it in full), or convert the "
                     "image: `from: {oci: {layout: DIR, ref: TAG}}` in a definition and "
                     "`envbuild build` re-encodes it as envbuild layers")
    url, endpoint = store_location(store)
    presign = store.presigned_get_url if isinstance(store, Presigner) else None
    digests = [x.digest for x in layers]
    record = None
    profile_read = None
    if not all(node.lazy_mounted(d) for d in digests):
        # the profile record is read beside the mounts (a store round trip): they are asked
        # to record one, and told to stop (the prefetch request) when there is one already
        record = {"key": profile_key(digests), "layers": digests, "store": url,
                  "s3_endpoint": endpoint}
        if isinstance(store, Presigner):   # the daemon saves it without a store client
            record["put_url"] = store.presigned_put_record_url(
                PROFILE_NAMESPACE, record["key"], PROFILE_PUT_EXPIRES)
        reader = ThreadPoolExecutor(1, thread_name_prefix="lazy-profile")
        profile_read = reader.submit(read_profile, store, digests)
        reader.shutdown(wait=False)

    def one(layer: Any) -> str:
        ranges_url = presign(layer.digest) if presign is not None else None
        # the layer's import index (lazyfs.pyindex), read by the daemon after the mount
        index_url = (store.presigned_get_record_url(PYIMPORT_RECORDS, layer.digest[7:])
                     if isinstance(store, Presigner) else None)
        return str(node.ensure_lazy(url, layer.digest, layer.toc_digest or None,
                                    s3_endpoint=endpoint, size=layer.size,
                                    ranges_url=ranges_url, record_profile=record,
                                    index_url=index_url))

    if len(layers) <= 1:
        dirs = [one(layer) for layer in layers]
    else:
        with ThreadPoolExecutor(min(8, len(layers)), thread_name_prefix="lazy-mount") as pool:
            dirs = list(pool.map(one, layers))
    profile = profile_read.result() if profile_read is not None else None
    if record is not None and not profile and env is not None:
        # a hint (the daemon answers at once and fetches in the background): never fatal
        try:
            daemon_request(node.root, {"op": "startup", "mountpoints": dirs,
                                       "env": dict(env), "cmd": list(cmd or ())[:1]}, 5.0)
        except (RuntimeShimError, OSError, ValueError) as e:
            _log.warning("lazy start-up files: %s", e)
    if profile:
        daemon_request(node.root, {"op": "prefetch", "key": record["key"] if record else None,
                                   "layers": [{"mountpoint": d, "paths": profile.get(x.digest, [])}
                                              for d, x in zip(dirs, layers)]}, 10.0)
    # files already on the node: each layer's meta layer (if any) right above its FUSE mount
    from runtime_shim.lazyfs.metalayer import meta_dirs

    metas = meta_dirs(node.root, list(zip(digests, dirs)))
    return [d for fuse, meta in zip(dirs, metas) for d in (fuse, meta) if d]

