"""Layers are ordinary tar+zstd blobs: GNU tar and zstd read them like we do."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess

import pytest

from envbuild.layers import LayerReader, verify_layer
from tests.conftest import require_root, require_tool
from tests.unit.test_layers_support import TINY, pack_bytes, snapshot

# VFS_CAP_REVISION_2 with the effective flag: cap_net_bind_service permitted
CAPABILITY = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)


def _sample_tree(root):
    os.makedirs(root / "usr/bin")
    os.makedirs(root / "var/empty")
    os.makedirs(root / "tmp")
    (root / "usr/bin/tool").write_bytes(b"#!/bin/sh\necho hi\n" * 300)
    os.chmod(root / "usr/bin/tool", 0o4755)
    os.setxattr(root / "usr/bin/tool", "security.capability", CAPABILITY)
    os.chmod(root / "tmp", 0o1777)
    (root / "big.bin").write_bytes(os.urandom(5 << 20) + b"\0" * (1 << 20))
    (root / "medium").write_bytes(os.urandom(40_000))
    (root / "empty").write_bytes(b"")
    long_dir = root / ("d" * 90) / ("é" * 40)
    os.makedirs(long_dir)
    (long_dir / ("n" * 120)).write_text("long name")
    (root / "ünïcode.txt").write_text("ü")
    os.setxattr(root / "ünïcode.txt", "user.comment", b"binary\0\xff value")
    os.symlink("usr/bin/tool", root / "link")
    os.symlink("/" + "x" * 150, root / "longlink")
    os.link(root / "medium", root / "medium.hard")
    os.chown(root / "medium", 1234, 5678)
    os.chown(root / "var/empty", 3_000_000, 3_000_001)
    os.mknod(root / "null", 0o666 | 0o020000, os.makedev(1, 3))
    os.mkfifo(root / "fifo")
    (root / "usr-local").write_text("sorts between usr and usr/ by bytes, after usr/* by name")
    (root / "usr.d").mkdir()


@pytest.mark.integration
@pytest.mark.parametrize("framing", ["lazy", "compact", TINY])
def test_gnu_tar_and_zstd_read_our_layers(tmp_path, framing):
    require_root()
    zstd, tar = require_tool("zstd"), require_tool("tar")
    src = tmp_path / "src"
    _sample_tree(src)
    data, info = pack_bytes(src, framing=framing)
    layer = tmp_path / "layer.tar.zst"
    layer.write_bytes(data)

    raw = subprocess.run([zstd, "-dc", str(layer)], capture_output=True, check=True)
    assert raw.stderr == b""  # skippable TOC/footer frames are silently ignored
    assert "sha256:" + hashlib.sha256(raw.stdout).hexdigest() == info.diff_id
    assert len(raw.stdout) == info.uncompressed_size
    listing = subprocess.run([tar, "-t"], input=raw.stdout, capture_output=True, check=True)
    assert listing.stderr == b""
    names = [n.rstrip("/") for n in listing.stdout.decode().splitlines()]
    with LayerReader.open_file(layer) as r:
        assert names == [e.path for e in r.entries()]
        verify_layer(r, expected_digest=info.digest)
        ours = tmp_path / "ours"
        r.unpack(ours)

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    subprocess.run([tar, "--zstd", "-xpf", str(layer), "--xattrs", "--xattrs-include=*",
                    "--numeric-owner", "-C", str(theirs)], check=True, capture_output=True)
    a, b = snapshot(ours), snapshot(theirs)
    assert a == b
    assert a["usr/bin/tool"][5]["security.capability"] == CAPABILITY
    assert a["usr/bin/tool"][1] == 0o4755 and a["tmp"][1] == 0o1777
    assert a["var/empty"][2:4] == (3_000_000, 3_000_001)
    assert a["null"][4] == (1, 3)
    assert a["medium"][-1] == ("medium", "medium.hard")


@pytest.mark.integration
def test_gnu_tar_archive_of_same_tree_lists_same_members(tmp_path):
    """Our member order is exactly GNU tar's --sort=name order."""
    require_root()
    tar = require_tool("tar")
    require_tool("zstd")
    src = tmp_path / "src"
    _sample_tree(src)
    data, _ = pack_bytes(src)
    layer = tmp_path / "layer"
    layer.write_bytes(data)
    gnu = subprocess.run([tar, "--sort=name", "--format=posix", "-C", str(src), "-cf", "-", "."],
                         capture_output=True, check=True).stdout
    gnu_names = subprocess.run([tar, "-t"], input=gnu, capture_output=True,
                               check=True).stdout.decode().splitlines()
    gnu_names = [n.removeprefix("./").rstrip("/") for n in gnu_names if n != "./"]
    with LayerReader.open_file(layer) as r:
        assert [e.path for e in r.entries()] == gnu_names
