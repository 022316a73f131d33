"""``fusewire``: the metadata server's copy of a tree answers every metadata request exactly as
the daemon's own ``MetaTree`` does (the table is what crosses the process boundary); what it
cannot answer (the root's stats attribute) it says so, and the daemon answers; and
``startup.venv_configs`` finds a stack's venvs near the root only."""

from __future__ import annotations

import errno
import marshal
import stat
import struct
from types import SimpleNamespace

import pytest

from runtime_shim.lazyfs import fusewire as fw
from runtime_shim.lazyfs.startup import VENV_DEPTH, venv_configs
from runtime_shim.lazyfs.tree import Node, statfs_of


def _nodes() -> dict[str, Node]:
    d = stat.S_IFDIR | 0o755
    shared = Node(5, stat.S_IFREG | 0o644, 0, 0, 7, size=11, nlink=2, read_path="a/one",
                  digest="sha256:" + "1" * 64)
    return {
        "": Node(1, d, 0, 0, 1, children=dict.fromkeys(["a", "link", "dev"])),
        "a": Node(2, d, 10, 20, 3, children=dict.fromkeys(["one", "two", "é"]),
                  xattrs={"trusted.overlay.opaque": b"y"}),
        "a/one": shared,
        "a/two": shared,   # a hardlink: one inode
        "a/é": Node(6, stat.S_IFREG | 0o600, 1, 1, 9, size=0, read_path="a/é",
                    xattrs={"user.k": b"v" * 10}),
        "link": Node(3, stat.S_IFLNK | 0o777, 0, 0, 1, link="a/one"),
        "dev": Node(4, stat.S_IFCHR, 0, 0, 1, rdev=0),   # a whiteout
    }


def _body(*parts: bytes) -> memoryview:
    return memoryview(b"".join(parts))


REQUESTS = [
    (fw.LOOKUP, 1, _body(b"a\0")), (fw.LOOKUP, 2, _body(b"one\0")),
    (fw.LOOKUP, 2, _body("é".encode() + b"\0")), (fw.LOOKUP, 2, _body(b"missing\0")),
    (fw.LOOKUP, 5, _body(b"x\0")),   # not a directory
    (fw.GETATTR, 5, _body(bytes(16))), (fw.GETATTR, 99, _body(bytes(16))),
    (fw.READLINK, 3, _body()), (fw.READLINK, 5, _body()),
    (fw.READDIR, 2, _body(fw._READ_IN.pack(0, 0, 4096, 0), bytes(16))),
    (fw.READDIR, 2, _body(fw._READ_IN.pack(0, 3, 4096, 0), bytes(16))),
    (fw.READDIRPLUS, 1, _body(fw._READ_IN.pack(0, 0, 300, 0), bytes(16))),
    (fw.GETXATTR, 2, _body(fw._GETXATTR_IN.pack(0, 0), b"trusted.overlay.opaque\0")),
    (fw.GETXATTR, 6, _body(fw._GETXATTR_IN.pack(4, 0), b"user.k\0")),   # ERANGE
    (fw.GETXATTR, 6, _body(fw._GETXATTR_IN.pack(64, 0), b"user.k\0")),
    (fw.GETXATTR, 5, _body(fw._GETXATTR_IN.pack(64, 0), b"user.none\0")),
    (fw.LISTXATTR, 6, _body(fw._GETXATTR_IN.pack(0, 0))),
    (fw.STATFS, 1, _body()),
]


def _reply(tree: fw.MetaTree, opcode: int, nodeid: int, body: memoryview) -> tuple[int, bytes]:
    try:
        return 0, tree.answer(opcode, nodeid, body)
    except OSError as e:
        return e.errno or 0, b""


def test_the_servers_tree_answers_as_the_daemons():
    nodes = _nodes()
    statfs = statfs_of(nodes)
    ours = fw.MetaTree(nodes, statfs)
    # what the daemon sends: marshalled rows, read back in the server
    theirs = fw.MetaTree(fw.nodes_of_table(marshal.loads(marshal.dumps(fw.table_rows(nodes)))),
                         dict(statfs))
    for opcode, nodeid, body in REQUESTS:
        assert ours.answers(opcode, nodeid, body) and theirs.answers(opcode, nodeid, body)
        assert _reply(theirs, opcode, nodeid, body) == _reply(ours, opcode, nodeid, body), \
            (opcode, nodeid, bytes(body))
    # and the answers are the right ones
    entry = ours.answer(fw.LOOKUP, 2, _body(b"two\0"))
    assert struct.unpack_from("<Q", entry)[0] == 5   # the hardlink's one inode
    assert _reply(ours, fw.LOOKUP, 2, _body(b"missing\0"))[1][:8] == bytes(8)   # negative
    assert _reply(ours, fw.LOOKUP, 5, _body(b"x\0"))[0] == errno.ENOTDIR
    assert _reply(ours, fw.GETXATTR, 6, _body(fw._GETXATTR_IN.pack(4, 0), b"user.k\0"))[0] \
        == errno.ERANGE
    assert ours.answer(fw.READLINK, 3, _body()) == b"a/one"


def test_the_root_stats_attribute_is_the_daemons():
    nodes = _nodes()
    name = _body(fw._GETXATTR_IN.pack(4096, 0), fw.LAZY_STATS_XATTR.encode() + b"\0")
    server = fw.MetaTree(nodes, statfs_of(nodes))
    assert not server.answers(fw.GETXATTR, fw.FUSE_ROOT_ID, name)   # forwarded
    assert server.answers(fw.GETXATTR, 2, name)   # another node's: just absent
    daemon = fw.MetaTree(nodes, statfs_of(nodes), stats=lambda: {"pid": 7})
    assert daemon.answers(fw.GETXATTR, fw.FUSE_ROOT_ID, name)
    assert daemon.answer(fw.GETXATTR, fw.FUSE_ROOT_ID, name) == b'{"pid": 7}'
    # a layer without xattrs answers ENOSYS wherever it is served (the kernel stops asking)
    bare = fw.MetaTree(nodes, statfs_of(nodes), xattrs_enosys=True)
    assert bare.answers(fw.GETXATTR, fw.FUSE_ROOT_ID, name)
    with pytest.raises(OSError) as e:
        bare.answer(fw.GETXATTR, fw.FUSE_ROOT_ID, name)
    assert e.value.errno == errno.ENOSYS
    for opcode in (fw.OPEN, fw.READ, fw.RELEASE, fw.INIT, fw.FLUSH, fw.WRITE):
        assert not server.answers(opcode, 5, _body(bytes(64)))


def test_a_table_of_another_version_is_refused():
    version, rows = fw.table_rows(_nodes())
    with pytest.raises(ValueError, match="version"):
        fw.nodes_of_table((version + 1, rows))


def test_venv_configs_are_found_near_the_root_only():
    deep = "/".join(["d"] * VENV_DEPTH) + "/pyvenv.cfg"
    layers = [SimpleNamespace(lazy_nodes={"opt/venv/pyvenv.cfg": 1, "pyvenv.cfg.bak": 1,
                                          "opt/toolkits/pytest/venv/pyvenv.cfg": 1}),
              SimpleNamespace(lazy_nodes={"opt/venv/pyvenv.cfg": 1, deep: 1,
                                          "srv/app/pyvenv.cfg": 1})]
    assert venv_configs(layers) == ["opt/venv/pyvenv.cfg", "srv/app/pyvenv.cfg",
                                    "opt/toolkits/pytest/venv/pyvenv.cfg"]
