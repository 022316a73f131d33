"""The node cache: each layer unpacked once per host, read-only, shared by every build and sandbox.

Layout (version 1, under ``root``)::

    node-cache.json            {"version": 1}
    layers/<hex>/              an unpacked layer, overlay-ready (OCI whiteouts turned back into
                               overlayfs whiteouts), never modified after the rename into place
    layers/<hex>.used          touched on every use: the LRU clock for eviction
    locks/<hex>.lock           flock: one unpack per layer across threads and processes
    tmp/                       unpacks in progress (same filesystem, so the final rename is atomic)

``ensure(store, digest)`` returns the directory, unpacking it first if needed: unpack beside,
rename into place, so a half-unpacked layer is never visible. Concurrent callers for one layer
wait on its lock and then find it present.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path

from envbuild.errors import RuntimeShimError, UnsupportedFormatError
from envbuild.store import Store, check_digest

NODE_CACHE_VERSION = 1


class NodeCache:
    """Unpacked layers on this host. Thread-safe; process-safe through lock files."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._thread_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._open()

    def _open(self) -> None:
        for d in ("layers", "locks", "tmp"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        meta = self.root / "node-cache.json"
        if meta.exists():
            version = json.loads(meta.read_text()).get("version")
            if version != NODE_CACHE_VERSION:
                raise UnsupportedFormatError(
                    f"node cache {self.root} has version {version!r}; this envbuild knows "
                    f"{NODE_CACHE_VERSION}", hint=f"remove {self.root} (it is only a cache)")
        else:
            tmp = self.root / f".node-cache.json.{uuid.uuid4().hex}"
            tmp.write_text(json.dumps({"version": NODE_CACHE_VERSION}))
            tmp.replace(meta)

    def layer_dir(self, digest: str) -> Path:
        return self.root / "layers" / check_digest(digest).removeprefix("sha256:")

    def has(self, digest: str) -> bool:
        return self.layer_dir(digest).is_dir()

    def _thread_lock(self, hexd: str) -> threading.Lock:
        with self._guard:
            return self._thread_locks.setdefault(hexd, threading.Lock())

    def ensure(self, store: Store, digest: str, toc_digest: str | None = None) -> Path:
        """The unpacked, overlay-ready directory of layer ``digest`` (fetched if missing).

        ``toc_digest`` (from the lock's annotation or the key record) is checked against the
        layer's TOC before anything is unpacked."""
        target = self.layer_dir(digest)
        hexd = target.name
        if not target.is_dir():
            with self._thread_lock(hexd), _flock(self.root / "locks" / f"{hexd}.lock"):
                if not target.is_dir():
                    self._unpack(store, digest, target, toc_digest or None)
        _touch(self.root / "layers" / f"{hexd}.used")
        return target

    def _unpack(self, store: Store, digest: str, target: Path, toc_digest: str | None) -> None:
        from envbuild.layers import LayerReader

        tmp = Path(tempfile.mkdtemp(prefix=f"{target.name[:12]}-", dir=self.root / "tmp"))
        try:
            blob_path = getattr(store, "blob_path", None)
            if blob_path is not None and Path(blob_path(digest)).is_file():
                reader = LayerReader.open_file(blob_path(digest), name=digest,
                                               expected_toc_digest=toc_digest)
            else:
                reader = LayerReader.from_store(store, digest, expected_toc_digest=toc_digest)
            dest = tmp / "root"
            reader.unpack(dest, whiteouts="overlay")
            os.rename(dest, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

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
        ``max_bytes``. Returns the evicted digests. A layer is renamed away under its lock
        before deletion, so no reader ever sees half of one."""
        keep_hex = {check_digest(d).removeprefix("sha256:") for d in keep}
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
                shutil.rmtree(trash, ignore_errors=True)
                (self.root / "layers" / f"{hexd}.used").unlink(missing_ok=True)
            total -= u.size
            evicted.append(u.digest)
        return evicted


@dataclasses.dataclass(frozen=True)
class LayerUsage:
    digest: str
    size: int
    last_used: float


def parse_size(text: str) -> int:
    """``"20G"``, ``"500M"``, ``"1024"`` → bytes (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        return int(float(t[: len(t) - len(unit)] if unit else t) * units[unit])
    except ValueError:
        raise RuntimeShimError(f"not a size: {text!r}", hint="use e.g. 20G, 500M or 0") from None


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
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total
