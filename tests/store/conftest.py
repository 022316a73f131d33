"""The ``store`` fixture: every conformance test runs once per backend.

Adding a backend (S3) is one entry in ``BACKENDS``: a function that takes pytest's ``request``
and ``tmp_path`` and returns a ``Backend`` — the store, how to corrupt one of its blobs behind
its back, whether it streams (bounded memory) or keeps blobs in memory, and how to open a second
handle on the same store.

A test that needs something a backend cannot do by nature is marked
``@pytest.mark.needs("capability")``; a backend lists what it lacks, with the reason, in
``Backend.lacks``, and such a test is then a strict ``xfail`` with that reason on it (it still
runs, and must fail: when a backend gains the capability the mark has to go). Never a skip.
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
    lacks: dict[str, str] = dataclasses.field(default_factory=dict)  # capability -> why


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


REGISTRY_LACKS = {
    "list-unreferenced": "the distribution API lists tags, not blobs: list() yields only the "
                         "blobs a tag reaches",
    "blob-age": "a registry reports no blob ages (no Last-Modified on blob HEADs), so "
                "envbuild gc never deletes a registry blob; the registry's garbage-collect does",
    "cas": "distribution has no conditional manifest PUT (If-Match is ignored), so expect= is "
           "refused (cas-unsupported) rather than raced",
}


@pytest.fixture(scope="session")
def docker_registry(tmp_path_factory):
    """Debian's docker-registry on 127.0.0.1, no auth (stopped and removed after the session)."""
    from tests.store.registry_server import running_registry

    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="session")
def docker_registry_auth(tmp_path_factory):
    """The same with htpasswd basic auth (bcrypt entry made by apache2-utils' htpasswd)."""
    from tests.store.registry_server import running_registry

    with running_registry(tmp_path_factory.mktemp("registry-auth"), auth="htpasswd") as reg:
        yield reg


@pytest.fixture(scope="session")
def docker_registry_token(tmp_path_factory):
    """The same with Bearer token auth: a token server on loopback issuing RS256 JWTs the
    registry trusts (distribution's ``auth: token``)."""
    from tests.store.registry_server import running_registry

    with running_registry(tmp_path_factory.mktemp("registry-token"), auth="token") as reg:
        yield reg


def _registry_backend(fixture: str):
    def make(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
        from envbuild.store.registry import RegistryStore

        reg = request.getfixturevalue(fixture)
        repo = f"conformance/t{abs(hash(request.node.nodeid)):x}-{id(tmp_path):x}"
        creds = ({"credentials": None,
                  "auth_paths": [reg.auth_file(tmp_path / "auth")]} if reg.auth
                 else {"auth_paths": []})
        if reg.auth:  # another process reopening it by URL (Locatable) finds them like podman
            request.getfixturevalue("monkeypatch").setenv("REGISTRY_AUTH_FILE",
                                                          str(creds["auth_paths"][0]))

        def open_() -> Store:
            # 1 MiB chunks: a 20 MiB blob is a chunked upload, memory stays within the bound
            return RegistryStore(reg.url(repo), chunk_size=1 << 20, **creds)

        def corrupt(digest: str, data: bytes) -> None:
            # the registry keeps one copy of a blob for all its repositories: put the good
            # bytes back after the test, or the next tests would read the damage
            path = reg.blob_file(digest)
            good = path.read_bytes()
            request.addfinalizer(lambda: path.write_bytes(good))
            path.write_bytes(data)

        return Backend(open_(), corrupt=corrupt, streams=True, reopen=open_,
                       lacks=REGISTRY_LACKS)

    return make


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], Backend]] = {
    "memory": _memory,
    "local": _local,
    "s3": _s3,
    "registry": _registry_backend("docker_registry"),
    "registry-auth": _registry_backend("docker_registry_auth"),
    "registry-token": _registry_backend("docker_registry_token"),
}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "needs(capability): the test needs a capability some "
                                       "store backends lack (conftest.Backend.lacks)")


SERVER_BACKENDS = ("s3", "registry", "registry-auth", "registry-token")


def starts_a_server(item: pytest.Item) -> bool:
    """Whether a store test starts a server (moto S3 or a registry: directly, or as a
    backend)."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    names = getattr(item, "fixturenames", ())
    return ("moto_s3" in names or any(n.startswith("docker_registry") for n in names)
            or params.get("backend") in SERVER_BACKENDS
            or params.get("declared") in SERVER_BACKENDS)


def pytest_collection_modifyitems(config, items):
    """Store tests that start a server are in the integration tier; the others get this
    directory's tier, fast (tests/conftest.py DIRECTORY_TIERS): ``-m fast`` runs the memory
    and local backends only. tests/integration/test_markers.py checks it."""
    for item in items:
        if "tests/store/" in str(item.fspath) and starts_a_server(item):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    b = BACKENDS[request.param](request, tmp_path)
    for mark in request.node.iter_markers("needs"):
        for capability in mark.args:
            if capability in b.lacks:
                request.applymarker(pytest.mark.xfail(
                    reason=f"{request.param} cannot: {b.lacks[capability]}", strict=True))
    return b


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.store


def _backend_types() -> dict[str, type]:
    from envbuild.store.registry import RegistryStore
    from envbuild.store.s3 import S3Store

    return {"memory": MemoryStore, "local": LocalStore, "s3": S3Store,
            "registry": RegistryStore, "registry-auth": RegistryStore,
            "registry-token": RegistryStore}


#: The class of each backend, so tests can be parametrized by what a backend declares.
BACKEND_TYPES: dict[str, type] = _backend_types()


def declaring(capability: type) -> list[str]:
    """The backends whose class declares ``capability`` (lists it among its bases)."""
    return sorted(n for n, cls in BACKEND_TYPES.items() if capability in cls.__mro__)


@pytest.fixture
def declared(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A backend named by indirect parametrization (``declaring(...)``)."""
    return BACKENDS[request.param](request, tmp_path)
