"""A lazy layer's inode table (``runtime_shim.lazyfs.tree``, what a native layer's metadata
tree is built from): the column decode of a v2 TOC (``tree_of``) against the ``Entry`` path
(``build_tree``) and against the rules of what the layer presents (hardlinks as one inode,
whiteouts, opaque and replaced directories, synthesised parents, stable inode numbers), and
hostile TOCs refused."""

from __future__ import annotations

import stat

import pytest

from envbuild.errors import CorruptLayerError, UnsafeLayerError
from envbuild.layers import Chunk, Entry, Toc, TocFormatError
from runtime_shim.lazyfs.tree import NO_XATTRS, OPAQUE_XATTR, build_tree, tree_of

FRAME = 4096
FRAMES = [(100, FRAME)] * 8   # 8 frames of 4 KiB of tar each (compressed sizes made up)
D = "sha256:" + "ab" * 32


class _Reader:
    """What ``tree_of`` reads of a ``LayerReader``: ``toc``, ``name``, ``entries()``."""

    def __init__(self, data: bytes) -> None:
        self.toc = Toc.from_bytes(data, lazy=True)
        self.name = "sha256:test"

    def entries(self) -> list[Entry]:
        return self.toc.entries[:]


def _file(path: str, data: int, size: int, digest: str = D, **kw) -> Entry:
    # data_offset = uoffset + inner of the first chunk: the v2 row keeps only that
    return Entry(path, "file", size=size, digest=digest, chunks=[Chunk(0, 0, 0, 0, data)], **kw)


def _toc(entries: list[Entry], version: int = 2) -> bytes:
    return Toc("lazy", D, FRAME * len(FRAMES), list(FRAMES), entries, version).to_bytes()


def _view(nodes) -> dict:
    return {p: (n.ino, n.mode, n.uid, n.gid, n.mtime, n.size, n.rdev, n.nlink, n.link,
                n.read_path, n.frames, n.digest, dict(n.xattrs),
                None if n.children is None else list(n.children)) for p, n in nodes.items()}


def _both(entries: list[Entry]) -> dict:
    """The tree by the column path, checked equal to the Entry path's (same TOC bytes)."""
    fast = tree_of(_Reader(_toc(entries)))
    slow = build_tree(_Reader(_toc(entries)).entries())
    assert _view(fast) == _view(slow)
    # hardlinked names share one Node in both
    assert sorted(map(len, _groups(fast))) == sorted(map(len, _groups(slow)))
    return fast


def _groups(nodes) -> list[list[str]]:
    by: dict[int, list[str]] = {}
    for p, n in nodes.items():
        by.setdefault(id(n), []).append(p)
    return list(by.values())


LAYER = [
    Entry("etc", "dir", mode=0o755),
    _file("etc/passwd", 0, 100, mode=0o644, uid=1, gid=2, mtime=7),
    Entry("etc/alias", "hardlink", linkname="etc/passwd"),
    Entry("etc/again", "hardlink", linkname="etc/passwd"),
    Entry("etc/ln", "symlink", linkname="../passwd"),
    Entry("dev", "dir"),
    Entry("dev/null", "char", mode=0o666, devmajor=1, devminor=3),
    Entry("dev/fifo", "fifo"),
    Entry("usr/lib/python/mod.py", "file", size=0, digest=D),     # parents synthesised
    _file("usr/lib/big", 1000, 3 * FRAME, xattrs={"user.k": b"\x00\xff"}),  # 4 frames
    Entry("opt", "dir", xattrs={"user.a": b"1"}),
    Entry("opt/.wh..wh..opq", "file", size=0, digest=D),
    Entry("opt/.wh.gone", "file", size=0, digest=D, uid=5, gid=6, mtime=9),
    Entry("usr", "dir", mode=0o700, uid=3),                       # takes the synthesised's
]


def test_the_tree_follows_the_mount_rules():
    nodes = _both(LAYER)
    n = len(LAYER)
    # stable inode numbers: member i is i + 2, the root 1, synthesised dirs after n + 2
    assert nodes[""].ino == 1
    assert nodes["etc"].ino == 2 and nodes["etc/passwd"].ino == 3
    assert nodes["usr"].ino == n + 2 and nodes["usr/lib"].ino == n + 3
    assert nodes["usr/lib/python"].ino == n + 4
    # a synthesised parent takes a later member's metadata
    assert nodes["usr"].mode == stat.S_IFDIR | 0o700 and nodes["usr"].uid == 3
    # hardlinks: one inode, nlink counts every name
    assert nodes["etc/alias"] is nodes["etc/passwd"] is nodes["etc/again"]
    assert nodes["etc/passwd"].nlink == 3 and nodes["etc/passwd"].ino == 3
    assert nodes["etc/ln"].link == "../passwd" and nodes["etc/ln"].size == 9
    assert nodes["dev/null"].rdev == (1 << 8 | 3) and stat.S_ISCHR(nodes["dev/null"].mode)
    assert stat.S_ISFIFO(nodes["dev/fifo"].mode)
    # whiteouts: a 0/0 char device with the whiteout's owner; the opaque marker an xattr
    gone = nodes["opt/gone"]
    assert stat.S_ISCHR(gone.mode) and gone.rdev == 0 and (gone.uid, gone.gid) == (5, 6)
    assert nodes["opt"].xattrs == {"user.a": b"1", OPAQUE_XATTR: b"y"}
    assert "opt/.wh..wh..opq" not in nodes and "opt/.wh.gone" not in nodes
    assert list(nodes["opt"].children) == ["gone"]
    # a regular file carries its TOC digest (the file cache's key: no Entry decoded per open)
    D2 = "sha256:" + "cd" * 32
    other = _both([_file("a", 0, 10, digest=D2)])
    assert nodes["etc/passwd"].digest == D and other["a"].digest == D2
    assert nodes["etc"].digest == "" and nodes["etc/ln"].digest == ""
    # frames: blob offsets of the frames overlapping the file's bytes in the tar
    assert nodes["etc/passwd"].frames == (0,)
    assert nodes["usr/lib/big"].frames == (0, 100, 200, 300)
    assert nodes["usr/lib/big"].xattrs == {"user.k": b"\x00\xff"}
    assert nodes["usr/lib/python/mod.py"].frames == () and nodes["usr/lib/python/mod.py"].size == 0
    # directory link counts: 2 + subdirectories
    assert nodes[""].nlink == 2 + 4 and nodes["usr"].nlink == 3 and nodes["opt"].nlink == 2
    # nodes without xattrs share the read-only empty mapping, which nothing wrote into
    assert nodes["dev"].xattrs is NO_XATTRS and dict(NO_XATTRS) == {}
    # the same TOC gives the same tree (inode numbers are stable across processes)
    assert _view(tree_of(_Reader(_toc(LAYER)))) == _view(nodes)


def test_replacements_follow_tar_order():
    nodes = _both([
        Entry("a", "dir"),
        _file("a/x", 0, 10),
        Entry("a", "symlink", linkname="b"),       # a dir replaced: its subtree goes with it
        Entry("c", "dir"),
        Entry("c/d", "dir"),
        _file("c/d/e", 10, 10),
        _file("c", 20, 5),                           # replaced by a file
        _file("c/f", 30, 5),                         # then a parent again: synthesised dir
        _file("h", 40, 5),
        Entry("h2", "hardlink", linkname="h"),
        _file("h2", 50, 6),                          # a hardlink name replaced: one link less
        Entry("k", "dir", mode=0o700),
        Entry("k", "dir", mode=0o750, xattrs={"user.x": b"y"}),   # a repeated dir
    ])
    assert stat.S_ISLNK(nodes["a"].mode) and "a/x" not in nodes
    assert nodes["c"].is_dir and nodes["c"].ino == 13 + 2 and list(nodes["c"].children) == ["f"]
    assert "c/d" not in nodes and "c/d/e" not in nodes
    assert nodes["h"].nlink == 1 and nodes["h2"] is not nodes["h"] and nodes["h2"].size == 6
    assert nodes["k"].mode == stat.S_IFDIR | 0o750 and nodes["k"].xattrs == {"user.x": b"y"}
    assert nodes["k"].ino == 11 + 2
    # a replaced name moves to the end of its directory, as it is last in tar order
    assert list(nodes[""].children) == ["a", "c", "h", "h2", "k"]
    assert list(_both([Entry("a", "dir"), Entry("b", "dir"), _file("a", 0, 1)])[""].children) \
        == ["b", "a"]


def test_dangling_hardlinks_and_whiteout_oddities_are_skipped():
    nodes = _both([
        Entry("l1", "hardlink", linkname="missing"),
        Entry("d", "dir"),
        Entry("l2", "hardlink", linkname="d"),                     # not a regular file
        Entry("d/.wh..wh.other", "file", size=0, digest=D),         # other .wh..wh. names
        Entry("d/.wh.", "file", size=0, digest=D),                  # a whiteout of nothing
    ])
    assert sorted(nodes) == ["", "d"] and list(nodes["d"].children) == []


def test_a_v1_toc_takes_the_entry_path():
    entries = [Entry("a", "dir"), Entry("a/b", "file", size=3, digest=D,
                                        chunks=[Chunk(0, 100, 0, FRAME, 7)])]
    nodes = tree_of(_Reader(_toc(entries, version=1)))
    assert nodes["a/b"].frames == (0,) and nodes["a/b"].ino == 3


@pytest.mark.parametrize("bad", ["/etc/passwd", "a/../../etc", "..", ".", "a//b", "a/./b",
                                 "a/", "x/.."])
@pytest.mark.parametrize("version", [1, 2])
def test_unsafe_member_names_are_refused(bad, version):
    entries = [Entry("a", "dir"), Entry(bad, "file", size=0, digest=D)]
    with pytest.raises(UnsafeLayerError, match="not a safe relative name"):
        tree_of(_Reader(_toc(entries, version)))


def _rows(entries: list[Entry], row: int, value: str) -> bytes:
    """The v2 TOC of ``entries`` with row ``row`` replaced by ``value`` (hostile bytes)."""
    lines = _toc(entries).split(b"\n")
    end = b"," if row + 1 < len(entries) else b""
    lines[row + 1] = value.replace("DIG", f'"{D}"').encode() + end
    return b"\n".join(lines)


ROW = '["file",420,0,0,10,0,"",{},0,0,DIG,0]'


@pytest.mark.parametrize("row", [
    '["file",420,0,0,10,0,"",{},0,0,DIG,null]',       # content without a data offset
    '["dir",493,0,0,0,0,"",{},0,0,null,0]',                 # a dir with a data offset
    '["file",-1,0,0,10,0,"",{},0,0,DIG,0]',            # a negative mode
    '["file",true,0,0,10,0,"",{},0,0,DIG,0]',          # a bool is not an int
    '["file",420,0,0,10,0,5,{},0,0,DIG,0]',            # a linkname that is no string
    '["file",420,0,0,10,0,"",[],0,0,DIG,0]',           # xattrs that are no object
    '["file",420,0,0,10,0,"",{},0,0,7,0]',                  # a digest that is no string
    '["weird",420,0,0,10,0,"",{},0,0,null,null]',           # an unknown type
    '["file",420,0,0,10,0,"",{},0,0]',                      # too short
    '{"type":"file"}',                                      # not an array
])
def test_malformed_rows_are_refused_with_the_entry_named(row):
    entries = [Entry("a", "dir"), _file("a/b", 0, 10)]
    with pytest.raises(CorruptLayerError, match="TOC entry 1"):
        tree_of(_Reader(_rows(entries, 1, row)))


def test_a_row_past_the_tar_or_with_bad_xattrs_is_refused():
    entries = [Entry("a", "dir"), _file("a/b", 0, 10)]
    past = '["file",420,0,0,10,0,"",{},0,0,DIG,' + str(FRAME * len(FRAMES) - 5) + "]"
    with pytest.raises(CorruptLayerError, match="past the tar"):
        tree_of(_Reader(_rows(entries, 1, past)))
    xattr = '["file",420,0,0,10,0,"",{"user.a":"***"},0,0,DIG,0]'
    with pytest.raises(CorruptLayerError, match="xattrs"):
        tree_of(_Reader(_rows(entries, 1, xattr)))
    # the unmodified rows pass (the test above is about those rows only)
    assert tree_of(_Reader(_rows(entries, 1, ROW)))["a/b"].size == 10


def test_rows_that_are_not_json_or_too_many_values_are_refused(monkeypatch):
    entries = [Entry("a", "dir"), _file("a/b", 0, 10)]
    with pytest.raises(CorruptLayerError, match="not valid JSON"):
        tree_of(_Reader(_rows(entries, 1, '["file",')))
    # the JSON value budget applies to the column decode as to the row decode
    reader = _Reader(_toc(entries))
    monkeypatch.setattr(reader.toc.entries, "_budget", 5)
    with pytest.raises(TocFormatError, match="more than 5 JSON values"):
        reader.toc.entries.columns()
