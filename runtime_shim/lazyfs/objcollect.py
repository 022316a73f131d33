"""``node gc``'s side of the object store's eviction (``objgc``, whose docstring says what
is evicted and why it is safe): the unused layers found and held under their locks, then the
removal asked of the filler, or done here under the holder's lock when none answers."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from typing import Any

from runtime_shim.lazyfs.filler import LOCK
from runtime_shim.lazyfs.native import filler_request
from runtime_shim.lazyfs.objects import ObjectStore
from runtime_shim.lazyfs.objgc import MAX_LAYERS, drop_records, mounted_layers, unlink_unused

#: How long a gc with no filler answering waits for the holder's lock (a holder that
#: ``native.shutdown`` just stopped lets it go as it exits).
HOLDER_EXIT = 5.0


def collect_objects(node_root: str, max_bytes: int | None = None) -> dict[str, Any]:
    """``node gc``: unlink the objects no used layer names and drop the unused layers'
    records; with ``max_bytes``, empty idle objects of mounted layers until the filled
    ones take at most that (``objgc``). What was done, as data."""
    root = os.path.abspath(node_root)
    objects = ObjectStore(root)
    if not os.path.isdir(objects.data):
        return {}
    with _unused_layers(root, objects) as free:
        req = {"op": "evict", "layers": free, "max_bytes": max_bytes}
        reply = filler_request(root, req, timeout=600.0)
        if reply is None:
            reply = _evict_here(objects, free)
    if not reply.get("ok"):
        from envbuild.errors import RuntimeShimError

        raise RuntimeShimError(f"evict the node's objects: {reply.get('error')}",
                               hint=f"see {os.path.join(objects.root, 'filler.log')}")
    reply.pop("ok", None)
    return reply


@contextlib.contextmanager
def _unused_layers(root: str, objects: ObjectStore) -> Iterator[list[str]]:
    """The layers with a record that are neither mounted nor being made ready, each held
    under its lock (no create can place or mount it) while the caller works."""
    mounted = mounted_layers(root)
    held: list[int] = []
    free: list[str] = []
    try:
        for hexd in sorted(objects.layer_records()):
            if hexd in mounted:
                continue
            fd = _try_lock(os.path.join(root, "locks", f"native-{hexd}.meta.lock"))
            if fd is None:
                continue   # a create holds it: used
            held.append(fd)
            if hexd not in mounted_layers(root):   # mounted just before we took it
                free.append(hexd)
        yield free[:MAX_LAYERS]
    finally:
        for fd in held:
            os.close(fd)


def _try_lock(path: str) -> int | None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _evict_here(objects: ObjectStore, free: list[str]) -> dict[str, Any]:
    """``evict`` with no filler answering: under the holder's lock (no filler runs or
    starts while it is held, so no placement), taken for each batch; with a holder up (a
    filler starting, or a worker being respawned), nothing more (the next ``node gc``)."""
    lock_path = os.path.join(objects.root, LOCK)

    @contextlib.contextmanager
    def no_filler() -> Iterator[bool]:
        deadline = time.monotonic() + HOLDER_EXIT
        while (fd := _try_lock(lock_path)) is None:   # a holder just stopped may be exiting
            if time.monotonic() > deadline:
                yield False
                return
            time.sleep(0.05)
        try:
            yield True
        finally:
            os.close(fd)
    with no_filler() as ok:
        if not ok:
            return {"ok": True, "skipped": "a filler is starting"}
        drop_records(objects, free)
    n, freed, _ = unlink_unused(objects, no_filler)
    return {"ok": True, "unlinked": n, "unlinked_bytes": freed}


__all__ = ["HOLDER_EXIT", "collect_objects"]
