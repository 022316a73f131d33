"""The layer walker on hostile trees: any depth and path length without recursion or
PATH_MAX failures, and overlay markers taken only from the overlay itself."""

from __future__ import annotations

import io
import os

import pytest

from envbuild.errors import UnsafeLayerError
from envbuild.layers import LayerReader, pack_tree, walk_tree
from envbuild.safefs import iter_tree, remove_tree
from tests.conftest import require_root


@pytest.fixture(autouse=True)
def _remove_deep_trees(tmp_path):
    """pytest's own tmp cleanup (shutil.rmtree) recurses: remove what these tests made."""
    yield
    for child in os.listdir(tmp_path):
        remove_tree(tmp_path / child)


def _deep(root, depth: int, name: str = "d") -> None:
    """``root/d/d/…`` ``depth`` levels deep, made relative to directory fds (the full path is
    far longer than PATH_MAX), with a file ``f`` at the bottom."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    wfd = os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(wfd, b"bottom\n")
    os.close(wfd)
    os.close(fd)


def _pack(root, **kw):
    out = io.BytesIO()
    info = pack_tree(root, out, **kw)
    data = out.getvalue()
    return info, LayerReader(lambda off, n: data[off:off + n], len(data))


def test_a_tree_deeper_than_the_recursion_limit_and_path_max_walks(tmp_path):
    _deep(tmp_path, 5000)  # 10,000-byte paths, 5x the recursion limit
    entries = list(e for e, _ in walk_tree(tmp_path, max_path_bytes=1 << 20))
    assert len(entries) == 5001
    assert entries[-1].path == "d/" * 5000 + "f" and entries[-1].size == 7
    assert sum(1 for _ in iter_tree(tmp_path)) == 5001


def test_a_path_longer_than_path_max_refuses_the_layer_naming_it(tmp_path):
    _deep(tmp_path, 4096)
    with pytest.raises(UnsafeLayerError, match=r"path d/d/d.* \(2049 levels\) is 4097 bytes"):
        _pack(tmp_path)


def test_long_paths_up_to_the_limit_pack_and_read_back(tmp_path):
    _deep(tmp_path, 2000)  # 4001 bytes: within PATH_MAX, beyond any recursion limit
    info, reader = _pack(tmp_path)
    assert info.entries == 2001
    assert reader.read("d/" * 2000 + "f") == b"bottom\n"


def test_remove_tree_removes_a_tree_deeper_than_path_max(tmp_path):
    (tmp_path / "x").mkdir()
    _deep(tmp_path / "x", 6000)
    remove_tree(tmp_path / "x")
    assert not (tmp_path / "x").exists()


def _upper(tmp_path):
    """An overlay upper dir with real markers and look-alikes a sandbox could make."""
    require_root()
    up = tmp_path / "upper"
    (up / "etc").mkdir(parents=True)
    (up / "etc" / ".wh.passwd").write_text("agent's file")          # look-alike whiteout
    (up / "etc" / "keep").write_text("k")
    (up / "opq").mkdir()
    (up / "opq" / ".wh..wh..opq").write_text("")                     # look-alike opaque marker
    (up / ".wh.dir").mkdir()
    (up / ".wh.dir" / "inside").write_text("x")
    os.symlink("/etc/shadow", up / ".wh.link")
    (up / "fake").mkdir()
    os.setxattr(up / "fake", "user.overlay.opaque", b"y")             # the agent's xattr
    os.mknod(up / "etc" / "gone", 0o600 | 0o020000, os.makedev(0, 0))  # real whiteout
    (up / "real").mkdir()
    os.setxattr(up / "real", "trusted.overlay.opaque", b"y")          # real opaque dir
    return up


@pytest.mark.integration  # a real overlay upper: mknod, trusted.* xattrs (root)
def test_only_the_overlays_own_markers_become_oci_whiteouts(tmp_path):
    up = _upper(tmp_path)
    dropped = []
    info, reader = _pack(up, overlay_upper=True,
                         on_dropped=lambda p, a, r: dropped.append((p, a)))
    paths = {e.path for e in reader.entries()}
    assert "etc/.wh.gone" in paths and "real/.wh..wh..opq" in paths       # the real ones
    assert "etc/keep" in paths and "fake" in paths and "opq" in paths
    for look_alike in ("etc/.wh.passwd", "opq/.wh..wh..opq", ".wh.dir", ".wh.dir/inside",
                       ".wh.link", "fake/.wh..wh..opq"):
        assert look_alike not in paths
    fake = next(e for e in reader.entries() if e.path == "fake")
    assert "user.overlay.opaque" not in (fake.xattrs or {})
    assert sorted(dropped) == [(".wh.dir", "dropped"), (".wh.link", "dropped"),
                               ("etc/.wh.passwd", "dropped"), ("fake", "dropped-xattr"),
                               ("opq/.wh..wh..opq", "dropped")]


@pytest.mark.integration  # a real overlay upper: mknod, trusted.* xattrs (root)
def test_look_alike_markers_are_refused_without_a_report(tmp_path):
    up = _upper(tmp_path)
    with pytest.raises(UnsafeLayerError, match="reserved for OCI whiteouts"):
        _pack(up, overlay_upper=True)


@pytest.mark.integration  # a real overlay upper: mknod, trusted.* xattrs (root)
def test_a_userxattr_overlay_reads_user_markers_and_drops_trusted_ones(tmp_path):
    up = _upper(tmp_path)
    dropped = []
    _, reader = _pack(up, overlay_upper=True, overlay_xattr="user",
                      on_dropped=lambda p, a, r: dropped.append((p, a)))
    paths = {e.path for e in reader.entries()}
    assert "fake/.wh..wh..opq" in paths and "real/.wh..wh..opq" not in paths
    assert ("real", "dropped-xattr") in dropped


def test_a_plain_pack_keeps_names_as_they_are(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / ".wh.b").write_text("")  # an OCI-style tree packed on purpose
    _, reader = _pack(tmp_path)
    assert {e.path for e in reader.entries()} == {"a", "a/.wh.b"}


def test_a_directory_moved_during_the_walk_stops_it_instead_of_walking_elsewhere(tmp_path):
    from envbuild.errors import LayerError

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_text("x")
    (tmp_path / "a" / "z").write_text("after b")
    (tmp_path / "c").mkdir()
    walk = walk_tree(tmp_path)
    seen = []
    with pytest.raises(LayerError, match="walk back up: directory moved"):
        for e, _ in walk:
            seen.append(e.path)
            if e.path == "a/b/f":  # the cursor stands in a/b: move it under c/
                os.rename(tmp_path / "a" / "b", tmp_path / "c" / "b")
    assert seen == ["a", "a/b", "a/b/f"]  # nothing of c/ was taken for a/


def test_remove_tree_relative_to_a_directory_fd(tmp_path):
    (tmp_path / "x" / "y").mkdir(parents=True)
    os.symlink("/etc", tmp_path / "x" / "y" / "etc")  # removed as a link, never followed
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        remove_tree("x", dir_fd=fd)
    finally:
        os.close(fd)
    assert os.listdir(tmp_path) == [] and os.path.isdir("/etc")
