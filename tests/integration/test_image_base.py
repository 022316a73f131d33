"""Bases from registry images (issue 16, item 4): ``from: {image: HOST/REPO@sha256:…}``
pulls the image from a real ``docker-registry`` (an OCI index: the host's platform is
picked), applies its layers with their whiteouts, keeps the image config's Env, WorkingDir
and Cmd, re-encodes it as an envbuild base layer, and the env runs as a sandbox. A tag is
refused at planning with the digest it resolves to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

from envbuild.store.registry import RegistryStore
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root, require_tool
from tests.integration.conftest import build_busybox_env, copy_busybox_defs
from tests.integration.foreign_images import add_entry, add_file, add_image, add_index, layer_tar
from tests.store.registry_server import running_registry


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """``(registry host, index digest, tmp root)``: the busybox lock as gzip layers plus a layer
    that whites out the shtest toolkit and adds IMAGE_VAR to its Env, in an index with an
    arm64 entry first, pushed with ``skopeo copy --all``."""
    require_root()
    skopeo = require_tool("skopeo")
    root = tmp_path_factory.mktemp("image-base")
    store, _ = build_busybox_env(root / "src")
    layout = root / "layout"
    proc = subprocess.run([skopeo, "copy", "-q", "--dest-compress", "--dest-compress-format",
                           "gzip", f"oci:{store.root}:env/busybox-shell", f"oci:{layout}:gz"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

    def top(tar: tarfile.TarFile) -> None:
        add_entry(tar, "opt/toolkits", tarfile.DIRTYPE)
        add_file(tar, "opt/toolkits/.wh.shtest")
        add_file(tar, "etc/from-image", b"image\n")

    add_image(layout, "amd", "gz", [(layer_tar(top), "tar+gzip")], extra_env=["IMAGE_VAR=yes"])
    add_image(layout, "arm", None, [(layer_tar(lambda t: add_file(t, "arm", b"")), "tar")])
    add_index(layout, "multi", [("arm", "linux/arm64"), ("amd", "linux/amd64")])
    with running_registry(root / "registry") as reg:
        proc = subprocess.run([skopeo, "copy", "-q", "--all", "--dest-tls-verify=false",
                               f"oci:{layout}:multi", f"docker://{reg.host}/base/bb:v1"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        # skopeo re-encodes the plain arm64 layer, so the index digest is the registry's
        desc = RegistryStore(reg.url("base/bb")).get_ref("env/v1")
        assert desc.media_type == "application/vnd.oci.image.index.v1+json"
        yield reg.host, desc.digest, root


def _defs(root, image: str):
    defs = root / "envdefs"
    copy_busybox_defs(defs)
    (defs / "base" / "from-image.yaml").write_text(f"""\
apiVersion: envbuild/v1
kind: Base
name: from-image
abi: busybox-amd64
from:
  image: "{image}"
steps:
  - run: echo built-on-image > /etc/step
    network: none
""")
    (defs / "envs" / "img-shell.yaml").write_text("""\
apiVersion: envbuild/v1
kind: Env
name: img-shell
base: from-image
workspace: kvsh
toolkits: []
""")
    return defs


def _build(root, defs, *args, target="img-shell", **extra):
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(root / "node"),
           "ENVBUILD_STORE": str(root / "store"), "ENVBUILD_DEFS": str(defs), **extra}
    return subprocess.run([sys.executable, "-m", "envbuild.cli", *(args or ("build", target))],
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_base_from_a_registry_image_builds_and_runs(pushed, tmp_path):
    host, index, _ = pushed
    defs = _defs(tmp_path, f"{host}/base/bb@{index}")
    proc = _build(tmp_path, defs)
    assert proc.returncode == 0, proc.stderr
    with Sandbox.create("img-shell", store=tmp_path / "store",
                        node_dir=tmp_path / "node") as sb:
        r = sb.exec("cat /etc/from-image /etc/step; ls -A /opt/toolkits; echo $IMAGE_VAR; "
                    "echo $KV_FILE; ls / | grep -c '^arm$'; true")
    assert r.exit_code == 0, r.stderr
    # the amd64 image (not the arm64 one), its whiteout applied, its Env kept
    assert r.stdout.decode().split() == ["image", "built-on-image", "yes", "/workspace/.kv",
                                         "0"]
    # a second build is all cache hits: the digest is the key, no re-pull
    again = _build(tmp_path, defs)
    assert again.returncode == 0, again.stderr
    assert "from-image: cached" in again.stderr


def test_a_tag_is_refused_with_the_digest_it_resolves_to(pushed, tmp_path):
    host, index, _ = pushed
    proc = _build(tmp_path, _defs(tmp_path, f"{host}/base/bb:v1"))
    assert proc.returncode == 1
    assert f"resolves to {index}" in proc.stderr and "Traceback" not in proc.stderr
    assert f"{host}/base/bb@{index}" in proc.stderr
    assert not (tmp_path / "store" / "index.json").exists() or \
        "img-shell" not in (tmp_path / "store" / "index.json").read_text()


def test_envbuild_platform_picks_another_image_of_the_index(pushed, tmp_path):
    """``ENVBUILD_PLATFORM=linux/arm64``: the index's arm64 entry (one file, no shell), built
    as a base with no steps; its key differs from the amd64 one."""
    host, index, _ = pushed
    defs = _defs(tmp_path, f"{host}/base/bb@{index}")
    (defs / "base" / "from-image.yaml").write_text(f"""\
apiVersion: envbuild/v1
kind: Base
name: from-image
abi: busybox-amd64
from:
  image: "{host}/base/bb@{index}"
""")
    amd = _build(tmp_path, defs, "plan", "from-image", "--json")
    arm = _build(tmp_path, defs, "plan", "from-image", "--json", ENVBUILD_PLATFORM="linux/arm64")
    assert amd.returncode == 0 and arm.returncode == 0, amd.stderr + arm.stderr
    assert amd.stdout != arm.stdout  # the platform is part of the key
    flag = _build(tmp_path, defs, "--platform", "linux/arm64", "plan", "from-image", "--json")
    assert flag.returncode == 0 and flag.stdout == arm.stdout, flag.stderr  # --platform = the env
    bad = _build(tmp_path, defs, "--platform", "arm64", "plan", "from-image")
    assert bad.returncode != 0 and "OS/ARCH" in bad.stderr and "Traceback" not in bad.stderr
    proc = _build(tmp_path, defs, "build", "from-image", "--json",
                  ENVBUILD_PLATFORM="linux/arm64")
    assert proc.returncode == 0, proc.stderr
    [layer] = json.loads(proc.stdout)["layers"]
    assert layer["key"] == json.loads(arm.stdout)["layers"][0]["key"]
    ls = _build(tmp_path, defs, "layer", "ls", layer["digest"])
    assert ls.returncode == 0, ls.stderr
    assert ls.stdout.split() == ["arm"]
