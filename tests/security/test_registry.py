"""A hostile network between envbuild and a registry: a proxy that alters blobs and manifests
on the way. Every byte read from a registry is checked against its digest, so a pull fails
with one line and stores nothing (the real Debian ``docker-registry`` behind a real loopback
HTTP proxy)."""

from __future__ import annotations

from envbuild.store import LocalStore
from envbuild.store.registry import RegistryStore
from envbuild.store.sync import sync
from tests.integration.test_registry import built, registry  # noqa: F401  (fixtures)
from tests.integration.test_registry_errors import nothing_pulled, one_line
from tests.store.registry_server import TamperingProxy


def _flip_last(body: bytes) -> bytes:
    return body[:-1] + bytes([body[-1] ^ 1]) if body else body


def test_proxy_altering_blobs_is_caught(envbuild_cli, built, registry):  # noqa: F811
    src, _ = built
    sync(src, RegistryStore(registry.url("team/mitm")), refs=["env/busybox-shell"])
    altered = []

    def tamper(method, path, status, headers, body):
        if method == "GET" and "/blobs/sha256:" in path and status == 200 and len(body) > 4096:
            altered.append(path)
            return status, headers, _flip_last(body)
        return status, headers, body

    with TamperingProxy(registry.host, tamper) as proxy:
        r = envbuild_cli("pull", "busybox-shell", "--from", f"docker://{proxy.host}/team/mitm")
    assert altered, "the proxy never saw a layer: the test proves nothing"
    one_line(r, "is corrupt", "hashes to")
    assert nothing_pulled(envbuild_cli.store)
    store = LocalStore(envbuild_cli.store)
    assert not any(store.exists(p.rsplit("/", 1)[1]) for p in altered)


def test_proxy_altering_a_manifest_is_caught(envbuild_cli, built, registry):  # noqa: F811
    src, lock = built
    sync(src, RegistryStore(registry.url("team/mitm2")), refs=["env/busybox-shell"])
    altered = []

    def tamper(method, path, status, headers, body):
        if method == "GET" and "/manifests/" in path and status == 200:
            altered.append(path)
            # a layer digest swapped for another: same length, a different lock
            return status, headers, body.replace(b'"size":', b'"size": ', 1)
        return status, headers, body

    with TamperingProxy(registry.host, tamper) as proxy:
        r = envbuild_cli("pull", "busybox-shell", "--from", f"docker://{proxy.host}/team/mitm2")
    assert altered
    one_line(r, "manifest busybox-shell is corrupt", "hashes to")
    assert nothing_pulled(envbuild_cli.store)
