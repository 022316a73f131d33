"""Whiteouts against a real overlayfs: capture an upper dir, convert both ways, mount again."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

from envbuild.layers import LayerReader, pack_tree
from tests.conftest import require_root, require_tool
from tests.unit.test_layers_support import snapshot


def _mount(mount, target, **opts):
    o = ",".join(f"{k}={v}" for k, v in opts.items())
    subprocess.run([mount, "-t", "overlay", "overlay", "-o", o, str(target)], check=True,
                   capture_output=True)


def _umount(target):
    subprocess.run(["umount", str(target)], check=True, capture_output=True)


@pytest.mark.integration
def test_overlay_whiteouts_round_trip_through_a_real_mount(tmp_path):
    require_root()
    mount = require_tool("mount")
    require_tool("umount")
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (lower, upper, work, merged):
        d.mkdir()
    (lower / "gone.txt").write_text("deleted in the upper layer")
    (lower / "kept.txt").write_text("kept")
    (lower / "gonedir" / "sub").mkdir(parents=True)
    (lower / "gonedir" / "sub" / "f").write_text("x")
    (lower / "opq").mkdir()
    (lower / "opq" / "old").write_text("hidden by the opaque dir")
    (lower / "mod").mkdir()
    (lower / "mod" / "a").write_text("a")

    _mount(mount, merged, lowerdir=lower, upperdir=upper, workdir=work)
    try:
        os.unlink(merged / "gone.txt")
        shutil.rmtree(merged / "gonedir")
        shutil.rmtree(merged / "opq")
        (merged / "opq").mkdir()
        (merged / "opq" / "new").write_text("new")
        (merged / "mod" / "b").write_text("b")
        (merged / "added").write_text("added")
        view = snapshot(merged, mtimes=False)
    finally:
        _umount(merged)
    # the upper dir really uses overlayfs' own encoding
    assert stat.S_ISCHR(os.lstat(upper / "gone.txt").st_mode)
    assert os.getxattr(upper / "opq", "trusted.overlay.opaque") == b"y"

    blob = tmp_path / "layer"
    with open(blob, "wb") as out:
        pack_tree(upper, out, overlay_upper=True)
    with LayerReader.open_file(blob) as r:
        toc = {e.path: e for e in r.entries()}
        assert {".wh.gone.txt", ".wh.gonedir", "opq/.wh..wh..opq", "opq/new", "added",
                "mod/b"} <= set(toc)
        assert all(e.type in ("file", "dir") for e in toc.values())  # no char devices left
        assert not any(k.startswith("trusted.overlay.") for e in toc.values() for k in e.xattrs)

        # back to overlayfs whiteouts: usable as a lower dir above the original lower
        converted = tmp_path / "converted"
        r.unpack(converted, whiteouts="overlay")
        st = os.lstat(converted / "gone.txt")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
        assert os.getxattr(converted / "opq", "trusted.overlay.opaque") == b"y"
        assert not (converted / "opq" / ".wh..wh..opq").exists()
        merged2 = tmp_path / "merged2"
        merged2.mkdir()
        _mount(mount, merged2, lowerdir=f"{converted}:{lower}")
        try:
            assert snapshot(merged2, mtimes=False) == view
            assert not (merged2 / "gone.txt").exists() and not (merged2 / "gonedir").exists()
            assert os.listdir(merged2 / "opq") == ["new"]
        finally:
            _umount(merged2)

        # applied onto a copy of the lower tree: the same view, without any overlay
        applied = tmp_path / "applied"
        shutil.copytree(lower, applied, symlinks=True)
        r.unpack(applied, whiteouts="apply")
        assert snapshot(applied, mtimes=False) == view
