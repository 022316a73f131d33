"""Bad input from a registry (issue 16, item 5): a registry that is down, 401, 403, a manifest of
an unknown media type, a blob whose digest does not match (corrupted on the registry's disk, or
altered by a proxy on the way), a tag that moved — one line with a hint, exit 1, nothing
half-written locally or remotely. Against the real Debian ``docker-registry``; the "proxy" is a
real HTTP intermediary on loopback (``tests.store.registry_server.TamperingProxy``)."""

from __future__ import annotations

import json
import shutil

import pytest

from envbuild.store import LocalStore
from envbuild.store.registry import RegistryStore
from envbuild.store.sync import sync
from tests.integration.test_registry import built, registry  # noqa: F401  (fixtures)
from tests.store.registry_server import TamperingProxy, running_registry
from tests.store.s3server import free_port


@pytest.fixture(scope="module")
def registry_auth(tmp_path_factory):
    with running_registry(tmp_path_factory.mktemp("registry-auth"), auth="htpasswd") as reg:
        yield reg


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """No auth file anywhere envbuild looks (REGISTRY_AUTH_FILE, XDG_RUNTIME_DIR, ~/.docker)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR", "DOCKER_CONFIG"):
        monkeypatch.delenv(var, raising=False)


def one_line(r, *needles: str) -> str:
    """The CLI failed like a user error: exit 1, ``error: …`` and ``hint: …``, no traceback."""
    assert r.code == 1, (r.code, r.err)
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), \
        r.err
    for needle in needles:
        assert needle in r.err, r.err
    return lines[0]


def nothing_pulled(store_dir):
    if not store_dir.exists():
        return True
    store = LocalStore(store_dir)
    return store.list_refs() == [] and list(store.list_partials()) == []


def nothing_pushed(reg, repo: str) -> None:
    remote = RegistryStore(reg.url(repo), auth_paths=[])
    assert remote.list_refs() == []
    uploads = reg.root / "data" / "docker" / "registry" / "v2" / "repositories" / repo / "_uploads"
    # a cancelled session leaves only distribution's empty hashstates/ behind; a live or
    # abandoned one has its startedat and data files
    left = [p for p in uploads.rglob("*") if p.name in ("data", "startedat")]
    assert left == [], f"upload sessions were left: {left}"


def test_registry_down(envbuild_cli, built):  # noqa: F811
    src, _ = built
    url = f"docker://127.0.0.1:{free_port()}/team/envs"
    r = envbuild_cli("pull", "busybox-shell", "--from", url)
    one_line(r, "cannot reach 127.0.0.1", "Connection refused", "registry is up")
    assert nothing_pulled(envbuild_cli.store)
    r = envbuild_cli("--store", str(src.root), "push", "busybox-shell", "--to", url)
    one_line(r, "cannot reach")
    r = envbuild_cli("--store", url, "plan", "busybox-shell")
    one_line(r, "cannot reach")


def test_401_without_and_with_wrong_credentials(  # noqa: F811
        envbuild_cli, built, registry_auth, tmp_path, monkeypatch, no_credentials):
    src, lock = built
    url = registry_auth.url("team/envs")
    r = envbuild_cli("--store", str(src.root), "push", "busybox-shell", "--to", url)
    one_line(r, "requires credentials (401)", f"podman login {registry_auth.host}")
    bad = registry_auth.auth_file(tmp_path / "bad", password="wrong")
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(bad))
    r = envbuild_cli("--store", str(src.root), "push", "busybox-shell", "--to", url)
    one_line(r, "refused the credentials of 'envbuild'", str(bad))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(registry_auth.auth_file(tmp_path / "good")))
    assert RegistryStore(url).list_refs() == []  # nothing went up before the refusals
    r = envbuild_cli("--store", str(src.root), "push", "busybox-shell", "--to", url)
    assert r.code == 0, r.err
    assert RegistryStore(url).get_ref("env/busybox-shell").digest == lock


def test_bearer_token_flow(  # noqa: F811
        envbuild_cli, built, tmp_path, tmp_path_factory, monkeypatch, no_credentials):
    """distribution with ``auth: token``: the registry sends envbuild to a token server (a real
    JWT issuer on loopback); a push gets a pull+push token, a wrong password one line."""
    src, lock = built
    with running_registry(tmp_path_factory.mktemp("registry-token"), auth="token") as reg:
        url = reg.url("team/envs")
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(reg.auth_file(tmp_path / "bad", "nope")))
        r = envbuild_cli("--store", str(src.root), "push", "busybox-shell", "--to", url)
        one_line(r, "token server", "refused the credentials of 'envbuild' (401)",
                 "podman login")
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(reg.auth_file(tmp_path / "good")))
        r = envbuild_cli("--store", str(src.root), "push", "busybox-shell", "--to", url)
        assert r.code == 0, r.err
        granted = [set(s.rpartition(":")[2].split(",")) for s in reg.token_server.requests
                   if s.startswith("repository:team/envs:")]
        assert {"pull", "push"} in granted
        r = envbuild_cli("pull", f"busybox-shell@{lock}", "--from", url)
        assert r.code == 0, r.err


def test_403_on_push(envbuild_cli, built, registry):  # noqa: F811
    src, _ = built

    def deny_uploads(method, path):
        if method == "POST" and "/blobs/uploads/" in path:
            return 403, {"Content-Type": "application/json"}, json.dumps(
                {"errors": [{"code": "DENIED", "message": "requested access to the resource "
                                                          "is denied"}]}).encode()
        return None

    with TamperingProxy(registry.host, intercept=deny_uploads) as proxy:
        r = envbuild_cli("--store", str(src.root), "push", "busybox-shell", "--to",
                         f"docker://{proxy.host}/team/denied")
    one_line(r, "denied access (403 DENIED", "push permission on team/denied")
    nothing_pushed(registry, "team/denied")


def test_unknown_manifest_media_type(envbuild_cli, built, registry):  # noqa: F811
    src, _ = built
    sync(src, RegistryStore(registry.url("team/oddtype")), refs=["env/busybox-shell"])

    def relabel(method, path, status, headers, body):
        if "/manifests/" in path:
            headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
            headers["Content-Type"] = "application/vnd.example.unknown.v1+json"
        return status, headers, body

    with TamperingProxy(registry.host, relabel) as proxy:
        r = envbuild_cli("pull", "busybox-shell", "--from", f"docker://{proxy.host}/team/oddtype")
    one_line(r, "media type 'application/vnd.example.unknown.v1+json'", "skopeo copy --format oci")
    assert nothing_pulled(envbuild_cli.store)


@pytest.fixture
def corrupt_layer_on_disk(built, registry):  # noqa: F811
    """Push the lock to team/rot, then flip a byte of its largest layer in the registry's
    storage (the good bytes go back afterwards: the registry keeps one copy per digest)."""
    src, lock = built
    sync(src, RegistryStore(registry.url("team/rot")), refs=["env/busybox-shell"])
    manifest = json.loads(src.get(lock).read())
    layer = max(manifest["layers"], key=lambda d: d["size"])["digest"]
    path = registry.blob_file(layer)
    good = path.read_bytes()
    path.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    yield layer
    path.write_bytes(good)


def test_blob_corrupted_in_the_registry(envbuild_cli, registry, corrupt_layer_on_disk):
    r = envbuild_cli("pull", "busybox-shell", "--from", registry.url("team/rot"))
    one_line(r, corrupt_layer_on_disk, "is corrupt", "hashes to")
    assert nothing_pulled(envbuild_cli.store)
    assert not LocalStore(envbuild_cli.store).exists(corrupt_layer_on_disk)


def test_push_of_a_corrupt_local_blob_leaves_nothing_in_the_registry(  # noqa: F811
        envbuild_cli, built, registry, tmp_path):
    src, lock = built
    copy = tmp_path / "store-copy"
    shutil.copytree(src.root, copy, symlinks=True)
    manifest = json.loads(src.get(lock).read())
    layer = max(manifest["layers"], key=lambda d: d["size"])["digest"]
    path = LocalStore(copy).blob_path(layer)
    data = bytearray(path.read_bytes())
    data[200] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    r = envbuild_cli("--store", str(copy), "push", "busybox-shell", "--to",
                     registry.url("team/clean"))
    one_line(r, layer, "corrupt")
    nothing_pushed(registry, "team/clean")
    assert not RegistryStore(registry.url("team/clean")).exists(layer)


def test_tag_that_moved(envbuild_cli, built, registry):  # noqa: F811
    src, lock = built
    remote = RegistryStore(registry.url("team/moving"))
    sync(src, remote, refs=["env/busybox-shell"])
    # someone publishes another lock under the same tag (same layers, another annotation)
    doc = json.loads(src.get(lock).read())
    doc.setdefault("annotations", {})["org.example.republished"] = "yes"
    from envbuild.store import put_json

    other = put_json(remote, doc).digest
    remote.put_ref("env/busybox-shell", other)
    r = envbuild_cli("pull", f"busybox-shell@{lock}", "--from", registry.url("team/moving"))
    one_line(r, "moved", f"points at {other} now, not at {lock}", "drop @DIGEST")
    assert nothing_pulled(envbuild_cli.store)
    r = envbuild_cli("pull", f"busybox-shell@{other}", "--from", registry.url("team/moving"))
    assert r.code == 0, r.err
    assert LocalStore(envbuild_cli.store).get_ref("env/busybox-shell").digest == other


def test_transient_failures_are_retried_and_broken_downloads_resumed(  # noqa: F811
        envbuild_cli, built, registry):
    """A registry that answers 503 twice per blob and drops the connection in the middle of
    every first layer download: the pull still succeeds (bounded retries, ranged resume)."""
    src, lock = built
    sync(src, RegistryStore(registry.url("team/flaky")), refs=["env/busybox-shell"])
    seen: dict[str, int] = {}
    cuts: list[str] = []

    def flaky(method, path, status, headers, body):
        if "/blobs/sha256:" in path and method == "GET":
            n = seen[path] = seen.get(path, 0) + 1
            if n <= 2:
                return 503, {"Content-Type": "text/plain"}, b"overloaded"
            if n == 3 and len(body) > 4096:
                cuts.append(path)
                return status, {**headers, "X-Test-Cut-After": str(len(body) // 2)}, body
        return status, headers, body

    with TamperingProxy(registry.host, flaky) as proxy:
        r = envbuild_cli("pull", "busybox-shell", "--from", f"docker://{proxy.host}/team/flaky")
    assert r.code == 0, r.err
    assert cuts and all(seen[p] == 4 for p in cuts)  # 503, 503, cut half-way, resumed
    assert LocalStore(envbuild_cli.store).get_ref("env/busybox-shell").digest == lock


def test_a_registry_that_stays_down_gives_up_in_bounded_time(  # noqa: F811
        envbuild_cli, built, registry):
    import time

    src, _ = built
    sync(src, RegistryStore(registry.url("team/down")), refs=["env/busybox-shell"])

    def down(method, path):
        if "/blobs/" in path:
            return 503, {"Content-Type": "text/plain"}, b"down for maintenance"
        return None

    with TamperingProxy(registry.host, intercept=down) as proxy:
        t0 = time.monotonic()
        r = envbuild_cli("pull", "busybox-shell", "--from", f"docker://{proxy.host}/team/down")
        elapsed = time.monotonic() - t0
    one_line(r, "answered 503", "(4 attempts)", "retry later")
    assert elapsed < 10
    assert nothing_pulled(envbuild_cli.store)
