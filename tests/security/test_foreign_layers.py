"""Attacks through foreign layers (issue 16, item 3): an OCI image whose layers are plain or
gzip tars reaches the node cache's full unpack, so every trick of a crafted tar is tried there
against the real node cache and runc sandbox: device nodes, a symlink planted to write outside
the layer, a whiteout that names its parent, overlay xattrs, and a blob that does not match the
digest its manifest names (checked at the end of the stream, past the tar's end). Each is
refused with one error, and nothing is left in the node cache's ``layers/``."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile

import pytest

from envbuild.errors import EnvbuildError
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root, require_tool
from tests.integration.foreign_images import add_entry, add_file, add_image, layer_tar


@pytest.fixture(scope="module")
def layout(busybox_store, tmp_path_factory):
    """An OCI layout with the busybox lock as gzip layers (tag ``gz``, a skopeo copy)."""
    require_root()
    skopeo = require_tool("skopeo")
    store, _ = busybox_store
    out = tmp_path_factory.mktemp("foreign-sec") / "images"
    proc = subprocess.run([skopeo, "copy", "-q", "--dest-compress", "--dest-compress-format",
                           "gzip", f"oci:{store.root}:env/busybox-shell", f"oci:{out}:gz"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


def _image(layout, tmp_path, tag, build, kind="tar+gzip", tamper=False, pad=0):
    dest = tmp_path / "images"
    shutil.copytree(layout, dest)
    add_image(dest, tag, "gz", [(layer_tar(build) + bytes(pad), kind)], tamper=tamper)
    return dest


def _refused(store, tmp_path, tag, says):
    node = tmp_path / "node"
    with pytest.raises(EnvbuildError) as info:
        Sandbox.create(tag, store=store, node_dir=node)
    assert says in info.value.message, info.value.message
    assert "\n" not in info.value.message
    layers = node / "node" / "layers"
    # the busybox layers below may be there; the crafted top layer is not, nor a temp dir
    top = json.loads((store / "index.json").read_text())["manifests"][-1]
    manifest = json.loads((store / "blobs/sha256" / top["digest"][7:]).read_bytes())
    assert not (layers / manifest["layers"][-1]["digest"][7:]).exists()
    assert list((node / "node" / "tmp").iterdir()) == []
    return info.value


def test_device_node_in_a_foreign_layer_is_refused(layout, tmp_path):
    def build(tar):
        add_entry(tar, "dev-mem", tarfile.CHRTYPE, devmajor=1, devminor=1, mode=0o666)

    store = _image(layout, tmp_path, "dev", build)
    _refused(store, tmp_path, "dev", "is a char device node, refused")


def test_symlink_planted_to_write_outside_is_refused(layout, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()

    def build(tar):
        add_entry(tar, "escape", tarfile.SYMTYPE, linkname=str(outside))
        add_file(tar, "escape/pwned", b"owned")

    store = _image(layout, tmp_path, "sym", build)
    _refused(store, tmp_path, "sym", "escape")
    assert list(outside.iterdir()) == []


def test_whiteout_naming_its_parent_is_refused(layout, tmp_path):
    def build(tar):
        add_entry(tar, "etc", tarfile.DIRTYPE)
        add_file(tar, "etc/.wh..")

    store = _image(layout, tmp_path, "whdot", build)
    _refused(store, tmp_path, "whdot", "names no file")


def test_overlay_xattr_in_a_foreign_layer_is_refused(layout, tmp_path):
    def build(tar):
        info = tarfile.TarInfo("opq")
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        info.pax_headers = {"SCHILY.xattr.trusted.overlay.opaque": "y"}
        tar.addfile(info)

    store = _image(layout, tmp_path, "xattr", build)
    _refused(store, tmp_path, "xattr", "overlayfs would act on it")


def test_blob_that_does_not_match_its_digest_is_refused(layout, tmp_path):
    """The flipped byte lies 3 MiB past the tar's end-of-archive blocks (zero padding, which
    tar readers ignore): the unpacker stops before it, so only the node cache reading the
    verifying stream to its end catches it."""
    def build(tar):
        add_file(tar, "hello", b"hi")

    store = _image(layout, tmp_path, "tamper", build, kind="tar", tamper=True, pad=3 << 20)
    err = _refused(store, tmp_path, "tamper", "corrupt")
    assert "hashes to" in err.message
