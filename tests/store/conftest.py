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


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return BACKENDS[request.param](request, tmp_path)


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.store


def _backend_types() -> dict[str, type]:
    from envbuild.store.s3 import S3Store

    return {"memory": MemoryStore, "local": LocalStore, "s3": S3Store}


#: The class of each backend, so tests can be parametrized by what a backend declares.
BACKEND_TYPES: dict[str, type] = _backend_types()


def declaring(capability: type) -> list[str]:
    """The backends whose class declares ``capability`` (lists it among its bases)."""
    return sorted(n for n, cls in BACKEND_TYPES.items() if capability in cls.__mro__)


@pytest.fixture
def declared(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A backend named by indirect parametrization (``declaring(...)``)."""
    return BACKENDS[request.param](request, tmp_path)
