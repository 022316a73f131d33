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


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], Backend]] = {
    "memory": _memory,
    "local": _local,
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return BACKENDS[request.param](request, tmp_path)


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.store
