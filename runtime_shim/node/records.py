"""A node's sandbox records: ``<node dir>/sandboxes/<id>/sandbox.json``, one per sandbox of
any backend, and the store each was made from.

The record is what every process on the node knows of a sandbox it did not make: who made it
(pid), from which lock and layers, with which backend and runtime, its TTL. ``Sandbox.create``
writes it first (a dir with a live creator is never swept), ``list_sandboxes`` reads them all,
and the sweeps (``runtime_shim.sdk.sweep``), reclaim and the node cache's eviction
(``layers_in_use``) decide from it. Version ``SANDBOX_META_VERSION``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError, SandboxNotFound, StoreUnavailable
from envbuild.store import Store
from runtime_shim.isolation import netns
from runtime_shim.node import admission
from runtime_shim.node.layout import NodeLayout, SandboxPaths, default_layout
from runtime_shim.node.ledger import Ledger
from runtime_shim.node.model import SandboxInfo
from runtime_shim.node.owners import owner_alive

SANDBOX_META_VERSION = 1


StoreLike = Store | str | os.PathLike[str]


def open_store(store: StoreLike | None) -> Store:
    """A ``Store`` as is; a directory path or ``s3://`` URL through ``envbuild.store.open_store``
    (``$ENVBUILD_S3_ENDPOINT`` as the CLI reads it); None: the CLI's store (``$ENVBUILD_STORE``,
    else ``cache``)."""
    if store is None:
        from envbuild.settings import DEFAULT_STORE

        store = os.environ.get("ENVBUILD_STORE") or DEFAULT_STORE
    if isinstance(store, (str, os.PathLike)):
        from envbuild.store import open_store as open_url

        where = os.fspath(store)
        try:   # never create a store to read it
            return open_url(where, s3_endpoint=os.environ.get("ENVBUILD_S3_ENDPOINT"),
                            create=False)
        except StoreUnavailable as e:
            if not e.message.startswith("no store at"):
                raise
            raise StoreUnavailable(e.message,
                                   hint="build one with `envbuild build` (--store DIR), or pass "
                                        "store= a Store, a directory or an s3:// URL") from None
    return store


def node_layout(node_dir: str | os.PathLike[str] | NodeLayout | None) -> NodeLayout:
    if node_dir is None:
        return default_layout()
    return node_dir if isinstance(node_dir, NodeLayout) else NodeLayout(node_dir)


def store_url(store: StoreLike) -> str | None:
    """What ``attach`` reopens the store from: the path or URL given, a LocalStore's root."""
    if isinstance(store, (str, os.PathLike)):
        value = os.fspath(store)
        return value if "://" in value else os.path.abspath(value)
    root = getattr(store, "root", None)  # a LocalStore; other stores are passed to attach
    return os.path.abspath(root) if isinstance(root, (str, Path)) else None


@contextlib.contextmanager
def released_on_error(ledger: Ledger, sandbox_id: str) -> Iterator[None]:
    """Give back the sandbox's reservation if the block fails (its dir is removed first)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError, RuntimeShimError):
            ledger.release(admission.sandbox_key(sandbox_id))
        raise


def write_record(paths: SandboxPaths, meta: dict[str, Any]) -> None:
    write_atomic(paths.meta, json.dumps(meta))


def read_record(paths: SandboxPaths) -> dict[str, Any] | None:
    try:
        meta = json.loads(paths.meta.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def sandbox_info(path: Path, meta: dict[str, Any], layout: NodeLayout) -> SandboxInfo:
    pid = int(meta.get("pid", 0))
    ttl = meta.get("ttl")
    start = meta.get("pid_start")  # records before issue 39 have none: the pid alone
    return SandboxInfo(id=path.name, lock=meta.get("lock", "?"), pid=pid,
                       alive=owner_alive(pid, int(start) if start else None),
                       kept=bool(meta.get("kept")),
                       created=float(meta.get("created", 0.0)),
                       layers=tuple(meta.get("layers", ())), path=path,
                       backend=meta.get("backend", "container"),
                       ready=float(meta.get("ready") or 0.0), node=str(layout.root),
                       ttl=float(ttl) if ttl else None,
                       expires=float(meta.get("expires") or 0.0),
                       layer_transport=(meta.get("details") or {}).get("layer_transport"),
                       lazy=str(meta.get("lazy") or ""), runtime=str(meta.get("runtime") or ""))


def list_sandboxes(node_dir: str | os.PathLike[str] | NodeLayout | None = None
                   ) -> list[SandboxInfo]:
    """Every sandbox of a node (default: the CLI's node dir), of every backend, sorted by id;
    a dir without a readable record is listed with ``lock="?"`` and pid 0."""
    layout = node_layout(node_dir)
    found: list[SandboxInfo] = []
    if not layout.sandboxes.is_dir():
        return found
    for d in sorted(layout.sandboxes.iterdir()):
        found.append(sandbox_info(d, read_record(SandboxPaths(d)) or {}, layout))
    return found


def set_sandbox_network(node_dir: str | os.PathLike[str] | NodeLayout | None, sandbox_id: str,
                        network: bool | Sequence[str]) -> None:
    """``Sandbox.set_network`` for a sandbox of this node made by any process
    (``envbuild sandbox network``); ``SandboxNotFound`` if there is none by that id."""
    policy = netns.parse_network(network) or netns.CLOSED  # bad entries: before anything
    paths = node_layout(node_dir).sandbox(sandbox_id)
    if read_record(paths) is None:
        raise SandboxNotFound(f"no sandbox {sandbox_id} on this host",
                              hint="envbuild sandbox ls lists them")
    netns.update(paths.root, policy)


def layers_in_use(node_dir: str | os.PathLike[str] | NodeLayout | None) -> set[str]:
    """Layer digests of the sandboxes on this host that are alive or kept: never evict those."""
    in_use: set[str] = set()
    for info in list_sandboxes(node_dir):
        if info.alive or info.kept:
            in_use.update(info.layers)
    return in_use
