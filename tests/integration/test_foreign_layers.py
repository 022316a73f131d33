"""Any OCI image runs (issue 16, item 3): a lock whose layers are plain ``tar``, ``tar+gzip``
or another tool's ``tar+zstd`` (a ``skopeo copy`` of the busybox lock into an OCI layout
store) runs as a sandbox through the node cache's full unpack (the safe unpacker) with OCI
whiteouts made overlay whiteouts; lazy mode refuses it in one line with how to convert."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root, require_tool
from tests.integration.conftest import build_busybox_env
from tests.integration.foreign_images import add_entry, add_file, add_image, layer_tar


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """``(layout, node_dir)``: the busybox lock copied by skopeo into a plain OCI layout as
    ``gz`` (gzip), ``zc`` (zstd:chunked) and ``plain`` (plain tar: skopeo 1.9 cannot
    decompress into an OCI layout, so ``envbuild export --compression none`` added it)."""
    require_root()
    skopeo = require_tool("skopeo")
    root = tmp_path_factory.mktemp("foreign")
    store, _ = build_busybox_env(root)
    layout = root / "images"
    src = f"oci:{store.root}:env/busybox-shell"
    for extra, tag in ((["--dest-compress", "--dest-compress-format", "gzip"], "gz"),
                       (["--dest-compress-format", "zstd:chunked"], "zc")):
        proc = subprocess.run([skopeo, "copy", "-q", *extra, src, f"oci:{layout}:{tag}"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "envbuild.cli", "--store", str(store.root),
                           "export", "busybox-shell", "--to", f"oci:{layout}:plain",
                           "--compression", "none"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return layout, root / "node"


def _layer_types(layout, tag):
    index = json.loads((layout / "index.json").read_text())
    [desc] = [m for m in index["manifests"]
              if m["annotations"]["org.opencontainers.image.ref.name"] == tag]
    manifest = json.loads((layout / "blobs/sha256" / desc["digest"][7:]).read_bytes())
    return [layer["mediaType"].rpartition(".")[2] for layer in manifest["layers"]]


@pytest.mark.parametrize("tag,kind", [("gz", "tar+gzip"), ("zc", "tar+zstd"),
                                      ("plain", "tar")])
def test_a_skopeo_copy_of_a_lock_runs_as_a_sandbox(copied, tmp_path, tag, kind):
    layout, _ = copied
    assert _layer_types(layout, tag) == [kind] * 3
    node = tmp_path / "node"
    with Sandbox.create(tag, store=layout, node_dir=node) as sb:
        r = sb.exec("ls /opt/toolkits; pwd; echo $KV_FILE; busybox true && echo ran")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split() == ["shtest", "/workspace", "/workspace/.kv", "ran"]
    # unpacked once each, 0700 like every node cache layer dir
    layers = node / "node" / "layers"
    assert len([p for p in layers.iterdir() if p.is_dir()]) == 3
    assert os.stat(layers).st_mode & 0o777 == 0o700


def test_lazy_mode_refuses_foreign_layers_in_one_line(copied, tmp_path):
    layout, _ = copied
    for tag in ("gz", "zc"):
        with pytest.raises(RuntimeShimError) as info:
            Sandbox.create(tag, store=layout, node_dir=tmp_path / "node", lazy=True)
        assert info.value.message.startswith("lazy mode needs envbuild layers: layer sha256:")
        assert "\n" not in info.value.message
        assert "from: {oci:" in info.value.hint and "without lazy" in info.value.hint
        assert not (tmp_path / "node" / "node" / "native").exists()  # nothing mounted


def test_whiteouts_of_a_foreign_layer_hide_what_lies_below(copied, tmp_path):
    """A gzip layer on the copied lock removes a toolkit (``.wh.shtest``), empties the
    workspace except its own file (``.wh..wh..opq``), and replaces /etc by a directory of its
    own whose lower contents are hidden (an entry plus a whiteout of the same name)."""
    layout, _ = copied

    def build(tar: tarfile.TarFile) -> None:
        add_entry(tar, "opt/toolkits", tarfile.DIRTYPE)
        add_file(tar, "opt/toolkits/.wh.shtest")
        add_entry(tar, "workspace", tarfile.DIRTYPE)
        add_file(tar, "workspace/.wh..wh..opq")
        add_file(tar, "workspace/new.txt", b"new\n")
        add_file(tar, ".wh.etc")   # whiteout before the entry of the same name
        add_entry(tar, "etc", tarfile.DIRTYPE)
        add_file(tar, "etc/only", b"x")

    add_image(layout, "wh", "gz", [(layer_tar(build), "tar+gzip")])
    with Sandbox.create("wh", store=layout, node_dir=tmp_path / "node") as sb:
        r = sb.exec("ls -A /opt/toolkits; echo --; ls -A /workspace; echo --; ls -A /etc")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split() == ["--", "new.txt", "--", "only"]
