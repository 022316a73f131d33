"""pack -> unpack round trips on generated trees, determinism, single-file reads."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envbuild.layers import LayerReader, verify_layer
from tests.unit.test_layers_support import (
    TINY,
    TINY_COMPACT,
    RecordingSource,
    pack_bytes,
    reader_of,
    snapshot,
)

ROOT = os.geteuid() == 0

_name_chars = st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\0",
                            max_codepoint=0x2FFF)
names = st.one_of(
    st.text(_name_chars, min_size=1, max_size=12),
    st.integers(100, 180).map(lambda n: "L" * n),         # > 100 bytes: PAX path records
    st.text("aé日", min_size=30, max_size=60),             # non-ASCII and long in UTF-8
).filter(lambda s: s not in (".", "..") and len(s.encode()) <= 240)
contents = st.one_of(
    st.binary(max_size=64),
    st.integers(0, 3).map(lambda k: os.urandom(1000 * k)),
    st.integers(1, 5).map(lambda k: (b"abc" * 20000)[: 9000 * k] + os.urandom(9)),
)
file_modes = st.sampled_from([0o644, 0o600, 0o755, 0o444, 0o4755, 0o2755, 0o1755])
dir_modes = st.sampled_from([0o755, 0o700, 0o1777, 0o2775, 0o555])
owners = st.sampled_from([(0, 0), (1000, 1000), (65534, 100), (3_000_000, 3_000_001)])
xattr_sets = st.dictionaries(st.sampled_from(["user.a", "user.mime_type", "user.é"]),
                             st.binary(min_size=1, max_size=40), max_size=2)


@st.composite
def trees(draw, depth=0):
    """A dict name -> node; node = ('file', bytes, mode, owner, xattrs) | ('dir', dict, mode,
    owner) | ('symlink', target) | ('hardlink', index of an earlier file)."""
    n = draw(st.integers(0, 5 if depth < 3 else 1))
    tree = {}
    for _ in range(n):
        name = draw(names)
        kind = draw(st.sampled_from(["file", "file", "dir", "symlink", "hardlink"]))
        if kind == "file":
            tree[name] = ("file", draw(contents), draw(file_modes), draw(owners),
                          draw(xattr_sets))
        elif kind == "dir":
            tree[name] = ("dir", draw(trees(depth + 1)) if depth < 4 else {}, draw(dir_modes),
                          draw(owners))
        elif kind == "symlink":
            tree[name] = ("symlink", draw(st.sampled_from(
                ["x", "../../etc/passwd", "/abs/target", "L" * 150, "é/ü"])))
        else:
            tree[name] = ("hardlink", draw(st.integers(0, 10)))
    return tree


def materialize(tree: dict, root: str) -> None:
    files: list[str] = []
    dirs: list[tuple[str, int]] = []

    def build(t, d):
        for name, node in t.items():
            p = os.path.join(d, name)
            if node[0] == "file":
                with open(p, "wb") as f:
                    f.write(node[1])
                for k, v in node[4].items():
                    os.setxattr(p, k, v)
                if ROOT:
                    os.chown(p, *node[3])
                os.chmod(p, node[2])
                files.append(p)
            elif node[0] == "dir":
                os.mkdir(p)
                build(node[1], p)
                if ROOT:
                    os.chown(p, *node[3])
                dirs.append((p, node[2]))
            elif node[0] == "symlink":
                os.symlink(node[1], p)
            elif files:
                os.link(files[node[1] % len(files)], p)

    build(tree, root)
    for p, mode in dirs:
        os.chmod(p, mode)


def _fresh(prefix):
    return tempfile.mkdtemp(prefix=prefix)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(tree=trees(), framing=st.sampled_from([TINY, TINY_COMPACT, "lazy", "compact"]))
def test_generated_trees_round_trip(tree, framing):
    src, dst = _fresh("eb-src-"), _fresh("eb-dst-")
    try:
        materialize(tree, src)
        data, info = pack_bytes(src, framing=framing)
        r = reader_of(data)
        verify_layer(r, expected_digest=info.digest)
        r.unpack(dst)
        want, got = snapshot(src, mtimes=False), snapshot(dst, mtimes=False)
        if not ROOT:  # without root, owners cannot be restored
            want = {k: v[:2] + v[4:] for k, v in want.items()}
            got = {k: v[:2] + v[4:] for k, v in got.items()}
        assert got == want
        assert {v[6] for v in snapshot(dst).values() if v[6] is not None} <= {0}
        for e in r.entries():
            if e.type == "file":
                with open(os.path.join(src, e.path), "rb") as f:
                    assert r.read(e.path) == f.read()
    finally:
        for d in (src, dst):
            for dirpath, dirnames, _ in os.walk(d):
                for n in dirnames:
                    os.chmod(os.path.join(dirpath, n), 0o755)
            shutil.rmtree(d)


def _make_sample(root):
    os.makedirs(os.path.join(root, "usr/lib/python"))
    os.makedirs(os.path.join(root, "empty"))
    with open(os.path.join(root, "usr/lib/python/mod.py"), "w") as f:
        f.write("print('hi')\n" * 500)
    with open(os.path.join(root, "usr/big.bin"), "wb") as f:
        f.write(hashlib.sha256(b"seed").digest() * 2000)
    os.symlink("lib/python", os.path.join(root, "usr/link"))
    os.link(os.path.join(root, "usr/big.bin"), os.path.join(root, "usr/big.hard"))
    open(os.path.join(root, "empty-file"), "w").close()


def test_same_tree_same_digest_across_directories_and_times(tmp_path):
    a, b = tmp_path / "one", tmp_path / "deeper" / "two"
    _make_sample(a)
    time.sleep(0.01)
    _make_sample(b)
    for i, (dirpath, dirnames, filenames) in enumerate(os.walk(b)):
        for n in dirnames + filenames:
            os.utime(os.path.join(dirpath, n), (1e9 + i, 1.5e9 + i), follow_symlinks=False)
    for framing in ("lazy", "compact"):
        da, ia = pack_bytes(a, framing=framing)
        db, ib = pack_bytes(b, framing=framing)
        assert da == db and ia == ib
    # a different SOURCE_DATE_EPOCH below the mtimes changes nothing across the two trees...
    assert pack_bytes(a, source_date_epoch=10)[0] == pack_bytes(b, source_date_epoch=10)[0]
    # ...and the digest does change when the contents do
    with open(b / "usr/lib/python/mod.py", "a") as f:
        f.write("#")
    assert pack_bytes(b)[1].digest != ia.digest


def test_mtimes_are_clamped_not_erased(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "old").write_text("x")
    (src / "new").write_text("y")
    os.utime(src / "old", (100, 100))
    os.utime(src / "new", (2e9, 2e9))
    data, _ = pack_bytes(src, source_date_epoch=1_000_000)
    r = reader_of(data)
    assert r.stat("old").mtime == 100 and r.stat("new").mtime == 1_000_000


def test_read_one_file_fetches_only_its_frames(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i:02}").write_bytes(os.urandom(3000 + 500 * i))
    (src / "big").write_bytes(os.urandom(9 << 20))  # crosses 4 MiB frame boundaries
    data, _ = pack_bytes(src)
    r = reader_of(data)
    rec: RecordingSource = r._get_range
    for path in ("big", "f33", "f02"):
        e = r.stat(path)
        rec.calls.clear()
        before = r.stats.frames_decompressed
        assert r.read(path) == (src / path).read_bytes()
        fetched = sorted(rec.calls)
        want = [(c.offset, c.csize) for c in e.chunks]
        # adjacent frames are merged into one ranged read, nothing else is fetched
        assert sum(n for _, n in fetched) == sum(n for _, n in want)
        assert fetched[0][0] == want[0][0]
        assert r.stats.frames_decompressed - before == len(e.chunks)
    assert len(r.stat("big").chunks) == 3
    # a small file lives in one shared frame, a 16 KiB+ file in frames of its own
    assert len(r.stat("f02").chunks) == 1
    big_file = r.stat("f33")
    assert big_file.size >= 16384 and big_file.chunks[0].inner == 0
    assert big_file.chunks[0].usize == big_file.size


def test_open_with_tail_reader_and_from_store(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("hello")
    data, info = pack_bytes(src)
    r = LayerReader(RecordingSource(data), get_tail=lambda n: data[-n:], name="x")
    assert r.read("a") == b"hello" and r.size == len(data) and r.toc_digest == info.toc_digest

    class Store:
        def stat(self, digest):
            return type("I", (), {"size": len(data)})()

        def get_range(self, digest, off, n):
            return data[off:off + n]

    assert LayerReader.from_store(Store(), info.digest).read("a") == b"hello"
    blob = tmp_path / "layer"
    blob.write_bytes(data)
    with LayerReader.open_file(blob) as r2:
        assert [e.path for e in r2.entries()] == ["a"]


def test_unpack_apply_whiteouts_onto_existing_tree(tmp_path):
    lower = tmp_path / "lower"
    (lower / "keep").mkdir(parents=True)
    (lower / "keep" / "a").write_text("a")
    (lower / "gone").write_text("x")
    (lower / "gonedir" / "sub").mkdir(parents=True)
    (lower / "opq").mkdir()
    (lower / "opq" / "old").write_text("old")
    src = tmp_path / "src"
    (src / "opq").mkdir(parents=True)
    (src / "opq" / ".wh..wh..opq").write_text("")
    (src / "opq" / "new").write_text("new")
    (src / ".wh.gone").write_text("")
    (src / ".wh.gonedir").write_text("")
    (src / "keep").mkdir()
    (src / "keep" / "b").write_text("b")
    data, _ = pack_bytes(src)
    reader_of(data).unpack(lower, whiteouts="apply")
    assert sorted(os.listdir(lower)) == ["keep", "opq"]
    assert sorted(os.listdir(lower / "keep")) == ["a", "b"]
    assert os.listdir(lower / "opq") == ["new"]
    keep = tmp_path / "keep"
    reader_of(data).unpack(keep, whiteouts="keep")
    assert (keep / ".wh.gone").exists() and (keep / "opq" / ".wh..wh..opq").exists()


@pytest.mark.integration  # mknod needs root
def test_devices_refused_by_flag(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "fifo")
    from envbuild.errors import UnsafeLayerError

    with pytest.raises(UnsafeLayerError, match="fifo"):
        pack_bytes(src, allow_devices=False)
    data, _ = pack_bytes(src)
    # unpacking refuses devices, not FIFOs (they reach no hardware; the node cache keeps them)
    reader_of(data).unpack(tmp_path / "out", allow_devices=False)
    assert (tmp_path / "out" / "fifo").is_fifo()
    dev = tmp_path / "dev"  # mknod needs root, as the whole suite does
    dev.mkdir()
    os.mknod(dev / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    data, _ = pack_bytes(dev)
    with pytest.raises(UnsafeLayerError, match="null is a char node, refused"):
        reader_of(data).unpack(tmp_path / "out2", allow_devices=False)
    reader_of(data).unpack(tmp_path / "out3")
    assert (tmp_path / "out3" / "null").is_char_device()
