"""The ``store`` fixture: every conformance test runs once per backend.

Adding a backend (S3) is one entry in ``BACKENDS``: a function that takes pytest's ``request``
and ``tmp_path`` and returns a ``Backend`` — the store, how to corrupt one of its blobs behind
its back, whether it streams (bounded memory) or keeps blobs in memory, and how to open a second
handle on the same store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from envbuild.store import LocalStore, MemoryStore, Store
from tests.store.s3server import moto_s3  # noqa: F401  (session fixture used by _s3)


@dataclasses.dataclass
class Backend:
    store: Store
    corrupt: Callable[[str, bytes], None]  # replace a stored blob's bytes, bypassing put
    streams: bool  # put/get use bounded memory (false for MemoryStore, which holds blobs)
    reopen: Callable[[], Store]  # a second handle on the same store


def _memory(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    store = MemoryStore()
    return Backend(store, corrupt=store.blobs.__setitem__, streams=False,
                   reopen=lambda: store)


def _local(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    store = LocalStore(tmp_path / "store")

    def corrupt(digest: str, data: bytes) -> None:
        store.blob_path(digest).write_bytes(data)

    return Backend(store, corrupt=corrupt, streams=True,
                   reopen=lambda: LocalStore(tmp_path / "store"))


def _s3(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A fresh prefix in one bucket of the session's moto server (which accepts 1 MiB parts).
    1 MiB parts, 2 in flight: a 20 MiB blob is a parallel multipart upload and a parallel
    ranged download, and memory stays within the conformance bound."""
    from envbuild.store.s3 import S3Store
    from tests.store.s3server import session

    server = request.getfixturevalue("moto_s3")
    if not hasattr(server, "bucket"):
        server.bucket = server.make_bucket("conformance")
    prefix = f"t-{tmp_path.name}-{id(tmp_path):x}"

    def open_() -> Store:
        return S3Store(server.bucket, prefix, endpoint_url=server.endpoint, session=session(),
                       part_size=1 << 20, concurrency=2,
                       parallel_get=4 << 20)

    store = open_()

    def corrupt(digest: str, data: bytes) -> None:
        server.client().put_object(Bucket=server.bucket, Key=store._blob_key(digest), Body=data)

    return Backend(store, corrupt=corrupt, streams=True, reopen=open_)


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], Backend]] = {
    "memory": _memory,
    "local": _local,
    "s3": _s3,
}


def starts_a_server(item: pytest.Item) -> bool:
    """Whether a store test starts the moto S3 server (directly, or as the ``s3`` backend)."""
    callspec = getattr(item, "callspec", None)
    return ("moto_s3" in getattr(item, "fixturenames", ())
            or (callspec is not None and callspec.params.get("backend") == "s3"))


def pytest_collection_modifyitems(config, items):
    """Store tests that start a server are integration tests (``-m "not integration"`` runs
    the memory and local backends only). tests/unit/test_markers.py checks it."""
    for item in items:
        if "tests/store/" in str(item.fspath) and starts_a_server(item):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return BACKENDS[request.param](request, tmp_path)


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.store
