"""Lazy profiles: the files a layer stack's first lazy run read, in order, kept in the store
and prefetched by later runs (stargz's prioritized files, recorded instead of declared)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from envbuild.errors import EnvbuildError
from envbuild.store import Store
from runtime_shim.lazyfs.tree import Node

log = logging.getLogger("envbuild.lazyfs")

#: Store record namespace of lazy profiles; the name is ``profile_key(layer digests)``.
PROFILE_NAMESPACE = "lazy-profiles"
PROFILE_VERSION = 1
#: Seconds after a layer stack's first mount during which its reads are recorded.
PROFILE_WINDOW = 10.0
#: Lifetime of the presigned URL a profile is saved through (``Presigner``): the daemon saves
#: ``PROFILE_WINDOW`` s after the stack's first mount (or at its unmount, if sooner); past it,
#: the daemon falls back to a store client of its own.
PROFILE_PUT_EXPIRES = 3600


class _Trace:
    """The files of a layer in the order they were first read, until ``until`` (monotonic
    clock) or ``max_files``: what a lazy profile records."""

    def __init__(self, until: float, max_files: int = 20000) -> None:
        self.until, self.max_files = until, max_files
        self.paths: list[str] = []
        self._seen: set[int] = set()

    def add(self, node: Node) -> None:
        import time

        if node.ino in self._seen or len(self.paths) >= self.max_files \
                or time.monotonic() > self.until:
            return
        self._seen.add(node.ino)
        self.paths.append(node.read_path)



def profile_key(digests: Sequence[str]) -> str:
    """The name of the lazy profile of a layer stack (bottom to top). Versioned: a profile
    is a hint, but one recorded under another format must not be read as this one."""
    import hashlib

    return hashlib.sha256(("envbuild.lazy-profile.v1\0" + "\0".join(digests)).encode()
                          ).hexdigest()


def read_profile(store: Store, digests: Sequence[str]) -> dict[str, list[str]] | None:
    """Layer digest → the files its stack's first lazy run read, in order (``None``: no
    usable profile). Record ``lazy-profiles/<profile_key>``::

        {"version": 1, "layers": [{"digest": D, "files": [PATH, ...]}, ...]}

    written by the node daemon ``PROFILE_WINDOW`` seconds after it first mounted the stack,
    or when one of its mounts goes away if that is sooner (stargz's prioritized files,
    recorded instead of declared)."""
    try:
        rec = store.get_record(PROFILE_NAMESPACE, profile_key(digests))
    except EnvbuildError as e:  # a hint only: never fail a sandbox for it
        log.warning("read lazy profile: %s", e)
        return None
    if not isinstance(rec, dict) or rec.get("version") != PROFILE_VERSION:
        return None
    out = {}
    for layer in rec.get("layers", ()):
        if isinstance(layer, dict) and isinstance(layer.get("files"), list):
            out[str(layer.get("digest"))] = [str(p) for p in layer["files"]]
    return out

