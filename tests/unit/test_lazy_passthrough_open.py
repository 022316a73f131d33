"""``PassthroughFS`` answering ``OPEN`` without a kernel (a recording connection, fake layer):
which readahead a first open triggers on each path (file cache, frames in memory)."""

from __future__ import annotations

import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from runtime_shim.lazyfs.filecache import FetchLimits, FetchSettings, FileCache
from runtime_shim.lazyfs.passthrough import _OPEN_IN, PassthroughFS
from runtime_shim.lazyfs.tree import Node

DATA = {f"f{i}": f"contents {i}".encode() * 100 for i in range(4)}


class Layer:
    digest = "sha256:" + "ab" * 32

    def __init__(self) -> None:
        self.stats = SimpleNamespace(as_dict=lambda: {})

    def read(self, path):
        return DATA[path]

    def prefetch(self, paths, **kw):
        return len(paths)

    def compressed_size(self, path):
        return len(DATA[path])


class Conn:
    passthrough = False

    def __init__(self) -> None:
        self.replies: list[tuple[int, int]] = []

    def reply(self, unique, payload=b"", error=0):
        self.replies.append((unique, error))


def _fs(tmp_path, modes=None):
    nodes = {"": Node(1, stat.S_IFDIR | 0o755, 0, 0, 0, children=dict.fromkeys(DATA))}
    for i, (path, data) in enumerate(DATA.items()):
        mode = (modes or {}).get(path, 0o644)
        nodes[path] = Node(i + 2, stat.S_IFREG | mode, 0, 0, 0, size=len(data),
                           read_path=path, frames=(i * 4096,),
                           digest="sha256:" + hashlib.sha256(data).hexdigest())
    files = FileCache(str(tmp_path / "files"), FetchLimits(FetchSettings(2, 5.0)), 1 << 30)
    fs = PassthroughFS(Layer(), nodes, str(tmp_path / "mp"), files,  # type: ignore[arg-type]
                       workers=ThreadPoolExecutor(2))
    followed: list[str] = []
    delays: list[float] = []

    def schedule_after(node, delay=0.0):
        followed.append(node.read_path)
        delays.append(delay)
    fs.readahead.schedule_after = schedule_after  # type: ignore[method-assign]
    fs.delays = delays  # type: ignore[attr-defined]
    return fs, nodes, files, followed


def _open(fs, conn, node, unique=1):
    fs._open(conn, unique, node.ino, _OPEN_IN.pack(os.O_RDONLY, 0))


def test_a_file_written_from_fetched_frames_keeps_the_tar_readahead_following(tmp_path):
    fs, nodes, files, followed = _fs(tmp_path)
    conn = Conn()
    for f in (nodes["f0"].frames[0], nodes["f1"].frames[0]):
        fs.lazy_frames.loaded.add(f)
    # f0: its frames landed and the background writer put it in files/ already
    digest = nodes["f0"].digest
    files.path(digest, lambda: DATA["f0"], "f0", inline=True)
    _open(fs, conn, nodes["f0"])
    # f1: frames in memory, not yet in files/ (written on the reader's thread)
    _open(fs, conn, nodes["f1"], unique=2)
    assert conn.replies == [(1, 0), (2, 0)]
    assert followed == ["f0", "f1"]
    assert files.cached(nodes["f1"].digest)


def test_a_file_in_files_from_an_earlier_daemon_triggers_no_readahead(tmp_path):
    fs, nodes, files, followed = _fs(tmp_path)
    conn = Conn()
    digest = nodes["f2"].digest  # its frames were never loaded by this daemon
    files.path(digest, lambda: DATA["f2"], "f2", inline=True)
    _open(fs, conn, nodes["f2"])
    assert conn.replies == [(1, 0)] and followed == []


def test_a_streamed_program_names_its_loader_files_as_its_bytes_arrive(tmp_path):
    from tests.unit.test_lazy_elfdeps import elf

    fs, nodes, _, _ = _fs(tmp_path)
    told: list[bytes] = []
    fs.on_elf = lambda _fs, data: told.append(data)
    node = nodes["f0"]
    data = elf("/lib64/ld-linux-x86-64.so.2", ("libc.so.6",))
    cut = 64 + 3 * 56 + len("/lib64/ld-linux-x86-64.so.2") + 1   # header, phdrs, interp
    pieces = [data[:cut], data[cut:cut + 8], data[cut + 8:]]
    assert list(fs._elf_peek(node, iter(pieces))) == pieces   # passed through unchanged
    # the interpreter from the first piece, the needed libraries once the dynamic section
    # and its strings are in (the last piece), not again at the reply
    assert told == [data[:cut], data]
    assert node.ino in fs._elf_checked
    told.clear()
    other = nodes["f1"]
    assert list(fs._elf_peek(other, iter([b"#!/bin/sh\n", b"echo\n"]))) == [b"#!/bin/sh\n",
                                                                        b"echo\n"]
    assert told == [] and other.ino not in fs._elf_checked   # not a program: nothing told


def test_a_file_fetched_ahead_moves_the_readahead_later_and_a_predicted_one_never(tmp_path):
    """``follow_delay`` (the daemon's ``_follow_delay``): 0 follows at once, a delay follows
    that much later (a loader's or start-up file), None never (an import prediction's)."""
    fs, nodes, files, followed = _fs(tmp_path)
    said = {"f0": 0.0, "f1": 0.2, "f2": None}
    fs.follow_delay = lambda _fs, node: said[node.read_path]
    conn = Conn()
    for i, name in enumerate(said):
        fs.lazy_frames.loaded.add(nodes[name].frames[0])
        files.path(nodes[name].digest, lambda name=name: DATA[name], name, inline=True)
        _open(fs, conn, nodes[name], unique=i + 1)
    assert conn.replies == [(1, 0), (2, 0), (3, 0)]
    assert followed == ["f0", "f1"] and fs.delays == [0.0, 0.2]  # type: ignore[attr-defined]


def test_only_files_that_may_be_programs_or_libraries_are_read_for_an_elf_header():
    from runtime_shim.lazyfs.passthrough import ELF_HINT_MAX, may_be_elf

    def node(path, mode=0o644, size=4096):
        return Node(2, stat.S_IFREG | mode, 0, 0, 0, size=size, read_path=path)

    assert may_be_elf(node("usr/bin/python3.11", 0o755))
    assert may_be_elf(node("usr/lib/x86_64-linux-gnu/libc.so.6"))
    assert may_be_elf(node("sp/np/_core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so"))
    assert not may_be_elf(node("sp/np/__init__.py"))
    assert not may_be_elf(node("sp/np/__pycache__/__init__.cpython-311.pyc"))
    assert not may_be_elf(node("sp/so/readme.txt"))            # ".so" in a directory's name
    assert not may_be_elf(node("usr/bin/tiny", 0o755, size=10))  # smaller than an ELF header
    assert not may_be_elf(node("lib/big.so", size=ELF_HINT_MAX + 1))
    assert not may_be_elf(Node(3, stat.S_IFDIR | 0o755, 0, 0, 0, read_path="lib.so"))


def test_a_first_open_asks_for_the_elf_header_of_a_library_only(tmp_path):
    fs, nodes, files, _ = _fs(tmp_path, modes={"f1": 0o755})
    hinted: list[str] = []
    fs.on_elf = lambda _fs, data: None
    fs._elf_hint = lambda node, path: hinted.append(node.read_path)  # type: ignore[method-assign]
    conn = Conn()
    for i, name in enumerate(("f0", "f1")):
        fs.lazy_frames.loaded.add(nodes[name].frames[0])
        files.path(nodes[name].digest, lambda name=name: DATA[name], name, inline=True)
        _open(fs, conn, nodes[name], unique=i + 1)
    fs.workers.shutdown(wait=True)
    assert conn.replies == [(1, 0), (2, 0)]
    assert hinted == ["f1"]     # the executable; not the 0644 module


def test_a_pycs_source_path():
    from runtime_shim.lazyfs.passthrough import pyc_source

    assert pyc_source("sp/np/__pycache__/__init__.cpython-311.pyc") == "sp/np/__init__.py"
    assert pyc_source("sp/np/__pycache__/m.cpython-311.opt-1.pyc") == "sp/np/m.py"
    assert pyc_source("__pycache__/top.cpython-311.pyc") == "top.py"
    assert pyc_source("sp/np/m.pyc") is None                 # sourceless: no __pycache__
    assert pyc_source("sp/np/__pycache__/.cpython-311.pyc") is None
    assert pyc_source("sp/np/__pycache__/notes.txt") is None


def test_sources_are_fetched_ahead_once_the_layers_pycs_are_checked_hash_ones():
    from runtime_shim.lazyfs.passthrough import pyc_source_wanted

    assert not pyc_source_wanted(0, 0)        # nothing known yet: the first pyc teaches
    assert pyc_source_wanted(1, 1)
    assert pyc_source_wanted(9, 10)
    assert not pyc_source_wanted(8, 10)       # timestamp pycs: the importer only stats
    assert not pyc_source_wanted(0, 5)


def _pyc(flags: int) -> bytes:
    return b"\xa7\r\r\n" + flags.to_bytes(4, "little") + bytes(8) + b"\xe3" * 20


def test_a_pyc_open_fetches_its_source_ahead_when_the_layer_uses_checked_hashes(tmp_path):
    global DATA
    saved = DATA
    DATA = {"pkg/__pycache__/a.cpython-311.pyc": _pyc(3),
            "pkg/__pycache__/b.cpython-311.pyc": _pyc(3),
            "pkg/a.py": b"a = 1\n" * 50, "pkg/b.py": b"b = 1\n" * 50}
    try:
        fs, nodes, files, _ = _fs(tmp_path)
        submitted: list[list[str]] = []
        fs._load_ahead = lambda ns: submitted.append(names(ns))  # type: ignore[method-assign]
        conn = Conn()
        first = nodes["pkg/__pycache__/a.cpython-311.pyc"]
        fs.lazy_frames.loaded.add(first.frames[0])
        _open(fs, conn, first)          # nothing known of the layer's pycs yet
        fs.workers.shutdown(wait=True)
        assert submitted == [] and fs._pycs == [1, 1]   # learnt from its header
        fs.workers = ThreadPoolExecutor(2)
        _open(fs, conn, nodes["pkg/__pycache__/b.cpython-311.pyc"], unique=2)   # a miss
        fs.workers.shutdown(wait=True)
        assert submitted == [["pkg/b.py"]]
        # a window's or the readahead's load of a pyc brings its source along (not the
        # source of a source, nor one already on the node)
        pyc = nodes["pkg/__pycache__/a.cpython-311.pyc"]
        assert fs._pyc_companion(pyc) is nodes["pkg/a.py"]
        assert fs._pyc_companion(nodes["pkg/a.py"]) is None
        # a source in the node's file cache (left by an earlier daemon): its open reads it
        # there, nothing to fetch
        src = nodes["pkg/a.py"]
        (tmp_path / "files" / src.digest.removeprefix("sha256:")).write_bytes(b"a = 1\n" * 50)
        on_disk = FileCache(str(tmp_path / "files"), files.limits, 1 << 30)
        assert on_disk.present(src.digest) and not on_disk.present(nodes["pkg/b.py"].digest)
        fs.files = on_disk
        assert fs._pyc_companion(pyc) is None
        fs.files = files
        assert fs._pyc_companion(pyc) is src
        fs.lazy_frames.loaded.add(nodes["pkg/a.py"].frames[0])
        assert fs._pyc_companion(pyc) is None
        fs._pycs = [1, 5]     # mostly timestamp pycs: sources are only stat'ed
        assert fs._pyc_companion(nodes["pkg/__pycache__/b.cpython-311.pyc"]) is None
    finally:
        DATA = saved


def names(nodes):
    return [n.read_path for n in nodes]
