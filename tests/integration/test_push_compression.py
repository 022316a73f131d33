"""``envbuild push --compression``: Debian's docker 20.10 (``docker.io``, a private dockerd)
pulls a lock pushed with gzip layers to a registry on 127.0.0.1 and builds ``FROM`` it; with
the default zstd it cannot, as users saw; ``none`` works too; a bad value is one line.
``--progress always`` reports a multi-MB push while it moves."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess

import pytest

from envbuild.dockerd import docker_daemon
from envbuild.oci import MEDIA_TYPE_LAYER, MEDIA_TYPE_LAYER_GZIP, MEDIA_TYPE_LAYER_ZSTD
from envbuild.store import LocalStore, get_json, put_bytes, put_json
from envbuild.store.base import MEDIA_TYPE_CONFIG, MEDIA_TYPE_MANIFEST
from envbuild.store.registry import RegistryStore
from tests.conftest import require_tool
from tests.integration.conftest import build_busybox_env
from tests.store.registry_server import running_registry

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    store, _node = build_busybox_env(tmp_path_factory.mktemp("built"))
    return store, store.get_ref("env/busybox-shell").digest


@pytest.fixture(scope="module")
def dockerd(tmp_path_factory):
    """Debian's dockerd 20.10, private to this module (not the user's ``DOCKER_HOST``)."""
    require_tool("dockerd")
    mp = pytest.MonkeyPatch()
    mp.delenv("DOCKER_HOST", raising=False)
    try:
        with docker_daemon(tmp_path_factory.mktemp("dockerd")) as d:
            version = _docker(d, "version", "--format", "{{.Server.Version}}").stdout.strip()
            assert version.startswith("20.10"), version  # the docker users have: Debian's
            yield d
    finally:
        mp.undo()


def _docker(d, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([d.cli, *argv], env=d.env(), capture_output=True, text=True,
                       timeout=300)
    if check:
        assert p.returncode == 0, f"docker {' '.join(argv)}: {p.stderr}{p.stdout}"
    return p


def _forget_images(d) -> None:
    """Remove every image and BuildKit's cache: the locks pushed here share their config (the
    image id) and diff_ids, so a daemon that has one would not download another's layers."""
    ids = _docker(d, "images", "-aq").stdout.split()
    if ids:
        _docker(d, "rmi", "-f", *dict.fromkeys(ids))
    _docker(d, "builder", "prune", "-af")


def _push(envbuild_cli, src: LocalStore, url: str, *extra: str):
    return envbuild_cli("--store", str(src.root), "push", "busybox-shell", "--to", url,
                        *extra)


def test_gzip_push_docker_pulls_and_builds_from_it(built, registry, dockerd, envbuild_cli,
                                                   tmp_path):
    src, lock = built
    url = registry.url("team/docker-gzip")
    r = _push(envbuild_cli, src, url, "--compression", "gzip", "--json")
    assert r.code == 0, r.err
    pushed = r.json()["refs"]["env/busybox-shell"]
    assert pushed != lock  # a new manifest: the layers have new digests

    # gzip layers whose content is the lock's tars: diff_ids (and the config) unchanged
    remote = RegistryStore(url)
    manifest = get_json(remote, pushed)
    config = get_json(remote, manifest["config"]["digest"])
    assert manifest["config"] == get_json(src, lock)["config"]
    assert {layer["mediaType"] for layer in manifest["layers"]} == {MEDIA_TYPE_LAYER_GZIP}
    assert not any("org.envbuild.toc.digest" in (layer.get("annotations") or {})
                   for layer in manifest["layers"])
    for layer, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"], strict=True):
        with remote.get(layer["digest"]) as f:
            tar = gzip.decompress(f.read())
        assert "sha256:" + hashlib.sha256(tar).hexdigest() == diff_id

    # deterministic: pushing again gives the same digests and uploads nothing
    again = _push(envbuild_cli, src, url, "--compression", "gzip", "--json")
    assert again.code == 0, again.err
    assert again.json()["refs"]["env/busybox-shell"] == pushed
    assert again.json()["blobs_copied"] == []

    image = f"{registry.host}/team/docker-gzip:busybox-shell"
    _forget_images(dockerd)
    _docker(dockerd, "pull", image)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM {image}\nRUN echo built-from-the-lock > /marker\n")
    _docker(dockerd, "build", "--network=none", "-t", "derived/from-lock:1", str(ctx))
    p = _docker(dockerd, "run", "--rm", "--network=none", "derived/from-lock:1",
                "cat", "/marker")
    assert p.stdout.strip() == "built-from-the-lock"


def test_zstd_push_is_what_docker_20_10_cannot_pull(built, registry, dockerd, envbuild_cli,
                                                   tmp_path):
    """Without the flag (zstd, the default, unchanged) docker 20.10 fails as users saw."""
    src, lock = built
    url = registry.url("team/docker-zstd")
    r = _push(envbuild_cli, src, url)
    assert r.code == 0, r.err
    manifest = get_json(RegistryStore(url), lock)
    assert {layer["mediaType"] for layer in manifest["layers"]} == {MEDIA_TYPE_LAYER_ZSTD}
    _forget_images(dockerd)
    image = f"{registry.host}/team/docker-zstd:busybox-shell"
    p = _docker(dockerd, "pull", image, check=False)
    assert p.returncode != 0
    # what users saw: dockerd 20.10 takes the zstd stream (with envbuild's skippable TOC
    # frames) for a tar
    assert "failed to register layer" in p.stderr, p.stderr
    assert "invalid tar header" in p.stderr, p.stderr
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM {image}\nRUN true\n")
    p = _docker(dockerd, "build", "--network=none", "-t", "derived/zstd:1", str(ctx),
                check=False)
    assert p.returncode != 0 and "invalid tar header" in p.stderr + p.stdout


def test_none_push_is_plain_tar_docker_pulls_it(built, registry, dockerd, envbuild_cli):
    src, lock = built
    url = registry.url("team/docker-none")
    r = _push(envbuild_cli, src, url, "--compression", "none", "--json")
    assert r.code == 0, r.err
    remote = RegistryStore(url)
    manifest = get_json(remote, r.json()["refs"]["env/busybox-shell"])
    config = get_json(remote, manifest["config"]["digest"])
    assert {layer["mediaType"] for layer in manifest["layers"]} == {MEDIA_TYPE_LAYER}
    # a plain layer's digest is its diff_id
    assert [layer["digest"] for layer in manifest["layers"]] == config["rootfs"]["diff_ids"]
    image = f"{registry.host}/team/docker-none:busybox-shell"
    _forget_images(dockerd)
    _docker(dockerd, "pull", image)
    p = _docker(dockerd, "run", "--rm", "--network=none", image, "echo", "plain-ok")
    assert p.stdout.strip() == "plain-ok"


def test_bad_compression_is_one_line(built, registry, envbuild_cli, tmp_path):
    src, _ = built
    url = registry.url("team/docker-bad")
    for argv in (["push", "busybox-shell", "--to", url, "--compression", "lz4"],
                 ["export", "busybox-shell", "--to", f"oci:{tmp_path / 'out'}",
                  "--compression", "lz4"]):
        r = envbuild_cli("--store", str(src.root), *argv)
        assert r.code == 1, r.err
        # the error line and its hint, as every user error (no usage text, no traceback)
        lines = [line for line in r.err.splitlines() if line.strip()]
        assert lines == ["error: unknown compression 'lz4'",
                         "hint: use one of zstd, gzip, none"], r.err
        assert r.out == ""
    assert RegistryStore(url).list_refs() == []
    assert not (tmp_path / "out").exists()


def test_push_progress_of_a_multi_mb_layer(registry, envbuild_cli, tmp_path):
    """``--progress always`` (what a terminal gets by default) reports bytes as they move and
    a summary; ``--json`` stays alone on stdout."""
    src = LocalStore(tmp_path / "src")
    layer = os.urandom(24 << 20)
    layer_digest = put_bytes(src, layer)
    config = put_json(src, {"architecture": "amd64", "os": "linux",
                            "rootfs": {"type": "layers", "diff_ids": [layer_digest]}},
                      media_type=MEDIA_TYPE_CONFIG).digest
    lock = put_json(src, {"schemaVersion": 2, "mediaType": MEDIA_TYPE_MANIFEST,
                          "config": {"mediaType": MEDIA_TYPE_CONFIG, "digest": config,
                                     "size": src.stat(config).size},
                          "layers": [{"mediaType": MEDIA_TYPE_LAYER_ZSTD,
                                      "digest": layer_digest, "size": len(layer)}]}).digest
    src.put_ref("env/big", lock)
    url = registry.url("team/progress")
    r = envbuild_cli("--store", str(src.root), "push", "big", "--to", url,
                     "--progress", "always", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["refs"] == {"env/big": lock}  # stdout: the JSON only
    lines = r.err.splitlines()
    drawn = [line for line in lines if line.startswith("push: ") and " / " in line]
    assert drawn, r.err
    assert drawn[-1].startswith("push: 25.2 MB / 25.2 MB (100%), "), drawn
    summary = [line for line in lines if line.startswith("push: ") and " in " in line]
    assert len(summary) == 1 and summary[0].startswith("push: 25.2 MB in "), r.err
    assert "\r" not in r.err  # not a terminal: whole lines, no redraws

    # the default (auto) draws nothing into a pipe, but still ends with the summary
    r = envbuild_cli("--store", str(src.root), "push", "big", "--to",
                     registry.url("team/progress-auto"))
    assert r.code == 0, r.err
    assert not [line for line in r.err.splitlines() if " / " in line], r.err
    assert [line for line in r.err.splitlines() if line.startswith("push: 25.2 MB in ")]
