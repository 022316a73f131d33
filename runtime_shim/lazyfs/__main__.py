"""``python -m runtime_shim.lazyfs``: the node daemon (``--node``), or one layer in the
foreground (debugging)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from envbuild.errors import EnvbuildError
from envbuild.sizes import parse_size
from envbuild.store.lazy import ChunkCache, LazyLayer, MemoryChunkCache
from runtime_shim.lazyfs.chunks import TieredChunkCache
from runtime_shim.lazyfs.daemon import DEFAULT_TREE_BUDGET, TREE_BUDGET_ENV, _NodeDaemon
from runtime_shim.lazyfs.fuseops import CACHE_TTL, _operations_base, make_operations
from runtime_shim.lazyfs.tree import Node, tree_of

log = logging.getLogger("envbuild.lazyfs")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime_shim.lazyfs",
                                description="Serve lazy layers as read-only FUSE filesystems "
                                            "(overlay lower dirs): every layer of a node cache "
                                            "(--node), or one layer at --mountpoint.")
    p.add_argument("--node", default=None,
                   help="the node cache directory: serve its lazy mounts until none is left")
    p.add_argument("--store", help="store URL: a directory or s3://BUCKET/PREFIX")
    p.add_argument("--s3-endpoint", default=None)
    p.add_argument("--digest")
    p.add_argument("--toc-digest", default=None)
    p.add_argument("--size", type=int, default=None, help="blob size (saves a request)")
    p.add_argument("--mountpoint")
    p.add_argument("--chunk-cache", help="the node's chunk cache directory")
    p.add_argument("--chunk-cache-max", default="10G")
    p.add_argument("--memory-cache", default="256M")
    p.add_argument("--fetch-concurrency", type=int, default=None,
                   help="store requests in flight at once for the whole node (default "
                        "$ENVBUILD_LAZY_FETCH_CONCURRENCY or 16)")
    p.add_argument("--fetch-timeout", type=float, default=None,
                   help="seconds a read waits for the store before it fails with EIO "
                        "(default $ENVBUILD_LAZY_FETCH_TIMEOUT or 30)")
    p.add_argument("--tree-budget", default=None,
                   help="memory all mounted layers' trees may take; a mount past it is refused "
                        "(default $ENVBUILD_LAZY_TREE_BUDGET or 2G)")
    p.add_argument("--debug", action="store_true", help="libfuse debug output")
    return p


def open_layer(args: argparse.Namespace) -> tuple[LazyLayer, dict[str, Node]]:
    from envbuild.store import open_store

    store = open_store(args.store, s3_endpoint=args.s3_endpoint)
    cache = TieredChunkCache(MemoryChunkCache(parse_size(args.memory_cache)),
                             ChunkCache(args.chunk_cache, parse_size(args.chunk_cache_max)))
    layer = LazyLayer(store, args.digest, chunk_cache=cache,
                      expected_toc_digest=args.toc_digest or None, size=args.size)
    return layer, tree_of(layer.reader)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s lazyfs[%(process)d] %(levelname)s %(message)s")
    if args.node:
        try:
            _operations_base()
        except EnvbuildError as e:
            print("\n".join(e.render_lines()), file=sys.stderr)
            return 1
        from runtime_shim.lazyfs.filecache import FetchSettings

        try:
            fetch = FetchSettings.from_env(args.fetch_concurrency, args.fetch_timeout)
        except EnvbuildError as e:
            print("\n".join(e.render_lines()), file=sys.stderr)
            return 1
        try:
            budget = parse_size(args.tree_budget or os.environ.get(TREE_BUDGET_ENV)
                                or str(DEFAULT_TREE_BUDGET))
            code = _NodeDaemon(os.path.abspath(args.node), parse_size(args.chunk_cache_max),
                               parse_size(args.memory_cache), fetch, budget).serve()
        except EnvbuildError as e:   # e.g. a node dir another user can write
            print("\n".join(e.render_lines()), file=sys.stderr)
            code = 1
        # Exit now: a fetch stuck on a dead store (its caller already got EIO) must not keep
        # the interpreter joining its worker thread forever.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)
    missing = [f"--{n}" for n in ("store", "digest", "mountpoint", "chunk-cache")
               if not getattr(args, n.replace("-", "_"))]
    if missing:
        parser.error(f"without --node, these are required: {', '.join(missing)}")
    try:
        layer, nodes = open_layer(args)
        _operations_base()
    except EnvbuildError as e:
        print("\n".join(e.render_lines()), file=sys.stderr)
        return 1
    import mfusepy

    log.info("serving %s (%d entries, TOC %d bytes) at %s", args.digest, len(nodes),
             layer.stats.toc_bytes, args.mountpoint)
    try:
        mfusepy.FUSE(make_operations(layer, nodes), args.mountpoint, foreground=True,
                     nothreads=False, debug=args.debug, ro=True, allow_other=True,
                     default_permissions=True, fsname=f"envbuild-lazy-{args.digest[7:19]}",
                     subtype="envbuild", use_ino=True, readdir_ino=True, kernel_cache=True,
                     entry_timeout=CACHE_TTL, attr_timeout=CACHE_TTL,
                     negative_timeout=CACHE_TTL)
    except RuntimeError as e:
        print(f"error: mount {args.mountpoint}: libfuse failed ({e})", file=sys.stderr)
        return 1
    log.info("unmounted %s; stats %s", args.mountpoint, json.dumps(layer.stats.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
