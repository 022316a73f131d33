"""Native lazy layers, client side: ``Sandbox.create(lazy=True)`` (or ``lazy="native"``).

Each layer is served by the kernel alone: its metadata tree (``nativetree``, built from the
TOC on the layer's first use on a node) over the node's object store (``objects``) as a
data-only lower layer, the unfilled objects filled on first access by the node's filler
(``filler``: fanotify pre-content events, Linux >= 6.14). No FUSE, no daemon on the read
path: lookups, ``stat``, ``readdir`` are the kernel's; a read of a complete object is a plain
local read. Order of a create, so that no reader ever reaches an unmarked placeholder: the
filler makes and marks the placeholders (it answers only then), and only then is the
layer's overlay mounted.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from envbuild.errors import EnvbuildError, RuntimeShimError
from runtime_shim.lazyfs import nativetree
from runtime_shim.lazyfs.filler import LOG, SOCKET, peer_uid
from runtime_shim.lazyfs.fillhints import START_FILES
from runtime_shim.lazyfs.objects import ObjectStore
from runtime_shim.lazyfs.tree import Node

#: How long a create waits for a filler it started to answer.
START_TIMEOUT = 15.0


class NativeUnavailable(RuntimeShimError):
    """This host or node dir cannot run native lazy layers (no pre-content events, not root,
    an object store on tmpfs), found before anything was fetched or mounted: ``lazy=True``
    pulls the layers in full instead, ``lazy="native"`` is refused."""


def filler_request(node_root: str, req: dict[str, Any], timeout: float = 30.0
                   ) -> dict[str, Any] | None:
    """Send ``req`` to the node's filler; None when none answers."""
    path = os.path.join(os.path.abspath(node_root), "objects", SOCKET)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(path)
        except OSError:
            return None
        if peer_uid(s) != 0:
            raise RuntimeShimError(f"the filler socket {path} is not root's",
                                   hint="only root may serve a node's objects")
        buf = b""
        try:
            s.sendall(json.dumps(req).encode() + b"\n")
            while not buf.endswith(b"\n"):
                got = s.recv(65536)
                if not got:
                    return None
                buf += got
        except (ConnectionError, BrokenPipeError):   # a filler stopping
            return None
        reply = json.loads(buf)
        return reply if isinstance(reply, dict) else None
    finally:
        s.close()


def supported() -> str | None:
    """Why this host cannot run native lazy layers (None: it can)."""
    from runtime_shim.lazyfs import fanotify

    if os.geteuid() != 0:
        return "native lazy layers need root"
    try:
        os.close(fanotify.open_group())
    except OSError as e:
        return f"the kernel has no fanotify pre-content events ({e.strerror}; Linux >= 6.14)"
    return None


def ensure_filler(node_root: str) -> dict[str, Any]:
    """The node's filler answers (started, detached, if none does); its ping reply."""
    reply = filler_request(node_root, {"op": "ping"}, 5.0)
    if reply is not None:
        return reply
    why = supported()
    if why:
        raise NativeUnavailable(f"lazy='native': {why}",
                                hint="use lazy=True (a full pull here) or lazy=False")
    objects = ObjectStore(node_root)
    objects.make_dirs()
    check_object_fs(objects)
    with open(os.path.join(objects.root, LOG), "ab") as log:
        subprocess.Popen([sys.executable, "-m", "runtime_shim.lazyfs.filler", "--node",
                          os.path.abspath(node_root)], stdin=subprocess.DEVNULL, stdout=log,
                         stderr=log, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        reply = filler_request(node_root, {"op": "ping"}, 5.0)
        if reply is not None:
            return reply
        time.sleep(0.05)
    raise RuntimeShimError("the native filler did not start",
                           hint=f"see {os.path.join(objects.root, LOG)}")


def check_object_fs(objects: ObjectStore) -> None:
    """The object store's filesystem takes pre-content marks (ext4, xfs, btrfs do; tmpfs
    refuses them, EOPNOTSUPP), tried on a probe file before a filler starts: a node dir on
    such a filesystem is one line, with no filler started and nothing mounted."""
    from runtime_shim.lazyfs import fanotify

    probe = objects.tmp("probe")
    group = fanotify.open_group()
    try:
        with open(probe, "x"):
            pass
        fanotify.mark(group, probe)
    except OSError as e:
        raise NativeUnavailable(
            f"lazy='native': the node's object store {objects.root} cannot carry fanotify "
            f"pre-content marks ({e.strerror or e}; tmpfs has none)",
            hint="put the node dir on ext4, xfs or btrfs, or use lazy=False") from None
    finally:
        os.close(group)   # its mark goes with it
        try:
            os.unlink(probe)
        except FileNotFoundError:
            pass


def store_location(store: Any) -> tuple[str, str | None]:
    """``(url, s3_endpoint)`` the filler (another process) opens ``store`` with: its
    ``Locatable.location()`` — a ``LocalStore``'s absolute root, an ``S3Store``'s URL and
    endpoint. Credentials are not passed: the filler inherits the environment."""
    from envbuild.store.base import Locatable

    if isinstance(store, Locatable):
        loc = store.location()
        return loc.url, loc.s3_endpoint
    raise RuntimeShimError(f"lazy mode cannot serve layers from {store!r}: the filler is "
                           "another process and must open the store by URL",
                           hint="use a store directory or an s3:// store, or drop --lazy")


def check_envbuild_layers(layers: Sequence[Any]) -> None:
    """``RuntimeShimError`` unless every layer is in envbuild's format: the filler serves
    envbuild's framed layers only (it reads their TOC); a lock's envbuild layers always carry
    the TOC annotation, so this costs no request."""
    from envbuild.oci import MEDIA_TYPE_LAYER_ZSTD

    for x in layers:
        media_type = getattr(x, "media_type", MEDIA_TYPE_LAYER_ZSTD)
        if media_type != MEDIA_TYPE_LAYER_ZSTD or not x.toc_digest:
            raise RuntimeShimError(
                f"lazy mode needs envbuild layers: layer {x.digest} ({media_type}) is not in "
                "envbuild's format (no envbuild TOC)",
                hint="run it without lazy (the node cache unpacks it in full), or convert the "
                     "image: `from: {oci: {layout: DIR, ref: TAG}}` in a definition and "
                     "`envbuild build` re-encodes it as envbuild layers")


def native_layer_dirs(node_root: str, store: Any, layers: Sequence[Any]) -> list[str]:
    """The native overlays of ``layers`` (``LayerRef``s, bottom first) on node ``node_root``,
    each built and mounted on its first use here (module docstring). A layer's first use:
    its TOC (all layers' fetched at once), its source record, then the filler makes and
    marks its placeholders (``place``) while this process builds its tree: the two on two
    cores, and both before the mount."""
    from envbuild.store import PYIMPORT_RECORDS
    from envbuild.store.base import Presigner

    check_envbuild_layers(layers)
    root = os.path.abspath(node_root)
    # the stack the filler resolves predictions in (a hint: no answer, no prediction)
    stack = {"op": "stack", "layers": [x.digest[7:] for x in reversed(layers)]}
    new = [x for x in layers
           if not os.path.ismount(nativetree.mount_dir(root, x.digest.removeprefix("sha256:")))]
    if not new and filler_request(root, stack) is not None:
        # every layer mounted and the filler answering: the create's one round trip
        return [nativetree.mount_dir(root, x.digest[7:]) for x in layers]
    url, endpoint = store_location(store)
    ensure_filler(root)
    objects = ObjectStore(root)
    objects.make_dirs()
    readers = _readers(store, new)
    dirs = []
    for layer in layers:
        hexd = layer.digest.removeprefix("sha256:")
        if layer.digest not in readers:
            dirs.append(nativetree.mount_dir(root, hexd))
            continue
        reader, tail = readers[layer.digest]
        nodes = _tree(layer, reader)

        def start(layer: Any = layer, nodes: dict[str, Node] = nodes, tail: bytes = tail,
                  size: int = reader.size) -> Callable[[], None]:
            objects.record_layer(layer.digest, size, url, endpoint,
                                 _sources(nodes), tail, getattr(layer, "toc_digest", ""))
            # a presigned URL: the filler's ranged reads over plain HTTP, no boto3 in it
            ranges, index = (store.presigned_get_url(layer.digest),
                             store.presigned_get_record_url(PYIMPORT_RECORDS, layer.digest[7:])) \
                if isinstance(store, Presigner) else (None, None)
            fill = [nodes[p].digest[7:] for p in START_FILES
                    if p in nodes and stat.S_ISREG(nodes[p].mode) and nodes[p].size]
            return _in_thread(lambda: place(root, layer.digest, ranges, index, fill))
        dirs.append(nativetree.ensure(root, hexd, nodes, objects.data, start))
    filler_request(root, stack)
    return dirs


def _readers(store: Any, layers: Sequence[Any]) -> dict[str, tuple[Any, bytes]]:
    """The ``LayerReader``s of ``layers`` and their blobs' tails (``_open``), fetched at
    once: a request each, in parallel over the link."""
    from concurrent.futures import ThreadPoolExecutor

    def one(layer: Any) -> tuple[Any, bytes]:
        try:
            return _open(store, layer)
        except EnvbuildError as e:
            raise RuntimeShimError(f"native lazy layer {layer.digest[:19]}: {e}") from e
    if not layers:
        return {}
    with ThreadPoolExecutor(min(8, len(layers))) as pool:
        return dict(zip([x.digest for x in layers], pool.map(one, layers), strict=True))


def _open(store: Any, layer: Any) -> tuple[Any, bytes]:
    """Layer ``layer``'s ``LayerReader`` from one ranged read of its blob's last
    ``TOC_GUESS`` bytes (its size from the lock: no ``stat``; a larger TOC costs a second
    read), checked against the lock's TOC digest; and the blob from its TOC frame to its
    end, which the filler reads the TOC from (``ObjectStore.record_layer``)."""
    from envbuild.errors import CorruptLayerError
    from envbuild.layers import LayerReader
    from envbuild.store.lazy import TOC_GUESS

    digest = layer.digest
    size = int(layer.size or 0) or store.stat(digest).size
    n = min(size, TOC_GUESS)
    have = [size - n, store.get_range(digest, size - n, n)]

    def get_range(offset: int, length: int) -> bytes:
        if offset < have[0]:   # a TOC over the guess: the rest of the tail, once
            have[:] = [offset, store.get_range(digest, offset, have[0] - offset) + have[1]]
        if len(have[1]) != size - have[0]:
            raise CorruptLayerError(f"layer {digest}: short read of its tail (truncated blob)")
        start = offset - have[0]
        return have[1][start:start + length]
    reader = LayerReader(get_range, size, name=digest,
                         expected_toc_digest=getattr(layer, "toc_digest", None) or None)
    return reader, have[1][reader.footer.toc_offset - have[0]:]


def _tree(layer: Any, reader: Any) -> dict[str, Node]:
    from runtime_shim.lazyfs.tree import tree_of

    try:
        return tree_of(reader)
    except EnvbuildError as e:
        raise RuntimeShimError(f"native lazy layer {layer.digest[:19]}: {e}") from e


def _sources(nodes: dict[str, Node]) -> dict[str, tuple[str, int]]:
    """``{object hex: (path in the layer, size)}`` of a layer's regular files (the first
    path of each content)."""
    out: dict[str, tuple[str, int]] = {}
    for node in nodes.values():
        if stat.S_ISREG(node.mode):
            out.setdefault(node.digest.removeprefix("sha256:"), (node.read_path, node.size))
    return out


def _in_thread(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` in a thread now; the returned call waits for it and raises its error."""
    import threading

    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised in the waiter
            err.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()

    def wait() -> None:
        t.join()
        if err:
            raise err[0]
    return wait


def place(node_root: str, layer: str, ranges_url: str | None = None,
          index_url: str | None = None, fill: Sequence[str] = ()) -> None:
    """Have the filler read ``layer``'s source record (and take ``ranges_url``, a presigned
    GET of its blob, and ``index_url``, of its import index, if any), make the placeholders
    of its objects the node lacks and mark them (before anything can reach them); then fill
    the objects ``fill`` names (what a sandbox's start reads of the layer) ahead."""
    reply = filler_request(node_root, {"op": "place", "layer": layer.removeprefix("sha256:"),
                                       "ranges_url": ranges_url, "index_url": index_url,
                                       "fill": list(fill)},
                           timeout=600.0)
    if not reply or not reply.get("ok"):
        why = (reply or {}).get("error") or "no answer"
        raise RuntimeShimError(f"the native filler did not place the layer's objects: {why}",
                               hint="raise fs.fanotify.max_user_marks, or run `envbuild "
                                    "node gc`; its log: <node>/objects/filler.log")


def shutdown(node_root: str) -> None:
    """Unmount the node's native layers (detached if busy) and stop its filler (SIGTERM to
    the holder): ``node gc`` of a node with no live sandbox, and tests."""
    import signal

    from runtime_shim.isolation.mount import mounted_targets_under, unmount

    root = os.path.abspath(node_root)
    for mnt in mounted_targets_under(os.path.join(root, "native")):
        unmount(mnt)
    reply = filler_request(root, {"op": "ping"}, 5.0)
    if reply is not None:
        # the holder stops its worker; a worker whose holder died (reparented) stops itself
        holder, worker = reply.get("holder"), reply.get("pid")
        pid = holder if isinstance(holder, int) and holder > 1 else worker
        if isinstance(pid, int) and pid > 1:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while filler_request(root, {"op": "ping"}, 1.0) is not None \
                and time.monotonic() < deadline:
            time.sleep(0.05)


def remove_unused(node_root: str | os.PathLike[str], keep_hex: set[str]) -> list[str]:
    """``node gc``: unmount the native layers not in ``keep_hex`` (the layers of live
    sandboxes) and drop their trees; with none left, stop the filler and unmount the tree
    tmpfs (the objects stay: a cache). Returns the layers' hexes."""
    import shutil

    from runtime_shim.isolation.mount import unmount

    root = os.path.abspath(node_root)
    base = os.path.join(root, "native")
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        names = []
    done = []
    for hexd in names:
        if hexd in keep_hex:
            continue
        unmount(nativetree.mount_dir(root, hexd))
        os.rmdir(nativetree.mount_dir(root, hexd))
        shutil.rmtree(nativetree.tree_dir(root, hexd), ignore_errors=True)
        done.append(hexd)
    if not any(os.path.ismount(os.path.join(base, n)) for n in names if n not in done):
        shutdown(root)
    from runtime_shim.lazyfs.metagen import release_trees

    release_trees(root)   # the tree tmpfs, once no tree is left
    return done


def describe_native(node_root: str | os.PathLike[str]) -> list[str]:
    """``node ls``: the native filler (if one answers), its objects and layers; on a host
    that cannot run one, why, and that lazy sandboxes pull their layers in full."""
    root = os.path.abspath(node_root)
    if not os.path.isdir(os.path.join(root, "objects")):
        why = supported()
        return [f"native filler: unavailable ({why}): lazy sandboxes pull their layers "
                "in full"] if why else []
    from runtime_shim.lazyfs.objgc import describe_objects

    ping = filler_request(root, {"op": "ping"}, 5.0)
    o = describe_objects(root)
    filler = (f"native filler pid {ping.get('pid')} (fanotify pre-content), "
              f"{ping.get('fills')} fills, {ping.get('failures')} failed") if ping \
        else "native filler: not running"
    return [filler, f"objects: {o['objects']} ({o['complete']} complete, {o['partial']} "
                    f"partial, {o['placeholders']} empty placeholders), {o['bytes']} bytes on "
                    f"disk; in use by the {o['layers_mounted']} mounted native layers: "
                    f"{o['in_use']} ({o['in_use_bytes']} bytes); layer records: "
                    f"{o['layer_records']}"]
