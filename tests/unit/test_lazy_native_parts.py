"""The pure parts of native lazy layers: fanotify event parsing and answers, and the member
cap of a layer's metadata tree."""

from __future__ import annotations

import errno
import struct

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.lazyfs import fanotify, nativetree
from runtime_shim.lazyfs.tree import Node


def _event(fd: int, pid: int, mask: int, rng: tuple[int, int] | None) -> bytes:
    info = struct.pack("=BBHIQQ", fanotify.FAN_EVENT_INFO_TYPE_RANGE, 0, 24, 0, *rng) \
        if rng else b""
    return struct.pack("=IBBHQii", 24 + len(info), 3, 0, 24, mask, fd, pid) + info


def test_events_are_parsed_with_their_range():
    buf = _event(7, 100, fanotify.FAN_PRE_ACCESS, (4096, 32768)) + \
        _event(8, 101, fanotify.FAN_OPEN_PERM, None)
    a, b = fanotify.parse(buf)
    assert (a.fd, a.pid, a.mask, a.offset, a.count) == \
        (7, 100, fanotify.FAN_PRE_ACCESS, 4096, 32768)
    assert (b.fd, b.pid, b.mask, b.offset, b.count) == (8, 101, fanotify.FAN_OPEN_PERM, 0, 0)


def test_a_truncated_event_is_not_parsed():
    buf = _event(7, 100, fanotify.FAN_PRE_ACCESS, (0, 1))
    assert fanotify.parse(buf[:-1]) == []
    assert fanotify.parse(struct.pack("=IBBHQii", 4, 3, 0, 24, 0, 0, 0)) == []


def test_deny_carries_the_errno_in_the_top_byte():
    assert fanotify.deny_errno(errno.EIO) == fanotify.FAN_DENY | (errno.EIO << 24)


def test_a_layer_over_the_member_cap_is_refused_before_anything_is_made(tmp_path):
    node = Node(ino=2, mode=0o100644, uid=0, gid=0, mtime=0)
    nodes = {f"f{i}": node for i in range(nativetree.MAX_MEMBERS + 1)}
    with pytest.raises(RuntimeShimError, match="over the 262144"):
        nativetree.build(str(tmp_path), nodes)
    assert list(tmp_path.iterdir()) == []


def _file(path: str, offset: int, csize: int, size: int, digest: str = "") -> Node:
    return Node(ino=2, mode=0o100644, uid=0, gid=0, mtime=0, size=size, read_path=path,
                frames=(offset,), digest=digest or "sha256:" + format(offset, "064x"))


def test_the_fill_window_is_the_files_after_one_in_blob_order():
    from runtime_shim.lazyfs.fillwindow import LayerOrder

    nodes = [_file("c", 300, 100, 100), _file("a", 0, 100, 100), _file("b", 100, 100, 100),
             _file("bad", 200, 50, 50, digest="sha256:../../etc"),
             _file("big", 400, 100, 5000), _file("after", 500, 100, 100)]
    frames = [(100, 100), (100, 100), (100, 50), (100, 100), (100, 5000), (100, 100)]
    order = LayerOrder(nodes + [nodes[1]], frames)   # a hardlinked file: once
    assert [e.path for e in order.after("a", window=10_000, max_file=1000)] == ["b", "c"]
    assert [e.path for e in order.after("a", window=250, max_file=1000)] == ["b"]
    assert [e.path for e in order.after("big", window=10_000, max_file=1000)] == ["after"]
    assert [e.path for e in order.after("a", window=10_000, max_file=1000, max_files=1)] \
        == ["b"]
    assert order.after("bad") == [] and order.after("nope") == []
    assert order.after("b", window=10_000, max_file=1000)[0] == \
        ("c", format(300, "064x"), 100, 300, 400)
    # every digest an object's name: checked at once, the same order and windows
    good = LayerOrder([n for n in nodes if n.read_path != "bad"], frames)
    assert good.files == order.files and [f.path for f in good.files] == \
        ["a", "b", "c", "big", "after"]
    assert good.after("a", window=10_000, max_file=1000) == \
        order.after("a", window=10_000, max_file=1000)


def test_a_window_after_a_module_takes_its_package_modules_only():
    """A window after a pyc's open fills its package's modules (pycs, sources, extension
    modules) and its subpackages' ``__init__``, not stubs, data, subpackages' modules nor
    the next package: those were ~80 % of what windows filled and were not read (the
    imports a pyc runs are predicted: ``pydeps``)."""
    from runtime_shim.lazyfs.fillwindow import LayerOrder

    sub = ["p/sub/__init__.py", "p/sub/__pycache__/__init__.cpython-311.pyc"]
    names = ["p/__pycache__/a.cpython-311.pyc", "p/__pycache__/b.cpython-311.pyc", "p/a.py",
             "p/a.pyi", "p/b.py", "p/c.cpython-311-x86_64-linux-gnu.so", "p/data.json",
             *sub, "p/sub/__pycache__/x.cpython-311.pyc", "p/sub/d/__init__.py", "p/z.py",
             "q/y.py"]
    nodes = [_file(n, 100 * i, 100, 100) for i, n in enumerate(names)]
    order = LayerOrder(nodes, [(100, 100)] * len(names))
    want = ["p/__pycache__/b.cpython-311.pyc", "p/a.py", "p/b.py",
            "p/c.cpython-311-x86_64-linux-gnu.so", *sub, "p/z.py"]
    assert [f.path for f in order.after(names[0], window=10_000)] == want
    assert [f.path for f in order.after("p/b.py", window=10_000)] == want[3:]
    assert [f.path for f in order.after(names[0], window=10_000, max_files=2)] == want[:2]
    assert [f.path for f in order.after(sub[0], window=10_000)] == \
        [sub[1], "p/sub/__pycache__/x.cpython-311.pyc", "p/sub/d/__init__.py"]


def test_a_window_follows_a_python_module_or_a_script_only():
    from runtime_shim.lazyfs.fillwindow import window_after, window_before

    assert window_before("usr/lib/python3.11/json/__pycache__/decoder.cpython-311.pyc")
    assert window_before("opt/venv/lib/python3.11/site-packages/_pytest/nodes.py")
    assert not window_before("usr/lib/x86_64-linux-gnu/libz.so.1") \
        and not window_before("usr/share/zoneinfo/UTC") and not window_before("a.pyi")
    assert window_after(b"#!/opt/venv/bin/python\nimport sys\n")
    assert not window_after(b"\x7fELF\x02\x01") and not window_after(b"TZif2")


class _Counting:
    """A store whose ranged reads and stats are counted."""

    def __init__(self, store: object) -> None:
        self.store, self.reads, self.stats = store, 0, 0

    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        self.reads += 1
        return self.store.get_range(digest, offset, length)  # type: ignore[attr-defined]

    def stat(self, digest: str) -> object:
        self.stats += 1
        return self.store.stat(digest)  # type: ignore[attr-defined]


def test_the_filler_decodes_a_layer_toc_once_from_the_tail_its_create_fetched(
        tmp_path, monkeypatch):
    """A create reads a layer's footer and TOC in one ranged read (its size from the lock)
    and keeps that tail beside the layer's record; the filler's reader of the layer takes
    its TOC from there (no read of the store), and its tree (predictions' lookups) and its
    blob order (fill windows) come from one decode of the TOC, with no ``Entry`` per
    member."""
    import types

    from envbuild.layers import LayerReader, pack_tree
    from envbuild.store import LocalStore, put_file
    from runtime_shim.lazyfs import native, tree
    from runtime_shim.lazyfs.fillworker import Worker
    from runtime_shim.lazyfs.objects import ObjectStore

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    for i in range(5):
        (src / "pkg" / f"m{i}.py").write_bytes(b"x = %d\n" % i * 1000)
    with open(tmp_path / "layer", "wb") as f:
        pack_tree(src, f)
    store = LocalStore(tmp_path / "store")
    info = put_file(store, tmp_path / "layer")
    with LayerReader.open_file(tmp_path / "layer") as r:
        toc_digest = r.toc_digest
    ref = types.SimpleNamespace(digest=info.digest, size=info.size, toc_digest=toc_digest)
    counting = _Counting(store)
    reader, tail = native._open(counting, ref)
    assert (counting.reads, counting.stats) == (1, 0)
    nodes = tree.tree_of(reader)
    objects = ObjectStore(tmp_path / "node")
    objects.make_dirs = lambda: None  # type: ignore[method-assign]   # no root needed
    import os
    os.makedirs(os.path.join(objects.root, "layers"))
    objects.record_layer(info.digest, info.size, str(store.root), None,
                         native._sources(nodes), tail, toc_digest)
    decodes = []
    real_tree_of = tree.tree_of
    monkeypatch.setattr(tree, "tree_of", lambda r: decodes.append("tree") or real_tree_of(r))
    monkeypatch.setattr(LayerReader, "entries", lambda self: decodes.append("entries") or [])
    w = Worker(str(tmp_path / "node"), -1)
    w.load_layer(info.digest[7:])
    layer = w._layer(w.objects.layer_record(info.digest[7:]))
    assert layer.stats.requests == 0   # the TOC came from the tail
    assert w._view(info.digest[7:]) is not None
    assert [f.path for f in w._order(layer).after("pkg/m0.py")] == \
        [f"pkg/m{i}.py" for i in range(1, 5)]
    assert decodes == ["tree"]
    assert layer.read("pkg/m3.py") == b"x = 3\n" * 1000   # verified as ever


def test_an_object_filled_in_another_boot_is_a_placeholder_again(tmp_path, monkeypatch):
    """Fills are not synced: an object whose fill state is another boot's tag may have lost
    its bytes in a crash, so it is incomplete (marked and filled anew); this boot's tag and
    ``1`` (an empty file's object, durable) are complete."""
    import os

    from runtime_shim.lazyfs import objects
    from runtime_shim.lazyfs.objects import ObjectStore, boot_tag

    monkeypatch.setattr(objects, "FILLED_XATTR", "user.envbuild.filled")   # no root needed
    FILLED_XATTR = objects.FILLED_XATTR
    store = ObjectStore(tmp_path)
    os.makedirs(store.data)
    names = {"now": "a" * 64, "empty": "b" * 64, "old": "c" * 64, "none": "d" * 64}
    for name in names.values():
        open(store.path(name), "x").close()
    os.setxattr(store.path(names["now"]), FILLED_XATTR, boot_tag())
    os.setxattr(store.path(names["empty"]), FILLED_XATTR, b"1")
    os.setxattr(store.path(names["old"]), FILLED_XATTR, b"boot:another-boot")
    assert boot_tag().startswith(b"boot:") and len(boot_tag()) > 20
    assert store.complete(names["now"]) and store.complete(names["empty"])
    assert sorted(store.incomplete()) == sorted([names["old"], names["none"]])


def test_a_registered_stack_predicts_the_files_a_start_reads():
    """``Hints.on_start``: the objects of ``/etc/passwd`` and ``/etc/group`` (runc reads
    them as a sandbox starts) as the stack resolves them: the top layer's ``passwd``, the
    lower layer's ``group``; an unregistered layer predicts nothing."""
    from runtime_shim.lazyfs.fillhints import Hints, LayerView

    def tree(files: dict[str, str]) -> dict[str, Node]:
        nodes = {"": Node(ino=1, mode=0o040755, uid=0, gid=0, mtime=0, children={"etc": None}),
                 "etc": Node(ino=2, mode=0o040755, uid=0, gid=0, mtime=0,
                             children=dict.fromkeys(n.split("/")[1] for n in files))}
        for i, (path, digest) in enumerate(files.items()):
            nodes[path] = Node(ino=10 + i, mode=0o100644, uid=0, gid=0, mtime=0, size=1,
                               read_path=path, digest="sha256:" + digest)
        return nodes
    top, low = "1" * 64, "2" * 64
    trees = {top: tree({"etc/passwd": "a" * 64}),
             low: tree({"etc/passwd": "b" * 64, "etc/group": "c" * 64})}
    hints = Hints(lambda h: LayerView(h, trees[h], None))
    assert hints.on_start(top) == []   # no stack registered yet
    hints.add_stack([top, low])
    assert hints.on_start(top) == ["a" * 64, "c" * 64]
    assert hints.on_elf(top, b"not an ELF file") == []


def test_a_fill_writes_its_object_without_truncating_it(tmp_path, monkeypatch):
    """A fill opens its placeholder without ``O_TRUNC`` (on ext4 a truncate to 0 makes the
    close flush the file: ~100 us an object, and I/O an unsynced fill means to avoid); what
    an object held before (a killed fill's prefix of the same bytes, or more) ends up exactly
    the verified content."""
    import os

    from runtime_shim.lazyfs import objects

    flags: list[int] = []
    real_open = os.open

    def spy(path, flag, *args, **kw):   # type: ignore[no-untyped-def]
        flags.append(flag)
        return real_open(path, flag, *args, **kw)
    monkeypatch.setattr(os, "open", spy)
    data = os.urandom(3 * objects.WRITE_PIECE + 5)
    for before in (b"", data[:1000], data + b"stale tail"):
        target = tmp_path / f"obj{len(before)}"
        target.write_bytes(before)
        objects.write_into(str(target), data)
        assert target.read_bytes() == data
        spool = tmp_path / "spool"
        spool.write_bytes(data)
        target.write_bytes(before)
        objects.copy_into(str(spool), str(target), len(data))
        assert target.read_bytes() == data
    assert flags and not any(f & os.O_TRUNC for f in flags if f & os.O_WRONLY)


def test_a_batch_of_objects_is_claimed_written_and_released_through_one_dir(
        tmp_path, monkeypatch):
    """``ObjectDir``: a claim is one ``getxattr`` an object (a missing object and a complete
    one, of this boot or ``1``, are not claimed; a placeholder and another boot's fill are);
    a write sets the fill state on its own fd after the bytes; a bad name is refused. The
    worker claims a batch under one lock (a duplicate or an object already being filled is
    not claimed twice), completes a batch (every waiter let on) and releases it (only
    objects someone waits for get a fill of their own)."""
    import os

    from runtime_shim.lazyfs import fillworker
    from runtime_shim.lazyfs.fillbatch import ObjectDir
    from runtime_shim.lazyfs.fillwindow import FileRef
    from runtime_shim.lazyfs.objects import ObjectStore

    xattr = "user.envbuild.filled"   # no root needed
    store = ObjectStore(tmp_path)
    os.makedirs(store.data)
    names = {k: c * 64 for k, c in
             {"hole": "a", "now": "b", "empty": "c", "old": "d", "gone": "e", "busy": "f"}.items()}
    for k, name in names.items():
        if k != "gone":
            open(store.path(name), "x").close()
    os.setxattr(store.path(names["now"]), xattr, store.tag)
    os.setxattr(store.path(names["empty"]), xattr, b"1")
    os.setxattr(store.path(names["old"]), xattr, b"boot:another-boot")
    odir = ObjectDir(store.data, store.data, store.tag, -1, xattr)
    assert odir.unfilled(names.values()) == {names["hole"], names["old"], names["busy"]}
    with pytest.raises(ValueError, match="bad object name"):
        odir.unfilled(["../" + "a" * 61])
    odir.write(names["hole"], b"verified")
    assert open(store.path(names["hole"]), "rb").read() == b"verified"
    assert os.getxattr(store.path(names["hole"]), xattr) == store.tag
    assert odir.unfilled([names["hole"]]) == set()

    w = fillworker.Worker(str(tmp_path), -1)
    w._dir = odir
    unmarked: list[list[str]] = []
    answered: list[list[int]] = []
    submitted: list[str] = []
    monkeypatch.setattr(odir, "unmark", lambda hexes: unmarked.append(list(hexes)))
    monkeypatch.setattr(w, "_finish", lambda fds, ok: answered.append(list(fds)))
    monkeypatch.setattr(w._pool, "submit", lambda fn, hexd: submitted.append(hexd))
    w._waiting[names["busy"]] = [7]
    refs = [FileRef(f"p/{k}", h, 1) for k, h in names.items()]
    refs.append(FileRef("p/old-again", names["old"], 1))
    claimed = w._claim(refs)
    assert [r.path for r in claimed] == ["p/old"]
    w._waiting[names["old"]].append(9)   # an open waits for the claimed fill
    w._complete([names["old"], names["busy"]])
    assert unmarked == [[names["old"], names["busy"]]] and answered == [[9, 7]]
    assert w._waiting == {}
    w._waiting.update({names["hole"]: [], names["old"]: [11]})
    w._release([names["hole"], names["old"], names["now"]])
    assert submitted == [names["old"]] and w._waiting == {names["old"]: [11]}
    odir.close()
