"""The one safe unpacker: foreign tars (rootfs tarballs, OCI layers, archives) and the checks
unpack shares with verify (tar header vs TOC), holes for zero runs."""

from __future__ import annotations

import gzip
import io
import lzma
import os
import stat
import tarfile

import pytest
import zstandard

from envbuild.errors import CorruptLayerError, UnsafeLayerError
from envbuild.layers import unpack_tar, verify_layer
from tests.unit.test_layers_corrupt import _rebuild_tail
from tests.unit.test_layers_support import TINY, pack_bytes, reader_of


def _tar(members, fmt=tarfile.PAX_FORMAT) -> bytes:
    """members: (name, kind, extra) with kind file/dir/symlink/hardlink/char/block/fifo."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, kind, extra in members:
            ti = tarfile.TarInfo(name)
            ti.mode = 0o644
            if kind == "file":
                ti.size = len(extra)
                tf.addfile(ti, io.BytesIO(extra))
                continue
            ti.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                       "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE,
                       "block": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            if kind in ("char", "block"):
                ti.devmajor, ti.devminor = extra
                ti.mode = 0o666
            elif kind == "dir":
                ti.mode = extra or 0o755
            else:
                ti.linkname = extra or ""
            tf.addfile(ti)
    return buf.getvalue()


def _unpack(data: bytes, dest, **kw):
    unpack_tar(io.BytesIO(data), dest, name="test.tar", **kw)


def test_plain_gzip_zstd_xz_and_gnu_long_names(tmp_path):
    long = "d/" + "n" * 150
    data = _tar([("./d/", "dir", None), (f"./{long}", "file", b"long"),
                 ("./d/s", "symlink", "../x"), ("./d/h", "hardlink", f"./{long}")],
                fmt=tarfile.GNU_FORMAT)
    for i, blob in enumerate((data, gzip.compress(data), zstandard.compress(data),
                              lzma.compress(data))):
        dest = tmp_path / str(i)
        _unpack(blob, dest)
        assert (dest / long).read_bytes() == b"long"
        assert os.readlink(dest / "d" / "s") == "../x"
        assert os.stat(dest / "d" / "h").st_ino == os.stat(dest / long).st_ino


@pytest.mark.parametrize("members, match", [
    ([("../x", "file", b"evil")], r"'\.\.' path component"),
    ([("a/../../x", "file", b"evil")], r"'\.\.' path component"),
    ([("l", "symlink", "/"), ("l/x", "file", b"evil")], "through the symlink 'l'"),
    ([("h", "hardlink", "../../etc/passwd")], r"'\.\.' path component"),
    ([("h", "hardlink", "/etc/passwd")], "not a regular file in the tree"),
    ([("mem", "char", (1, 1))], "char device node, refused"),
    ([("sda", "block", (8, 0))], "block device node, refused"),
    ([(".wh.passwd", "file", b"")], "is a whiteout"),
])
def test_hostile_foreign_members_are_refused(tmp_path, members, match):
    dest = tmp_path / "dest"
    with pytest.raises(UnsafeLayerError, match=match) as ei:
        _unpack(_tar(members), dest)
    assert "\n" not in str(ei.value) and str(ei.value).startswith("test.tar: ")
    assert not (tmp_path / "x").exists()
    assert not (dest / "mem").exists() and not (dest / "sda").exists()


def test_a_symlink_from_a_lower_layer_is_never_written_or_whited_out_through(tmp_path):
    """Issue 11, item 2, at unit level: the symlink is already on disk (a lower layer)."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "victim").write_text("keep")
    dest = tmp_path / "root"
    _unpack(_tar([("a", "symlink", str(host))]), dest, whiteouts="apply")
    for members in ([("a/OUT", "file", b"pwned")], [("a/.wh.victim", "file", b"")],
                    [("a/.wh..wh..opq", "file", b"")]):
        with pytest.raises(UnsafeLayerError, match="through the symlink 'a'"):
            _unpack(_tar(members), dest, whiteouts="apply")
    assert sorted(os.listdir(host)) == ["victim"]


def test_directory_metadata_is_never_applied_through_a_later_symlink(tmp_path):
    """A dir member, then a symlink replacing it: the deferred chmod must not follow it."""
    target = tmp_path / "target"
    target.mkdir()
    os.chmod(target, 0o700)
    _unpack(_tar([("d", "dir", 0o777), ("d", "symlink", str(target))]), tmp_path / "r")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700
    assert os.readlink(tmp_path / "r" / "d") == str(target)


def test_oci_whiteouts_hide_only_lower_entries_wherever_they_come(tmp_path):
    dest = tmp_path / "root"
    _unpack(_tar([("a/", "dir", None), ("a/x", "file", b"x"), ("d/", "dir", None),
                  ("d/old", "file", b"old"), ("d/sub/", "dir", None),
                  ("d/sub/lower", "file", b"l"), ("keep", "file", b"k"),
                  ("f", "file", b"f")]), dest, whiteouts="apply")
    os.link(dest / "keep", dest / "keep2")
    # the upper layer: its own entries before and after its whiteouts
    _unpack(_tar([("d/new", "file", b"new"), ("d/sub/mine", "file", b"m"),
                  ("d/.wh..wh..opq", "file", b""), ("a/.wh.x", "file", b""),
                  ("f", "file", b"f2"), (".wh.f", "file", b""),
                  ("h", "hardlink", "keep")]), dest, whiteouts="apply")
    assert sorted(os.listdir(dest / "d")) == ["new", "sub"]
    assert os.listdir(dest / "d" / "sub") == ["mine"]
    assert os.listdir(dest / "a") == []
    assert (dest / "f").read_bytes() == b"f2"
    assert (dest / "h").read_bytes() == b"k"  # a hardlink to a lower layer's file
    assert not any(n.startswith(".wh.") for n in os.listdir(dest))


def test_overlay_xattrs_in_a_foreign_tar_are_refused(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("d")
        ti.type = tarfile.DIRTYPE
        ti.pax_headers = {"SCHILY.xattr.trusted.overlay.opaque": "y"}
        tf.addfile(ti)
    with pytest.raises(UnsafeLayerError, match="trusted.overlay.opaque"):
        _unpack(buf.getvalue(), tmp_path / "r")


def test_a_toc_path_that_differs_from_the_tar_header_is_refused_by_unpack(tmp_path):
    """Issue 11, item 13: verify refused it, unpack wrote the file under the TOC's name."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "small").write_text("small file\n")
    (src / "other").write_text("x" * 3000)
    data, _ = pack_bytes(src, framing=TINY)
    r = reader_of(data)
    e = next(e for e in r.toc.entries if e.path == "small")
    e.path = "renamed"
    lying = _rebuild_tail(data, r.toc.to_bytes())
    with pytest.raises(CorruptLayerError):
        verify_layer(reader_of(lying, name="l"))
    with pytest.raises(CorruptLayerError, match="does not match its TOC entry") as ei:
        reader_of(lying, name="l").unpack(tmp_path / "out")
    assert "\n" not in str(ei.value)
    assert not (tmp_path / "out" / "renamed").exists()


def test_zero_runs_are_restored_as_holes(tmp_path):
    """Sparse restore (issue 11, item 9): 256 MiB of zeros with a little data in between
    costs a few blocks, not 256 MiB, in both unpackers; the bytes read back are the same."""
    src = tmp_path / "src"
    src.mkdir()
    size = 256 << 20
    with open(src / "sparse", "wb") as f:
        f.truncate(size)
        f.seek(100 << 20)
        f.write(b"data in the middle")
    data, _ = pack_bytes(src)
    out = tmp_path / "out"
    reader_of(data).unpack(out)
    st = os.stat(out / "sparse")
    assert st.st_size == size
    assert st.st_blocks * 512 < 1 << 20, st.st_blocks
    with open(out / "sparse", "rb") as f:
        f.seek(100 << 20)
        assert f.read(18) == b"data in the middle"
    # the same through the foreign-tar path (a rootfs tarball with a big zero file)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|") as tf:
        tf.add(src / "sparse", arcname="sparse")
    _unpack(buf.getvalue(), tmp_path / "tar")
    st = os.stat(tmp_path / "tar" / "sparse")
    assert st.st_size == size and st.st_blocks * 512 < 1 << 20


def test_a_tree_deeper_than_recursion_and_path_max_unpacks_with_bounded_fds(tmp_path):
    """Depth costs neither recursion nor an fd per level (a sandbox may snapshot such a tree):
    both unpackers run with 300 fds to spare (the fd cache holds at most 256). 100 levels more
    than the recursion limit, 5 bytes each: the path is longer than PATH_MAX. (Not deeper: each
    directory is opened from the root, so time grows with the square of the depth; 4096 levels
    took 10-19 s, most of the fast tier's budget.)"""
    import resource
    import sys

    from envbuild.layers import pack_tar
    from envbuild.safefs import remove_tree

    depth = sys.getrecursionlimit() + 100
    assert depth * len("aaaa/") > os.pathconf("/", "PC_PATH_MAX")
    members = [("/".join(["aaaa"] * n), "dir", None) for n in range(1, depth + 1)]
    members.append(("/".join(["aaaa"] * depth) + "/f", "file", b"deep"))
    tar = _tar(members)
    out = io.BytesIO()
    pack_tar(io.BytesIO(tar), out, framing=TINY)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 300, hard))
    try:
        _unpack(tar, tmp_path / "tar")
        reader_of(out.getvalue()).unpack(tmp_path / "layer")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for d in ("tar", "layer"):
            fd = os.open(tmp_path / d, os.O_RDONLY)
            try:
                for _ in range(depth):
                    nfd = os.open("aaaa", os.O_RDONLY, dir_fd=fd)
                    os.close(fd)
                    fd = nfd
                assert os.read(os.open("f", os.O_RDONLY, dir_fd=fd), 10) == b"deep"
            finally:
                os.close(fd)
                remove_tree(tmp_path / d)
