"""The FUSE kernel protocol's wire format, and a layer's metadata answered from its tree.

Two processes speak it: the lazy daemon (``passthrough.PassthroughFS``: opens, reads, INIT)
and its metadata server (``metaserve``: lookups, attributes, listings, extended attributes,
``statfs``, answered without the daemon's interpreter lock). Both answer metadata with
``MetaTree``, so a mount presents the same tree whichever process reads a request. This module
imports the standard library only: the metadata server must start fast and stay small.

The structs follow ``include/uapi/linux/fuse.h`` at protocol 7.40 (passthrough).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any

FUSE_KERNEL_VERSION = 7
FUSE_KERNEL_MINOR = 40           # 7.40: passthrough; every struct below has this layout
FUSE_ROOT_ID = 1

(LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK) = (1, 2, 3, 4, 5, 6)
(MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE, STATFS, RELEASE) = (
    8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18)
(FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT, OPENDIR, READDIR,
 RELEASEDIR, FSYNCDIR) = (20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30)
(ACCESS, CREATE, INTERRUPT, DESTROY, BATCH_FORGET, FALLOCATE, READDIRPLUS, RENAME2,
 TMPFILE) = (34, 35, 36, 38, 42, 43, 44, 45, 51)
_NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
_WRITES = {SETATTR, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, WRITE, SETXATTR,
           REMOVEXATTR, CREATE, FALLOCATE, RENAME2, TMPFILE}
#: What ``MetaTree`` answers: everything a walk, a stat or an import's lookups ask. Opens,
#: reads, releases and INIT are the daemon's (they need the file cache and the connection).
META_OPCODES = frozenset({LOOKUP, GETATTR, READLINK, OPENDIR, READDIR, READDIRPLUS,
                          RELEASEDIR, FSYNCDIR, STATFS, GETXATTR, LISTXATTR})
#: Opcode slots of a request counter (``requests_by_opcode``); the protocol's are below 64.
OPCODE_SLOTS = 64

FUSE_ASYNC_READ = 1 << 0
FUSE_BIG_WRITES = 1 << 5
FUSE_DO_READDIRPLUS = 1 << 13
FUSE_PARALLEL_DIROPS = 1 << 18
FUSE_MAX_PAGES = 1 << 22
FUSE_CACHE_SYMLINKS = 1 << 23
FUSE_CACHE_READDIR = 1 << 25
FUSE_INIT_EXT = 1 << 30
FUSE_PASSTHROUGH = 1 << 37       # flags2 bit 5
_WANT = (FUSE_ASYNC_READ | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES | FUSE_CACHE_SYMLINKS
         | FUSE_CACHE_READDIR | FUSE_INIT_EXT)

FOPEN_KEEP_CACHE = 1 << 1
FOPEN_CACHE_DIR = 1 << 3
FOPEN_NOFLUSH = 1 << 5           # close() does not wait for a FLUSH round trip (read-only)
FOPEN_PASSTHROUGH = 1 << 7

_IN_HEADER = struct.Struct("<IIQQIIIHH")           # len opcode unique nodeid uid gid pid ext pad
_OUT_HEADER = struct.Struct("<IiQ")                 # len error unique
_INIT_IN = struct.Struct("<IIIII")                  # major minor max_readahead flags flags2
_INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")      # 64 bytes
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")          # fuse_attr, 88 bytes
_ENTRY_HEAD = struct.Struct("<QQQQII")              # nodeid generation entry/attr valid (+nsec)
_ATTR_OUT_HEAD = struct.Struct("<QII")              # attr_valid attr_valid_nsec dummy
_OPEN_IN = struct.Struct("<II")
_OPEN_OUT = struct.Struct("<QIi")                   # fh open_flags backing_id
_READ_IN = struct.Struct("<QQII")                   # fh offset size read_flags (...)
_RELEASE_IN = struct.Struct("<QII")
_GETXATTR_IN = struct.Struct("<II")
_KSTATFS = struct.Struct("<QQQQQIIII24x")           # 80 bytes
_DIRENT = struct.Struct("<QQII")
_BACKING_MAP = struct.Struct("<iIQ")                # fd flags padding

_ENTRY_OUT_SIZE = _ENTRY_HEAD.size + _ATTR.size     # fuse_entry_out, 128 bytes

assert _INIT_OUT.size == 64 and _ATTR.size == 88 and _KSTATFS.size == 80
assert _ENTRY_OUT_SIZE == 128

_BUFSIZE = (1 << 20) + 4096      # max_write is never used (read-only), reads are replies
_TTL = 86400.0

#: xattr of the mount root that returns the daemon's ``LazyStats`` as JSON (not listed).
LAZY_STATS_XATTR = "user.envbuild.lazy.stats"

#: ``on`` answers directory listings with lookup replies (READDIRPLUS, see
#: ``MetaTree._readdir``); unset or ``off``: READDIR. Off by default, as measured
#: (cold_start at 1gbit:10ms, 9 pairs taking turns): a third fewer LOOKUPs (2,093 -> 1,411)
#: but no faster cold (total 3.49 vs 3.51 s, 3.92 vs 4.01 s), and the re-run of the
#: fetched files slower in 8 of 9 pairs (medians 0.79 vs 0.68 s; the cause not found).
READDIRPLUS_ENV = "ENVBUILD_LAZY_READDIRPLUS"
#: A directory with more entries is listed without lookup replies (node id 0: the kernel makes
#: no dentry): a package directory has tens to hundreds; a hostile layer's 100,000 would pin
#: as many kernel inodes for one ``ls``.
READDIRPLUS_MAX_ENTRIES = 2048

#: Answer OPENDIR with ENOSYS (see ``MetaTree.answer``): 2 x 253 requests fewer in the
#: cold_start workload, 2 x 123 in its re-run; no measurable change in their times on one
#: sandbox (10 pairs taking turns: totals 3.44 vs 3.52 s and 3.57 vs 3.50 s, re-runs
#: 0.72 vs 0.72 and 0.71 vs 0.73 s), fewer daemon round trips for a node's burst.
#: ``$ENVBUILD_LAZY_NO_OPENDIR=0`` keeps the OPENDIR/RELEASEDIR round trips.
NO_OPENDIR = os.environ.get("ENVBUILD_LAZY_NO_OPENDIR", "1").strip().lower() not in ("0", "off")


def readdirplus_wanted() -> bool:
    return os.environ.get(READDIRPLUS_ENV, "").strip().lower() in ("1", "on", "yes")


def _encode_dev(rdev: int) -> int:
    major, minor = os.major(rdev), os.minor(rdev)   # the kernel's new_encode_dev
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


def reply_bytes(unique: int, payload: bytes = b"", error: int = 0) -> bytes:
    """One reply on ``/dev/fuse``: the out header, then ``payload`` (or an error, ``errno``)."""
    return _OUT_HEADER.pack(16 + len(payload), -error, unique) + payload


class MetaNode:
    """What ``MetaTree`` reads of a node (``tree.Node`` has these and more): the metadata
    server's nodes, decoded from ``table_rows``."""

    __slots__ = ("ino", "mode", "uid", "gid", "mtime", "size", "rdev", "nlink", "link",
                 "xattrs", "children")

    def __init__(self, ino: int, mode: int, uid: int, gid: int, mtime: int, size: int,
                 rdev: int, nlink: int, link: str, xattrs: Mapping[str, bytes],
                 children: dict[str, None] | None) -> None:
        self.ino, self.mode, self.uid, self.gid, self.mtime = ino, mode, uid, gid, mtime
        self.size, self.rdev, self.nlink, self.link = size, rdev, nlink, link
        self.xattrs, self.children = xattrs, children

    @property
    def is_dir(self) -> bool:
        return self.children is not None


#: Version of the node table the daemon hands its metadata server (``table_rows``).
TABLE_VERSION = 1


def table_rows(nodes: Mapping[str, Any]) -> tuple[int, list[tuple]]:
    """``nodes`` (path -> node) as plain rows for ``marshal``: what ``MetaTree`` reads and
    nothing else (no frames, digests or read paths). ``nodes_of_table`` is its inverse."""
    rows = []
    for path, n in nodes.items():
        rows.append((path, n.ino, n.mode, n.uid, n.gid, n.mtime, n.size, n.rdev, n.nlink,
                     n.link, dict(n.xattrs) if n.xattrs else None,
                     list(n.children) if n.children is not None else None))
    return TABLE_VERSION, rows


def nodes_of_table(table: Any) -> dict[str, MetaNode]:
    """The nodes of a ``table_rows`` table. The table comes from the daemon (our own code,
    over a socket pair): its version is checked, its shape is trusted."""
    version, rows = table
    if version != TABLE_VERSION:
        raise ValueError(f"node table version {version!r}, this server reads {TABLE_VERSION}")
    empty: Mapping[str, bytes] = {}
    out: dict[str, MetaNode] = {}
    for path, ino, mode, uid, gid, mtime, size, rdev, nlink, link, xattrs, children in rows:
        out[path] = MetaNode(ino, mode, uid, gid, mtime, size, rdev, nlink, link,
                             xattrs or empty,
                             dict.fromkeys(children) if children is not None else None)
    return out


class MetaTree:
    """A layer's metadata requests answered from its tree (``nodes``: path -> node, the root
    at ``""``, hardlinks sharing a node): LOOKUP, GETATTR, READLINK, OPENDIR, READDIR(PLUS),
    STATFS, GETXATTR, LISTXATTR. Answers are cached by the kernel for a day (entries,
    attributes, negative lookups), so each is asked about once per node.

    ``xattrs_enosys``: GETXATTR answers ENOSYS (a layer without one extended attribute: the
    kernel then never asks again). ``stats``: the root's ``LAZY_STATS_XATTR`` value, or None
    where this process cannot give it (``answers`` then says so, and the daemon answers)."""

    def __init__(self, nodes: Mapping[str, Any], statfs: Mapping[str, int], *,
                 xattrs_enosys: bool = False,
                 stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.nodes = nodes
        self.by_ino: dict[int, Any] = {}
        self.dir_path: dict[int, str] = {}
        for path, node in nodes.items():
            self.by_ino.setdefault(node.ino, node)
            if node.is_dir:
                self.dir_path[node.ino] = path
        self.statfs = statfs
        self.xattrs_enosys = xattrs_enosys
        self.stats = stats
        # (node id, READDIRPLUS?) -> the directory's encoded entries
        self._dirents: dict[tuple[int, bool], list[bytes]] = {}
        self._lock = threading.Lock()

    def answers(self, opcode: int, nodeid: int, body: memoryview) -> bool:
        """Whether ``answer`` answers this request here (the stats xattr needs ``stats``)."""
        if opcode not in META_OPCODES:
            return False
        if opcode == GETXATTR and nodeid == FUSE_ROOT_ID and self.stats is None \
                and not self.xattrs_enosys:
            return _xattr_name(body) != LAZY_STATS_XATTR
        return True

    def node(self, nodeid: int) -> Any:
        node = self.by_ino.get(nodeid)
        if node is None:
            raise OSError(errno.ENOENT, "no such inode")
        return node

    def attr(self, node: Any) -> bytes:
        return _ATTR.pack(node.ino, node.size, (node.size + 511) // 512, node.mtime,
                          node.mtime, node.mtime, 0, 0, 0, node.mode, node.nlink, node.uid,
                          node.gid, _encode_dev(node.rdev), 4096, 0)

    def entry(self, node: Any | None) -> bytes:
        ttl = int(_TTL)
        if node is None:   # a negative entry, cached as long as a positive one
            return _ENTRY_HEAD.pack(0, 0, ttl, ttl, 0, 0) + bytes(_ATTR.size)
        return _ENTRY_HEAD.pack(node.ino, 0, ttl, ttl, 0, 0) + self.attr(node)

    def answer(self, opcode: int, nodeid: int, body: memoryview) -> bytes:
        """The reply payload of a request ``answers`` accepted; OSError(errno) for an error
        reply."""
        if opcode == LOOKUP:
            parent = self.dir_path.get(nodeid)
            if parent is None:
                raise OSError(errno.ENOTDIR, "not a directory")
            name = bytes(body).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            return self.entry(self.nodes.get(f"{parent}/{name}" if parent else name))
        if opcode == GETATTR:
            return _ATTR_OUT_HEAD.pack(int(_TTL), 0, 0) + self.attr(self.node(nodeid))
        if opcode == READLINK:
            node = self.node(nodeid)
            if not stat.S_ISLNK(node.mode):
                raise OSError(errno.EINVAL, "not a symlink")
            return os.fsencode(node.link)
        if opcode == OPENDIR:
            if nodeid not in self.dir_path:
                raise OSError(errno.ENOTDIR, "not a directory")
            if NO_OPENDIR:
                # "not implemented": the kernel then opens this mount's directories without
                # asking (zero-message opendir, FUSE 7.29) and sends no RELEASEDIR, with
                # FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR — what this answer said anyway (the
                # listing needs no handle: READDIR goes by node id)
                raise OSError(errno.ENOSYS, "directories need no open")
            return _OPEN_OUT.pack(0, FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR, 0)
        if opcode == READDIR or opcode == READDIRPLUS:
            _fh, offset, size, _ = _READ_IN.unpack_from(body)
            return self._readdir(nodeid, offset, size, plus=opcode == READDIRPLUS)
        if opcode in (RELEASEDIR, FSYNCDIR):
            return b""
        if opcode == STATFS:
            s = self.statfs
            return _KSTATFS.pack(s["f_blocks"], 0, 0, s["f_files"], 0, 4096, 255, 4096, 0)
        if opcode in (GETXATTR, LISTXATTR):
            if opcode == GETXATTR and self.xattrs_enosys:   # (listxattr: rare, answered)
                raise OSError(errno.ENOSYS, "no extended attributes in this layer")
            return self._xattr(opcode, nodeid, body)
        raise OSError(errno.ENOSYS, "not implemented")

    def _readdir(self, nodeid: int, offset: int, size: int, *, plus: bool = False) -> bytes:
        """A directory's entries from ``offset`` on, as many as fit in ``size`` bytes. With
        ``plus`` (READDIRPLUS) each entry carries its lookup reply too, so the kernel makes
        the children's dentries as the directory is listed and a later lookup of a listed name
        is answered from its dcache instead of by a LOOKUP round trip (``.`` and ``..`` carry
        node id 0: the kernel links nothing for them)."""
        with self._lock:
            ents = self._dirents.get((nodeid, plus))
        if ents is None:
            path = self.dir_path.get(nodeid)
            if path is None:
                raise OSError(errno.ENOTDIR, "not a directory")
            node = self.nodes[path]
            parent = self.nodes[path.rpartition("/")[0]] if path else node
            items = [(b".", node, False), (b"..", parent, False)]
            prefix = path + "/" if path else ""
            assert node.children is not None
            # a directory beyond READDIRPLUS_MAX_ENTRIES is listed without lookup replies:
            # the kernel would keep an inode per entry of a listing nobody looks through
            linked = len(node.children) <= READDIRPLUS_MAX_ENTRIES
            for name in node.children:
                child = self.nodes.get(prefix + name)
                if child is not None:
                    items.append((os.fsencode(name), child, linked))
            ents = []
            for i, (bname, child, link) in enumerate(items):
                raw = _DIRENT.pack(child.ino, i + 1, len(bname), (child.mode >> 12) & 0xF) + bname
                raw += b"\0" * (-len(raw) % 8)
                if plus:
                    raw = (self.entry(child) if link else bytes(_ENTRY_OUT_SIZE)) + raw
                ents.append(raw)
            with self._lock:
                self._dirents[(nodeid, plus)] = ents
        out, used = [], 0
        for raw in ents[offset:]:
            if used + len(raw) > size:
                break
            out.append(raw)
            used += len(raw)
        return b"".join(out)

    def _xattr(self, opcode: int, nodeid: int, body: memoryview) -> bytes:
        size, _ = _GETXATTR_IN.unpack_from(body)
        node = self.node(nodeid)
        if opcode == LISTXATTR:
            value = b"".join(os.fsencode(k) + b"\0" for k in node.xattrs)
        else:
            name = _xattr_name(body)
            got = node.xattrs.get(name)
            if got is None and name == LAZY_STATS_XATTR and nodeid == FUSE_ROOT_ID \
                    and self.stats is not None:
                got = json.dumps(self.stats()).encode()
            if got is None:
                raise OSError(errno.ENODATA, "no such attribute")
            value = got
        if size == 0:
            return struct.pack("<II", len(value), 0)
        if len(value) > size:
            raise OSError(errno.ERANGE, "buffer too small")
        return value


def _xattr_name(body: memoryview) -> str:
    return bytes(body[_GETXATTR_IN.size:]).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
