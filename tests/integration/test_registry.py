"""A registry is a store: the busybox env through a real Debian ``docker-registry`` (2.8).

Machine A builds with ``--cache-to docker://…``; machine B (empty store and node cache) builds
with ``--cache-from docker://…`` and builds nothing; ``plan --store docker://…`` shows the
statuses; ``push``/``pull`` copy the lock, skopeo reads what was pushed, a pulled lock runs;
lazy reads go through ranged blob GETs; a copy between two repositories of one registry mounts
blobs instead of moving them.
"""

from __future__ import annotations

import json
import subprocess
import urllib.parse

import pytest

from envbuild.store import LocalStore
from envbuild.store.lazy import LazyLayer
from envbuild.store.registry import EMPTY_DIGEST, RegistryStore
from envbuild.store.sync import sync
from tests.conftest import require_tool
from tests.integration.conftest import Env, build_busybox_env
from tests.store.registry_server import TamperingProxy, running_registry


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The busybox env built once into a local store: ``(LocalStore, lock digest)``."""
    store, _node = build_busybox_env(tmp_path_factory.mktemp("built"))
    return store, store.get_ref("env/busybox-shell").digest


def test_cache_to_then_cache_from_builds_nothing(envbuild_cli, registry, tmp_path, monkeypatch,
                                                 capsys):
    url = registry.url("team/cache")
    machine_a = envbuild_cli
    r = machine_a("--cache-to", url, "build", "busybox-shell", "--json")
    assert r.code == 0, r.err
    built = r.json()
    assert {o["status"] for o in built["layers"]} == {"built"}

    # the registry now holds the key records as artifacts and the lock as the tag
    remote = RegistryStore(url)
    tags = set(remote._tags())
    assert "busybox-shell" in tags
    assert sum(t.startswith("envbuild-key-") for t in tags) == len(built["layers"])

    r = machine_a("--store", url, "plan", "busybox-shell", "--json")
    assert r.code == 0, r.err
    assert {s["status"] for s in r.json()["layers"]} == {"cached"}
    r = machine_a("--store", registry.url("team/empty"), "plan", "busybox-shell", "--json")
    assert r.code == 0, r.err
    assert {s["status"] for s in r.json()["layers"]} == {"missing"}

    machine_b = Env(store=tmp_path / "b-store", node=tmp_path / "b-node", defs=machine_a.defs,
                    monkeypatch=monkeypatch, capsys=capsys)
    r = machine_b("--cache-from", url, "build", "busybox-shell", "--json")
    assert r.code == 0, r.err
    report = r.json()
    assert [o["status"] for o in report["layers"]] == ["cached"] * len(built["layers"])
    assert report["locks"] == built["locks"]  # the same lock, byte for byte
    b = LocalStore(tmp_path / "b-store")
    assert all(b.exists(o["digest"]) for o in report["layers"])
    builds = tmp_path / "b-node" / "builds"
    assert not builds.exists() or not any(builds.iterdir())


def test_push_skopeo_reads_it_pull_runs_it(built, registry, envbuild_cli, tmp_path):
    src, lock = built
    url = registry.url("team/envs")
    r = envbuild_cli("--store", str(src.root), "push", "busybox-shell", "--to", url)
    assert r.code == 0, r.err
    assert f"env/busybox-shell {lock}" in r.out

    skopeo = require_tool("skopeo")
    proc = subprocess.run([skopeo, "inspect", "--tls-verify=false", "--raw",
                           f"docker://{registry.host}/team/envs:busybox-shell"],
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    with src.get(lock) as f:
        assert proc.stdout == f.read()  # the lock itself, byte for byte
    proc = subprocess.run([skopeo, "inspect", "--tls-verify=false",
                           f"docker://{registry.host}/team/envs:busybox-shell"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["Digest"] == lock

    # pull into the CLI's own (fresh) store, pinned to the digest, and run it from there
    r = envbuild_cli("pull", f"busybox-shell@{lock}", "--from", url)
    assert r.code == 0, r.err
    assert LocalStore(envbuild_cli.store).get_ref("env/busybox-shell").digest == lock
    r = envbuild_cli("run", "busybox-shell", "--", "sh", "-c", "echo from-registry")
    assert r.code == 0, r.err
    assert "from-registry" in r.out


def test_lazy_reads_are_ranged_blob_gets(built, registry):
    src, lock = built
    remote = RegistryStore(registry.url("team/lazy"))
    sync(src, remote, refs=["env/busybox-shell"])
    manifest = json.loads(src.get(lock).read())
    layer = max(manifest["layers"], key=lambda d: d["size"])  # the base: busybox
    lazy = LazyLayer(remote, layer["digest"])  # no size: footer by one suffix-range GET
    local = LazyLayer(src, layer["digest"], size=layer["size"])
    assert lazy.read("bin/busybox") == local.read("bin/busybox")
    assert lazy.stats.requests <= 4
    assert lazy.stats.bytes_fetched < layer["size"] * 1.05


def test_copy_between_repositories_mounts_blobs(built, registry):
    """Two repositories of one registry: blobs are mounted (POST ?mount=&from=), no upload."""
    src, lock = built
    first = RegistryStore(registry.url("team/first"))
    sync(src, first, refs=["env/busybox-shell"])
    seen: list[tuple[str, str]] = []

    def count(method, path, status, headers, body):
        seen.append((method, path))
        return status, headers, body

    with TamperingProxy(registry.host, count) as proxy:
        from_ = RegistryStore(f"docker://{proxy.host}/team/first")
        second = RegistryStore(f"docker://{proxy.host}/team/second")
        report = sync(from_, second, refs=["env/busybox-shell"])
    assert report.refs == {"env/busybox-shell": lock}
    mounts = [p for m, p in seen if m == "POST" and "mount=" in p]
    assert len(mounts) == len(report.blobs_copied) > 0
    # the only uploads are the key records' small JSON blobs (and the empty config of their
    # artifacts), written anew for the records
    uploaded = {urllib.parse.unquote(p.split("digest=")[1])[:71] for m, p in seen
                if m == "PUT" and "/blobs/uploads/" in p} - {EMPTY_DIGEST}
    assert len(uploaded) == len(report.records_copied)
    assert uploaded.isdisjoint(report.blobs_copied)  # no layer went through the client
    assert RegistryStore(registry.url("team/second")).get_ref("env/busybox-shell").digest == lock


def test_registry_as_the_primary_store(envbuild_cli, registry):
    """``--store docker://…`` for everything: build, a second build that builds nothing, lock,
    run (the node cache pulls the layers from the registry)."""
    url = registry.url("team/primary")
    r = envbuild_cli("--store", url, "build", "busybox-shell", "--json")
    assert r.code == 0, r.err
    first = r.json()
    assert {o["status"] for o in first["layers"]} == {"built"}
    r = envbuild_cli("--store", url, "build", "busybox-shell", "--json")
    assert r.code == 0, r.err
    assert {o["status"] for o in r.json()["layers"]} == {"cached"}
    r = envbuild_cli("--store", url, "lock", "busybox-shell")
    assert r.code == 0, r.err
    assert first["locks"][0]["digest"] in r.out
    r = envbuild_cli("--store", url, "run", "busybox-shell", "--", "sh", "-c", "echo primary")
    assert r.code == 0, r.err
    assert "primary" in r.out
    assert not envbuild_cli.store.exists()  # nothing went to a local store
