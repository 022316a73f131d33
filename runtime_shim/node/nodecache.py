"""The node cache: each layer unpacked once per host, read-only, shared by every build and sandbox.

Layout (version 1, under ``root``)::

    node-cache.json            {"version": 1}
    layers/<hex>/              an unpacked layer, overlay-ready (OCI whiteouts turned back into
                               overlayfs whiteouts), never modified after the rename into place
    layers/<hex>.used          touched on every use: the LRU clock for eviction
    locks/<hex>.lock           flock: one unpack per layer across threads and processes
    tmp/                       unpacks in progress (same filesystem, so the final rename is atomic)
    native/<hex>/              a native lazy layer's overlay mount (runtime_shim.lazyfs.native)
    meta/trees/native/<hex>/   its metadata tree, on the node's tmpfs (lazyfs.nativetree)
    objects/                   the object store its files are filled into (lazyfs.objects)

``ensure(store, digest)`` returns the directory, unpacking it first if needed: unpack beside,
rename into place, so a half-unpacked layer is never visible. Concurrent callers for one layer
wait on its lock and then find it present.

``evict`` (``envbuild node gc``) also unmounts the native lazy layers no live sandbox uses
(``runtime_shim.lazyfs.native.remove_unused``); the filler stops once none is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError, UnsupportedFormatError
from envbuild.safefs import iter_tree, remove_tree
from envbuild.sizes import parse_size  # noqa: F401  (re-exported: callers import it here)
from envbuild.store import Store, check_digest
from envbuild.store.base import LocalBlobPaths

NODE_CACHE_VERSION = 1


class NodeCache:
    """Unpacked layers on this host. Thread-safe; process-safe through lock files."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        # absolute: the filler and the native layers' mounts are named by it
        self.root = Path(os.path.abspath(root))
        self._thread_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._open()

    def _open(self) -> None:
        # 0700: unpacked layers hold setuid files and whatever an image ships; no other user
        # of the host may traverse into them (issue 11, item 11)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        for d in ("layers", "locks", "tmp"):
            (self.root / d).mkdir(mode=0o700, exist_ok=True)
            os.chmod(self.root / d, 0o700)
        meta = self.root / "node-cache.json"
        if meta.exists():
            version = json.loads(meta.read_text()).get("version")
            if version != NODE_CACHE_VERSION:
                raise UnsupportedFormatError(
                    f"node cache {self.root} has version {version!r}; this envbuild knows "
                    f"{NODE_CACHE_VERSION}", hint=f"remove {self.root} (it is only a cache)")
        else:
            write_atomic(meta, json.dumps({"version": NODE_CACHE_VERSION}))

    def layer_dir(self, digest: str) -> Path:
        return self.root / "layers" / check_digest(digest).removeprefix("sha256:")

    def has(self, digest: str) -> bool:
        return self.layer_dir(digest).is_dir()

    def _thread_lock(self, hexd: str) -> threading.Lock:
        with self._guard:
            return self._thread_locks.setdefault(hexd, threading.Lock())

    def ensure(self, store: Store, digest: str, toc_digest: str | None = None, *,
               media_type: str | None = None) -> Path:
        """The unpacked, overlay-ready directory of layer ``digest`` (fetched if missing).

        ``toc_digest`` (from the lock's annotation or the key record) is checked against the
        layer's TOC before anything is unpacked. A layer that is not in envbuild's format (a
        plain ``tar`` or ``tar+gzip`` ``media_type``, or ``tar+zstd`` without an envbuild
        footer: another tool's image, a ``skopeo copy`` of a lock) is unpacked in full by the
        safe unpacker (``envbuild.layers.unpack_tar``, OCI whiteouts made overlay whiteouts, no
        device nodes) from the store's verifying stream, read to its end so the blob's digest
        is checked before the directory is renamed into place."""
        target = self.layer_dir(digest)
        hexd = target.name
        if not target.is_dir():
            with self._thread_lock(hexd), _flock(self.root / "locks" / f"{hexd}.lock"):
                if not target.is_dir():
                    self._unpack(store, digest, target, toc_digest or None, media_type)
        _touch(self.root / "layers" / f"{hexd}.used")
        return target

    def _unpack(self, store: Store, digest: str, target: Path, toc_digest: str | None,
                media_type: str | None = None) -> None:
        from envbuild.layers import LayerReader

        tmp = Path(tempfile.mkdtemp(prefix=f"{target.name[:12]}-", dir=self.root / "tmp"))
        try:
            if not is_envbuild_layer(store, digest, media_type):
                _unpack_foreign(store, digest, tmp / "root")
                os.rename(tmp / "root", target)
                return
            if isinstance(store, LocalBlobPaths) and store.blob_path(digest).is_file():
                reader = LayerReader.open_file(store.blob_path(digest), name=digest,
                                               expected_toc_digest=toc_digest)
            else:
                reader = LayerReader.from_store(store, digest, expected_toc_digest=toc_digest)
            dest = tmp / "root"
            # no device nodes ever (overlay whiteouts are made from .wh. members, not taken
            # from the tar): a layer shipping /dev/sda or /dev/mem is refused here
            reader.unpack(dest, whiteouts="overlay", allow_devices=False)
            os.rename(dest, target)
        finally:
            with contextlib.suppress(OSError):  # iterative, no-follow: any layer's tree
                remove_tree(tmp)

    def list_layers(self) -> list[str]:
        return sorted("sha256:" + p.name for p in (self.root / "layers").iterdir()
                      if p.is_dir())

    def usage(self) -> list[LayerUsage]:
        """Every unpacked layer with its disk usage and last use, least recently used first."""
        out = []
        for p in (self.root / "layers").iterdir():
            if p.is_dir():
                used = self.root / "layers" / f"{p.name}.used"
                out.append(LayerUsage("sha256:" + p.name, _tree_size(p),
                                      used.stat().st_mtime if used.exists() else 0.0))
        return sorted(out, key=lambda u: (u.last_used, u.digest))

    def evict(self, keep: Iterable[str], max_bytes: int) -> list[str]:
        """Remove least recently used layers not in ``keep`` until the cache holds at most
        ``max_bytes``, and unmount every native lazy layer not in ``keep``. Returns the digests
        evicted. A layer is renamed away under its lock before deletion, so no reader ever
        sees half of one."""
        from runtime_shim.lazyfs.native import remove_unused

        keep_hex = {check_digest(d).removeprefix("sha256:") for d in keep}
        remove_unused(self.root, keep_hex)  # native layers of no live sandbox; then the filler
        entries = self.usage()
        total = sum(u.size for u in entries)
        evicted = []
        for u in entries:
            if total <= max_bytes:
                break
            hexd = u.digest.removeprefix("sha256:")
            if hexd in keep_hex:
                continue
            with self._thread_lock(hexd), _flock(self.root / "locks" / f"{hexd}.lock"):
                layer = self.root / "layers" / hexd
                trash = self.root / "tmp" / f"evict-{hexd[:12]}-{uuid.uuid4().hex[:6]}"
                os.rename(layer, trash)
                with contextlib.suppress(OSError):
                    remove_tree(trash)
                (self.root / "layers" / f"{hexd}.used").unlink(missing_ok=True)
            total -= u.size
            evicted.append(u.digest)
        return evicted

    # -- native lazy layers (runtime_shim.lazyfs.native) -----------------------------------

    def native_mounted(self, digest: str) -> bool:
        """Whether layer ``digest``'s native lazy overlay (``lazyfs.native``) is mounted."""
        from runtime_shim.lazyfs.nativetree import mount_dir
        return os.path.ismount(mount_dir(str(self.root), check_digest(digest)))

    def on_node(self, digest: str) -> bool:
        """Unpacked or mounted lazily: what the fleet's placement calls cached (a sandbox of
        it starts here without a pull)."""
        return self.has(digest) or self.native_mounted(digest)


#: Layer media types the node cache unpacks (envbuild's framed tar+zstd, or a foreign layer).
LAYER_MEDIA_TYPES = frozenset({
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
})
_ZSTD_TYPES = ("application/vnd.oci.image.layer.v1.tar+zstd", None)


def is_envbuild_layer(store: Store, digest: str, media_type: str | None = None) -> bool:
    """Whether blob ``digest`` is in envbuild's layer format: a ``tar+zstd`` (or unknown)
    media type and an envbuild footer in its last bytes (one ranged read)."""
    from envbuild.layers import FOOTER_MAGIC, FOOTER_SIZE

    if media_type not in _ZSTD_TYPES:
        return False
    size = store.stat(digest).size
    if size < FOOTER_SIZE:
        return False
    tail = store.get_range(digest, size - FOOTER_SIZE, FOOTER_SIZE)
    return tail[8:16] == FOOTER_MAGIC


def _unpack_foreign(store: Store, digest: str, dest: Path) -> None:
    """Full unpack of a foreign OCI layer (plain, gzip or zstd tar) into ``dest``, an overlay
    lower dir; the stream is drained so the store checks the blob's digest."""
    from envbuild.layers import unpack_tar

    dest.mkdir(mode=0o755)
    with store.get(digest) as f:
        unpack_tar(f, dest, name=f"foreign layer {digest}", whiteouts="overlay")
        while f.read(1 << 20):  # the rest (tar padding, compression trailer): verified at EOF
            pass


@dataclasses.dataclass(frozen=True)
class LayerUsage:
    digest: str
    size: int
    last_used: float


class _flock:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _touch(path: Path) -> None:
    try:
        path.touch()
    except OSError as e:
        raise RuntimeShimError(f"update node cache clock {path}: {e.strerror}") from e


def _tree_size(root: Path) -> int:
    """Disk usage of the files below ``root`` (iterative and fd-based: any depth)."""
    total = 0
    try:
        for _parts, _fd, entry in iter_tree(root):
            if not entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
    except OSError:
        pass  # vanished while measured
    return total
