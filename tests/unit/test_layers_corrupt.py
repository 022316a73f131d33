"""Corrupt, truncated, tampered and hostile layers: the right error class, one line, named."""

from __future__ import annotations

import gc
import hashlib
import io
import os
import struct
import tarfile
import threading

import pytest
import zstandard

from envbuild.errors import (
    CorruptLayerError,
    LayerError,
    UnsafeLayerError,
    UnsupportedFormatError,
)
from envbuild.layers import FOOTER_SIZE, SKIPPABLE_MAGIC, Footer, pack_tar, verify_layer
from tests.unit.test_layers_support import TINY, pack_bytes, reader_of

NAME = "sha256:feedface"


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    (src / "dir").mkdir()
    (src / "dir" / "small").write_text("small file\n")
    (src / "big").write_bytes(os.urandom(50_000))
    data, info = pack_bytes(src, framing=TINY)
    return data, info


def _footer(data: bytes) -> Footer:
    return Footer.decode(data[-FOOTER_SIZE:])


def _check(exc_info, cls):
    assert type(exc_info.value) is cls, exc_info.value
    msg = str(exc_info.value)
    assert "\n" not in msg and msg.startswith(f"layer {NAME}: "), msg


def _open_all(data: bytes, tmp_path=None):
    r = reader_of(data, name=NAME)
    for e in r.entries():
        if e.type == "file":
            r.read(e.path)
    verify_layer(r)
    if tmp_path is not None:
        r.unpack(tmp_path / "out")


@pytest.mark.parametrize("cut", [1, 40, FOOTER_SIZE, FOOTER_SIZE + 10, 0.5, 0.99])
def test_truncated(layer, cut):
    data, _ = layer
    n = int(len(data) * cut) if isinstance(cut, float) else len(data) - cut
    with pytest.raises(CorruptLayerError) as ei:
        _open_all(data[:n])
    _check(ei, CorruptLayerError)


def test_flip_in_data_frame_is_caught_by_read_verify_and_unpack(layer, tmp_path):
    data, _ = layer
    r = reader_of(data)
    c = r.stat("big").chunks[1]
    bad = bytearray(data)
    bad[c.offset + c.csize // 2] ^= 0x40
    bad = bytes(bad)
    for action in ("read", "verify", "unpack"):
        r = reader_of(bad, name=NAME)
        with pytest.raises(CorruptLayerError) as ei:
            if action == "read":
                r.read("big")
            elif action == "verify":
                verify_layer(r)
            else:
                r.unpack(tmp_path / action)
        _check(ei, CorruptLayerError)
    # a flip in another file's frame does not affect reading this one
    assert reader_of(bad).read("dir/small") == b"small file\n"


def test_flip_in_toc(layer):
    data, _ = layer
    f = _footer(data)
    bad = bytearray(data)
    bad[f.toc_offset + 8 + f.toc_csize // 2] ^= 1
    with pytest.raises(CorruptLayerError, match="TOC digest mismatch") as ei:
        reader_of(bytes(bad), name=NAME)
    _check(ei, CorruptLayerError)


@pytest.mark.parametrize("field_offset, cls", [
    (2, CorruptLayerError),     # skippable magic
    (9, CorruptLayerError),     # footer magic
    (16, UnsupportedFormatError),  # version
    (20, CorruptLayerError),    # flags
    (24, CorruptLayerError),    # toc_offset
    (32, CorruptLayerError),    # toc_csize
    (40, CorruptLayerError),    # toc_usize
    (60, CorruptLayerError),    # toc_sha256
])
def test_flip_in_footer(layer, field_offset, cls):
    data, _ = layer
    bad = bytearray(data)
    bad[len(data) - FOOTER_SIZE + field_offset] ^= 0x04
    with pytest.raises(LayerError) as ei:
        reader_of(bytes(bad), name=NAME)
    _check(ei, cls)


def test_wrong_magic_and_not_a_layer(layer):
    data, _ = layer
    with pytest.raises(CorruptLayerError, match="wrong magic") as ei:
        reader_of(data[:-FOOTER_SIZE] + b"\0" * FOOTER_SIZE, name=NAME)
    _check(ei, CorruptLayerError)
    plain = zstandard.ZstdCompressor().compress(b"\0" * 4096)
    with pytest.raises(CorruptLayerError) as ei:
        reader_of(plain, name=NAME)
    _check(ei, CorruptLayerError)


def _rebuild_tail(data: bytes, toc_json: bytes, *, version: int = 1) -> bytes:
    f = _footer(data)
    z = zstandard.ZstdCompressor().compress(toc_json)
    footer = Footer(f.toc_offset, len(z), len(toc_json), hashlib.sha256(z).digest(),
                    version=version).encode()
    return data[:f.toc_offset] + struct.pack("<II", SKIPPABLE_MAGIC, len(z)) + z + footer


def test_version_99(layer):
    data, _ = layer
    r = reader_of(data)
    toc_json = r.toc.to_bytes()
    with pytest.raises(UnsupportedFormatError, match="version 99") as ei:
        reader_of(_rebuild_tail(data, toc_json, version=99), name=NAME)
    _check(ei, UnsupportedFormatError)
    # the TOC's own version, in the v2 line layout and as one-line JSON
    assert toc_json.endswith(b'"version":2}')
    toc99 = toc_json.replace(b'"version":2', b'"version":99')
    for toc in (toc99, toc99.replace(b"\n", b"")):
        with pytest.raises(UnsupportedFormatError, match="TOC version 99") as ei:
            reader_of(_rebuild_tail(data, toc), name=NAME)
        _check(ei, UnsupportedFormatError)


def test_toc_v1_layers_are_still_read(layer, tmp_path):
    """Layers written before TOC v2 (the v1 entry objects, chunks spelled out) stay readable."""
    data, info = layer
    r = reader_of(data)
    toc = r.toc
    toc.entries = r.entries()
    toc.version = 1
    old = _rebuild_tail(data, toc.to_bytes())
    assert b'"chunks":[{' in zstandard.ZstdDecompressor().decompress(
        old[_footer(old).toc_offset + 8:-FOOTER_SIZE])
    r1 = reader_of(old, name=NAME)
    assert r1.toc.version == 1 and r1.entries() == r.entries()
    assert r1.read("big") == r.read("big")
    verify_layer(r1, expected_diff_id=info.diff_id)
    r1.unpack(tmp_path / "out")
    assert (tmp_path / "out" / "dir" / "small").read_text() == "small file\n"


def test_toc_v2_rows_must_match_paths(layer):
    data, _ = layer
    toc_json = reader_of(data).toc.to_bytes()
    head, rows, tail = toc_json.split(b"\n", 1)[0], toc_json.split(b"\n")[1:-1], \
        toc_json.rsplit(b"\n", 1)[1]
    dropped = b"\n".join([head, *rows[:-2], rows[-2].rstrip(b","), tail])
    with pytest.raises(CorruptLayerError, match="paths but") as ei:
        reader_of(_rebuild_tail(data, dropped), name=NAME)
    _check(ei, CorruptLayerError)
    bad_row = toc_json.replace(b'"file",', b'"fiel",', 1)
    r = reader_of(_rebuild_tail(data, bad_row), name=NAME)
    with pytest.raises(CorruptLayerError, match="unknown entry type") as ei:
        r.entries()
    _check(ei, CorruptLayerError)


def test_toc_digest_mismatch_against_descriptor(layer):
    data, info = layer
    reader_of(data, expected_toc_digest=info.toc_digest)
    with pytest.raises(CorruptLayerError, match="TOC digest mismatch") as ei:
        reader_of(data, name=NAME, expected_toc_digest="sha256:" + "0" * 64)
    _check(ei, CorruptLayerError)


def test_consistent_but_lying_toc_is_caught(layer, tmp_path):
    """A TOC with a valid footer digest that disagrees with the tar (a re-signed tamper): the
    layer digest and the descriptor's TOC digest catch it; so does ``verify_layer``."""
    data, info = layer
    r = reader_of(data)
    r.toc.entries[1].mode = 0o777
    lying = _rebuild_tail(data, r.toc.to_bytes())
    with pytest.raises(CorruptLayerError, match="does not match the TOC") as ei:
        verify_layer(reader_of(lying, name=NAME))
    _check(ei, CorruptLayerError)
    with pytest.raises(CorruptLayerError, match="TOC digest mismatch"):
        reader_of(lying, name=NAME, expected_toc_digest=info.toc_digest)
    r = reader_of(data)
    e = r.stat("dir/small")
    e.digest = "sha256:" + "1" * 64
    with pytest.raises(CorruptLayerError, match="does not match its TOC digest") as ei:
        reader_of(_rebuild_tail(data, r.toc.to_bytes()), name=NAME).read("dir/small")
    _check(ei, CorruptLayerError)


def test_verify_checks_the_blob_digest(layer):
    data, info = layer
    assert verify_layer(reader_of(data), expected_digest=info.digest) == info
    with pytest.raises(CorruptLayerError, match="digest mismatch"):
        verify_layer(reader_of(data), expected_digest="sha256:" + "2" * 64)


# -- hostile tars ------------------------------------------------------------------------------

def _hostile(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, extra in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                ti.size = len(extra)
                tf.addfile(ti, io.BytesIO(extra))
                continue
            ti.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                       "hardlink": tarfile.LNKTYPE}[kind]
            if kind == "dir":
                ti.mode = 0o755  # TarInfo's 0o644 would lock out any user but root
            ti.linkname = extra or ""
            tf.addfile(ti)
    out = io.BytesIO()
    pack_tar(io.BytesIO(buf.getvalue()), out, framing=TINY)
    return out.getvalue()


@pytest.mark.parametrize("members, match", [
    ([("../x", "file", b"evil")], r"'\.\.' has a \.\. path|\.\. path component"),
    ([("a/../../x", "file", b"evil")], r"\.\. path component"),
    ([("/etc/x", "file", b"evil")], "absolute path"),
    ([("link", "symlink", ".."), ("link/x", "file", b"evil")], "through the symlink 'link'"),
    ([("link", "symlink", "/etc"), ("link/sub/x", "file", b"evil")], "through the symlink"),
    ([("h", "hardlink", "missing")], "not a regular file earlier"),
    ([("h", "hardlink", "../outside")], r"\.\. path component"),
    ([("h", "hardlink", "/etc/passwd")], "absolute path"),
    ([("d", "dir", None), ("d/h", "hardlink", "d")], "not a regular file earlier"),
    # unsorted: a file below d, then d becomes a symlink, then a hardlink through it
    ([("d/f", "file", b"x"), ("d", "symlink", "/etc"), ("h", "hardlink", "d/f")],
     "not a regular file earlier"),
])
def test_hostile_members_are_refused(tmp_path, members, match):
    data = _hostile(members)
    dest = tmp_path / "deep" / "dest"
    with pytest.raises(UnsafeLayerError, match=match) as ei:
        reader_of(data, name=NAME).unpack(dest)
    _check(ei, UnsafeLayerError)
    assert not (tmp_path / "deep" / "x").exists() and not (tmp_path / "x").exists()
    assert not os.path.exists("/etc/x")
    with pytest.raises(UnsafeLayerError):
        verify_layer(reader_of(data, name=NAME))


def test_writing_through_an_existing_symlink_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(outside, dest / "lib")
    data = _hostile([("lib/x", "file", b"evil")])
    with pytest.raises(UnsafeLayerError, match="through the symlink 'lib'"):
        reader_of(data).unpack(dest)
    assert not (outside / "x").exists()
    # a file member replaces a symlink at its own path instead of writing through it
    os.symlink(outside / "target", dest / "f")
    reader_of(_hostile([("f", "file", b"data")])).unpack(dest)
    assert not (outside / "target").exists() and (dest / "f").read_bytes() == b"data"


def test_pack_tar_of_an_ordinary_tar_round_trips(tmp_path):
    data = _hostile([("./a", "dir", None), ("./a/f", "file", b"x" * 5000),
                     ("./a/h", "hardlink", "./a/f"), ("./s", "symlink", "a/f")])
    r = reader_of(data)
    assert [e.path for e in r.entries()] == ["a", "a/f", "a/h", "s"]
    verify_layer(r)
    r.unpack(tmp_path / "o")
    assert (tmp_path / "o" / "a" / "h").read_bytes() == b"x" * 5000
    assert os.readlink(tmp_path / "o" / "s") == "a/f"


def test_a_failed_verify_stops_its_frame_reader_at_once():
    """``verify_layer`` stops the frame reader's thread pool before it returns or raises, not
    whenever the cyclic garbage collector runs: a finalizer run by the collector on another
    thread, inside a thread pool's locks, hung the unit tests (issue 38's split of verify)."""
    data = _hostile([("h", "hardlink", "../outside")])
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(UnsafeLayerError):
            verify_layer(reader_of(data, name=NAME))
        alive = [t.name for t in threading.enumerate() if t.name.startswith("layer-unzstd")]
    finally:
        gc.enable()
    assert alive == []
