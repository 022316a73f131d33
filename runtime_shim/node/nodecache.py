"""The node cache: each layer unpacked once per host, read-only, shared by every build and sandbox.

Layout (version 1, under ``root``)::

    node-cache.json            {"version": 1}
    layers/<hex>/              an unpacked layer, overlay-ready (OCI whiteouts turned back into
                               overlayfs whiteouts), never modified after the rename into place
    layers/<hex>.used          touched on every use: the LRU clock for eviction
    locks/<hex>.lock           flock: one unpack per layer across threads and processes
    tmp/                       unpacks in progress (same filesystem, so the final rename is atomic)
    lazy/<hex>/                lazy mode: the layer's read-only FUSE mount (runtime_shim.lazyfs)
    lazy/<hex>.json            {"version": 1, "pid", "digest", "store", "started", "mode"}: its
                               daemon, and how it serves reads ("passthrough" or "fuse")
    lazy/<hex>.used            touched on every use
    lazy/daemon.json           {"version": 1, "pid", "started"}: the node's lazy layer daemon
    run/                       0700: the lazy daemon's control socket ``lazyfs.sock`` and its
                               lock (runtime_shim.lazyfs.control: who may talk to it)
    lazy/daemon.log            its stderr (appended across restarts)
    locks/<hex>.lazy.lock      flock: one mount request per layer across threads and processes
    locks/lazy-daemon.lock     flock: one daemon start at a time
    files/<hex>                lazy passthrough mode: whole verified files by content digest,
                               the kernel's backing files (runtime_shim.lazyfs.filecache)
    meta/<hex>/                lazy passthrough mode: the layer's meta layer generations, its
                               fetched files served by overlayfs (runtime_shim.lazyfs.metalayer)
    chunks/                    lazy mode: verified file pieces (envbuild.store.lazy.ChunkCache),
                               keyed by content, shared by every lazy layer

``ensure(store, digest)`` returns the directory, unpacking it first if needed: unpack beside,
rename into place, so a half-unpacked layer is never visible. Concurrent callers for one layer
wait on its lock and then find it present.

``ensure_lazy(store_url, digest, toc_digest)`` returns the layer's FUSE mount instead, asking the
node's one lazy layer daemon (``python -m runtime_shim.lazyfs --node ROOT``, detached: it
outlives the caller and serves every lazy layer of every sandbox on the host; started if none
runs) to mount it; a mount whose daemon died (``ENOTCONN``) is unmounted and replaced. ``evict``
(``envbuild node gc``) unmounts the lazy mounts that no live sandbox uses; the daemon exits
once it serves none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError, UnsupportedFormatError
from envbuild.oci import is_hex64
from envbuild.safefs import iter_tree, remove_tree
from envbuild.sizes import parse_size  # noqa: F401  (re-exported: callers import it here)
from envbuild.store import Store, check_digest
from envbuild.store.base import LocalBlobPaths

NODE_CACHE_VERSION = 1
LAZY_STATE_VERSION = 1
#: How long ``ensure_lazy`` waits for a new daemon's mount (it fetches footer and TOC first).
LAZY_MOUNT_TIMEOUT = 30.0
#: How long an unmounted daemon gets to exit before SIGTERM, then SIGKILL.
LAZY_STOP_TIMEOUT = 5.0
DEFAULT_CHUNK_CACHE_MAX = 10 << 30
# Daemons this process started: polled so they are reaped, not left as zombies.
_daemons: dict[int, subprocess.Popen] = {}


class NodeCache:
    """Unpacked layers on this host. Thread-safe; process-safe through lock files."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        # absolute: the lazy daemon mounts only at <root>/lazy/<hex> and compares the path
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
        ``max_bytes``, and unmount every lazy mount not in ``keep`` (``unmount_lazy``). Returns
        the digests unmounted or evicted. A layer is renamed away under its lock before
        deletion, so no reader ever sees half of one."""
        keep_hex = {check_digest(d).removeprefix("sha256:") for d in keep}
        unmounted = self.unmount_lazy(keep)  # lazy: begin
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
        return unmounted + [d for d in evicted if d not in unmounted]  # lazy: end

    # -- lazy mode (runtime_shim.lazyfs) ------------------------------------------------------

    def lazy_dir(self, digest: str) -> Path:
        return self.root / "lazy" / check_digest(digest).removeprefix("sha256:")

    def lazy_mounted(self, digest: str) -> bool:
        """Whether layer ``digest``'s lazy mount is up and answers."""
        return _lazy_mount_state(self.lazy_dir(digest)) == "ok"

    def native_mounted(self, digest: str) -> bool:
        """Whether layer ``digest``'s native lazy overlay (``lazyfs.native``) is mounted."""
        from runtime_shim.lazyfs.nativetree import mount_dir
        return os.path.ismount(mount_dir(str(self.root), check_digest(digest)))

    def on_node(self, digest: str) -> bool:
        """Unpacked or mounted lazily (FUSE or native): what the fleet's placement calls
        cached (a sandbox of it starts here without a pull)."""
        return self.has(digest) or self.lazy_mounted(digest) or self.native_mounted(digest)

    def ensure_lazy(self, store_url: str, digest: str, toc_digest: str | None = None, *,
                    s3_endpoint: str | None = None, size: int | None = None,
                    ranges_url: str | None = None, record_profile: dict | None = None,
                    index_url: str | None = None,
                    chunk_cache_max: int = DEFAULT_CHUNK_CACHE_MAX,
                    timeout: float = LAZY_MOUNT_TIMEOUT) -> Path:
        """The read-only FUSE mount of layer ``digest`` (an overlay lower dir), served from the
        store at ``store_url`` (a directory or ``s3://…``; ``runtime_shim.lazyfs.store_location``
        gives it for a ``Store``) by the node's lazy layer daemon, shared by every sandbox on
        this host; ``ranges_url`` (a presigned GET URL of the blob) lets it read ranges without
        opening the store itself. ``record_profile`` goes to the daemon with a new mount
        (``runtime_shim.lazyfs.lazy_layer_dirs``: lazy profiles), and ``index_url`` (a
        presigned GET URL of the layer's import index record, ``lazyfs.pyindex``; without
        it the daemon reads the record from the store itself).

        Idempotent: a healthy mount is returned as is. Otherwise, under the layer's lock, a
        stale mount (its daemon died) is unmounted and the daemon (started if none runs) asked
        to mount the layer; it checks ``toc_digest`` (and ``size``, the lock's blob size)
        before it mounts and answers once the mount is up, within ``timeout`` seconds. A layer
        it cannot serve is a ``RuntimeShimError`` with its reason."""
        target = self.lazy_dir(digest)
        hexd = target.name
        if _lazy_mount_state(target) != "ok":
            with self._thread_lock(hexd + ".lazy"), \
                    _flock(self.root / "locks" / f"{hexd}.lazy.lock"):
                state = _lazy_mount_state(target)
                if state == "stale":
                    self._stop_lazy(hexd)
                if state != "ok":
                    self._start_lazy(store_url, digest, toc_digest, s3_endpoint, size,
                                     ranges_url, chunk_cache_max, timeout,
                                     record_profile=record_profile, index_url=index_url)
        _touch(self.root / "lazy" / f"{hexd}.used")
        return target

    def _start_lazy(self, store_url: str, digest: str, toc_digest: str | None,
                    s3_endpoint: str | None, size: int | None, ranges_url: str | None,
                    chunk_cache_max: int, timeout: float, *,
                    record_profile: dict | None = None, index_url: str | None = None) -> None:
        from runtime_shim.lazyfs.control import daemon_request

        target = self.lazy_dir(digest)
        hexd = target.name
        target.mkdir(parents=True, exist_ok=True)
        req = {"op": "mount", "mountpoint": str(target), "store": store_url,
               "s3_endpoint": s3_endpoint, "digest": digest, "toc_digest": toc_digest,
               "size": size, "ranges_url": ranges_url, "timeout": timeout,
               "profile": record_profile, "index_url": index_url}
        for _ in range(5):  # a daemon that was exiting as we asked: start one, ask again
            reply = daemon_request(self.root, req, timeout + 5)
            if reply is None:
                self._start_daemon(chunk_cache_max, timeout)
                continue
            if not reply.get("ok"):
                if _lazy_mount_state(target) != "absent":
                    _unmount_fuse(target)
                raise RuntimeShimError(
                    f"lazy layer {digest}: the FUSE daemon cannot serve it",
                    context=str(reply.get("error", ""))[-2000:] or None,
                    hint=f"see {self.root / 'lazy' / 'daemon.log'}; store {store_url}")
            _check_claimed_mount(target, digest)
            state = {"version": LAZY_STATE_VERSION, "pid": reply.get("pid"), "digest": digest,
                     "store": store_url, "started": time.time(),
                     "mode": reply.get("mode") or "fuse"}
            write_atomic(self.root / "lazy" / f"{hexd}.json", json.dumps(state))
            return
        raise RuntimeShimError(f"lazy layer {digest}: no FUSE daemon answers",
                               hint=f"see {self.root / 'lazy' / 'daemon.log'}")

    def _start_daemon(self, chunk_cache_max: int, timeout: float) -> None:
        """Start the node's lazy layer daemon unless one answers (one starter at a time)."""
        from runtime_shim.lazyfs.control import daemon_request

        with self._thread_lock("lazy-daemon"), \
                _flock(self.root / "locks" / "lazy-daemon.lock"):
            if daemon_request(self.root, {"op": "ping"}, timeout) is not None:
                return
            argv = [sys.executable, "-m", "runtime_shim.lazyfs",
                    "--node", os.path.abspath(self.root),
                    "--chunk-cache-max", str(chunk_cache_max)]
            # the daemon imports runtime_shim and envbuild from where this process did
            src = str(Path(__file__).resolve().parents[2])  # the dir holding runtime_shim
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in (src, os.environ.get("PYTHONPATH")) if p)}
            (self.root / "lazy").mkdir(parents=True, exist_ok=True)
            log_path = self.root / "lazy" / "daemon.log"
            with open(log_path, "ab") as log:
                log_start = log.tell()
                try:
                    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=log, cwd="/", env=env,
                                            start_new_session=True)
                except OSError as e:
                    raise RuntimeShimError(f"start the lazy layer daemon: {e}") from e
            _daemons[proc.pid] = proc
            write_atomic(self.root / "lazy" / "daemon.json", json.dumps(
                {"version": LAZY_STATE_VERSION, "pid": proc.pid, "started": time.time()}))
            deadline = time.monotonic() + timeout
            delay = 0.002
            while daemon_request(self.root, {"op": "ping"}, timeout) is None:
                code = proc.poll()
                if code is not None or time.monotonic() > deadline:
                    if code is None:
                        _terminate(proc.pid)
                    raise RuntimeShimError(
                        "the lazy layer daemon " + (f"exited {code}" if code is not None
                                                    else f"did not start within {timeout:.0f} s"),
                        context=_log_tail(log_path, log_start), hint=f"see {log_path}")
                time.sleep(delay)
                delay = min(delay * 2, 0.01)   # a connect refused costs ~20 µs: look often

    def _stop_lazy(self, hexd: str) -> None:
        """Unmount ``lazy/<hex>`` (caller holds the lock); the daemon drops that mount, and
        exits once it serves none."""
        target = self.root / "lazy" / hexd
        if _lazy_mount_state(target) != "absent":
            _unmount_fuse(target)
        (self.root / "lazy" / f"{hexd}.json").unlink(missing_ok=True)
        (self.root / "lazy" / f"{hexd}.used").unlink(missing_ok=True)
        try:
            target.rmdir()
        except OSError:
            pass

    def list_lazy(self) -> list[str]:
        """Digests of the layers with a lazy mount or daemon state on this host."""
        lazy = self.root / "lazy"
        if not lazy.is_dir():
            return []
        # the dir entry's type, never a stat: a mount whose daemon died answers ENOTCONN
        with os.scandir(lazy) as entries:
            found = {e.name for e in entries if e.is_dir(follow_symlinks=False)}
        found |= {p.name.removesuffix(".json") for p in lazy.glob("*.json")}
        return sorted("sha256:" + h for h in found if is_hex64(h))

    def unmount_lazy(self, keep: Iterable[str]) -> list[str]:
        """Unmount the lazy mounts of layers not in ``keep`` (the layers of live sandboxes)
        and end their daemons. Returns their digests."""
        keep_hex = {check_digest(d).removeprefix("sha256:") for d in keep}
        done = []
        for digest in self.list_lazy():
            hexd = digest.removeprefix("sha256:")
            if hexd in keep_hex:
                continue
            with self._thread_lock(hexd + ".lazy"), \
                    _flock(self.root / "locks" / f"{hexd}.lazy.lock"):
                self._stop_lazy(hexd)
            done.append(digest)
        from runtime_shim.lazyfs.metalayer import remove_unused
        from runtime_shim.lazyfs.native import remove_unused as remove_native

        self._sweep_probes()
        remove_native(self.root, keep_hex)  # native layers of no live sandbox; then the filler
        remove_unused(self.root, keep_hex)  # meta layers: of unused layers, and old generations
        if done:
            self._wait_daemon_gone()
        return done

    def _sweep_probes(self) -> None:
        """Unmount and remove ``lazy/.probe-<pid>`` of daemons that are gone: a daemon killed
        while it probed the kernel for FUSE passthrough left its probe's mount (the soak)."""
        lazy = self.root / "lazy"
        if not lazy.is_dir():
            return
        with os.scandir(lazy) as entries:   # no stat: a dead probe mount answers ENOTCONN
            probes = [e.name for e in entries if e.name.startswith(".probe-")]
        for name in probes:
            pid = name.removeprefix(".probe-")
            if pid.isdigit() and _is_daemon(int(pid), self.root):
                continue   # probing now
            target = lazy / name
            if _lazy_mount_state(target) != "absent":
                _unmount_fuse(target)
            with contextlib.suppress(OSError):
                target.rmdir()

    def _wait_daemon_gone(self) -> None:
        """Once no lazy mount is left, the daemon exits by itself; one that is still there
        after ``LAZY_STOP_TIMEOUT`` with no mount (stuck) is stopped."""
        from runtime_shim.isolation.mount import mounted_targets_under

        lazy = str(self.root / "lazy")
        try:
            pid = int(json.loads((self.root / "lazy" / "daemon.json").read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        deadline = time.monotonic() + LAZY_STOP_TIMEOUT + 1.0
        while _is_daemon(pid, self.root):
            if mounted_targets_under(lazy):
                return  # serving again (another sandbox): not ours to stop
            if time.monotonic() > deadline:
                _terminate(pid)
                break
            time.sleep(0.02)


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


# -- lazy mode helpers -------------------------------------------------------------------------

def _lazy_mount_state(target: Path) -> str:
    """``"ok"`` (a FUSE mount that answers), ``"stale"`` (mounted, daemon gone: ENOTCONN, or
    something else mounted there) or ``"absent"``."""
    fstype = _mount_fstype(str(target))
    if fstype is None:
        return "absent"
    if not fstype.startswith("fuse"):
        return "stale"
    try:
        os.statvfs(target)  # always asked of the daemon (stat may come from the attr cache)
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO):
            return "stale"
        raise RuntimeShimError(f"check lazy mount {target}: {e.strerror}") from e
    return "ok"


def _mount_fstype(target: str) -> str | None:
    """The filesystem type mounted at ``target`` (topmost), from /proc/self/mountinfo."""
    found = _mount_entry(target)
    return found[0] if found else None


def _mount_entry(target: str) -> tuple[str, str] | None:
    """``(fstype, super options)`` of the topmost mount at ``target``, from mountinfo."""
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.rstrip("\n").split(" ")
            if fields[4].replace("\\040", " ") == target:
                sep = fields.index("-")
                found = (fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else "")
    return found


def _check_claimed_mount(target: Path, digest: str) -> None:
    """After the daemon said it mounted ``digest`` at ``target``: a FUSE mount of envbuild's,
    made by root (or this user), answers there — a reply is not taken on its word."""
    from runtime_shim.lazyfs.control import trusted_uids

    entry = _mount_entry(str(target))
    opts = dict(o.partition("=")[::2] for o in entry[1].split(",")) if entry else {}
    owner = opts.get("user_id", "")
    if entry is None or entry[0] != "fuse.envbuild" or not owner.isdigit() \
            or int(owner) not in trusted_uids() or _lazy_mount_state(target) != "ok":
        raise RuntimeShimError(
            f"lazy layer {digest}: the daemon said it is mounted at {target}, but "
            + ("nothing is" if entry is None else f"a {entry[0]} mount (user_id={owner or '?'})"
               " that is not the daemon's is there"),
            hint=f"see {target.parent / 'daemon.log'}")


def _unmount_fuse(target: Path) -> None:
    from runtime_shim.isolation.mount import unmount

    unmount(str(target))  # busy (a sandbox still reads it): detached, gone with its last user


def _is_daemon(pid: int, root: Path) -> bool:
    """Whether ``pid`` still runs and is the lazyfs daemon of node cache ``root`` (not a
    recycled pid, not a zombie)."""
    proc = _daemons.get(pid)
    if proc is not None and proc.poll() is not None:
        del _daemons[pid]
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return False
    from runtime_shim.lazyfs.control import trusted_uids

    # another user's process can claim any command line: never one to signal
    return (owner in trusted_uids() and b"runtime_shim.lazyfs" in cmdline
            and os.fsencode(os.path.abspath(root)) in cmdline)


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(200):
            proc = _daemons.get(pid)
            if proc is not None:
                if proc.poll() is not None:
                    break
            elif not Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.01)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc = _daemons.pop(pid, None)
    if proc is not None:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _log_tail(path: Path, start: int, limit: int = 2000) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace").strip()
    except OSError:
        return None
    return text[-limit:] or None
