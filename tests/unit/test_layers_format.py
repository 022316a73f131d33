"""Byte-level pieces of layer format v1: tar headers, frame plans, footer, TOC codec."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envbuild.layers import (
    FOOTER_SIZE,
    Chunk,
    Entry,
    Footer,
    FooterError,
    Framing,
    Toc,
    TocFormatError,
    TocVersionError,
    plan_frames,
)

# White-box: the tar codec is private to envbuild.layers (tests/unit/test_layers_api.py).
from envbuild.layers._tar import BLOCK, encode_header, make_entry, parse_pax, parse_ustar

entries = st.builds(
    Entry,
    path=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"),
                 min_size=1, max_size=120),
    type=st.sampled_from(["file", "dir", "symlink", "hardlink", "char", "block", "fifo"]),
    mode=st.integers(0, 0o7777),
    uid=st.integers(0, 2**32 - 1),
    gid=st.integers(0, 2**32 - 1),
    size=st.integers(0, 2**40),
    mtime=st.integers(0, 2**40),
    linkname=st.text(max_size=150).filter(lambda s: "\0" not in s),
    xattrs=st.dictionaries(st.sampled_from(["user.a", "security.capability", "user.ü"]),
                           st.binary(max_size=30)),
    devmajor=st.integers(0, 4095),
    devminor=st.integers(0, 4095),
)


def _normal(e: Entry) -> Entry:
    if e.type != "file":
        e.size = 0
    return e


@settings(max_examples=200, deadline=None)
@given(entries)
def test_header_round_trips_through_our_parser_and_tarfile(e):
    e = _normal(e)
    hdr = encode_header(e)
    assert len(hdr) % BLOCK == 0
    pax = None
    flag, f = parse_ustar(hdr[:BLOCK])
    rest = hdr[BLOCK:]
    if flag == b"x":
        pax = parse_pax(rest[:f["size"]])
        flag, f = parse_ustar(hdr[-BLOCK:])
    back = make_entry(flag, f, pax)
    assert back.same_header(e)
    # the standard library agrees on what the header says
    with tarfile.open(fileobj=io.BytesIO(hdr + bytes(2 * BLOCK)), mode="r:") as tf:
        m = tf.next()
        assert m.name.rstrip("/") == e.path
        assert (m.uid, m.gid, m.mode, m.mtime) == (e.uid, e.gid, e.mode, e.mtime)
        assert m.size == e.size
        if e.type in ("symlink", "hardlink"):
            assert m.linkname == e.linkname
        for k, v in e.xattrs.items():
            assert m.pax_headers["SCHILY.xattr." + k].encode("utf-8", "surrogateescape") == v


def test_headers_are_ustar_unless_needed():
    plain = encode_header(Entry(path="usr/bin/python3", type="file", size=10))
    assert len(plain) == BLOCK and plain[257:265] == b"ustar\x0000"
    assert plain[265:329] == bytes(64)  # empty uname and gname
    long = encode_header(Entry(path="d/" + "x" * 120, type="file"))
    assert long[156:157] == b"x" and b"././@PaxHeader" in long[:100]
    assert encode_header(Entry(path="d", type="dir"))[:2] == b"d/"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([512, 1024, 2048]), st.integers(0, 40000),
                          st.booleans()), max_size=40),
       st.sampled_from(["lazy", "compact"]))
def test_frame_plans_cover_the_tar_and_respect_the_rules(members, name):
    f = Framing(name=name, small_file=1024, shared_frame=4096, max_frame=16384)
    frames = plan_frames(members, f)
    total = sum(h + d + (-d % BLOCK) for h, d, _ in members) + 2 * BLOCK
    assert frames[0][0] == 0 and sum(u for _, u in frames) == total
    assert all(a + n == b for (a, n), (b, _) in zip(frames, frames[1:]))
    assert all(n > 0 for _, n in frames)
    starts = {s for s, _ in frames}
    pos = 0
    for h, d, is_file in members:
        pos += h
        if name == "lazy" and is_file and d >= f.small_file:
            # a big file's contents start and end frames, and each frame is at most max_frame
            assert pos in starts and (pos + d) in starts | {total}
            inside = [(s, n) for s, n in frames if pos <= s < pos + d]
            assert all(n <= f.max_frame for _, n in inside)
        pos += d + (-d % BLOCK)
    assert max(n for _, n in frames) <= f.max_frame + 2048 + 512


def test_footer_codec():
    foot = Footer(toc_offset=123, toc_csize=45, toc_usize=678, toc_sha256=b"\x01" * 32)
    raw = foot.encode()
    assert len(raw) == FOOTER_SIZE and raw[:4] == (0x184D2A5E).to_bytes(4, "little")
    assert Footer.decode(raw) == foot and foot.blob_size == 123 + 8 + 45 + 80
    with pytest.raises(FooterError, match="wrong magic"):
        Footer.decode(b"\0" * FOOTER_SIZE)
    v2 = Footer(1, 2, 3, b"\0" * 32, version=2).encode()
    with pytest.raises(FooterError) as ei:
        Footer.decode(v2)
    assert ei.value.unsupported


def test_toc_codec_is_canonical_and_strict():
    toc = Toc(framing="lazy", diff_id="sha256:" + "0" * 64, tar_size=1024,
              frames=[(20, 1024)], entries=[Entry(path="é", type="file", xattrs={"user.a": b"\0"},
                                                  digest="sha256:" + "1" * 64)])
    raw = toc.to_bytes()
    assert raw.isascii() and b" " not in raw
    assert Toc.from_bytes(raw) == toc
    with pytest.raises(TocVersionError):
        Toc.from_bytes(raw.replace(b'"version":2', b'"version":3'))
    with pytest.raises(TocFormatError):
        Toc.from_bytes(raw.replace(b'"file",420,', b'"file",-1,'))
    with pytest.raises(TocFormatError):
        Toc.from_bytes(b"[1]")
    # v1 (layers written before v2) still decodes
    v1 = dataclasses.replace(toc, version=1)
    assert b"\n" not in v1.to_bytes() and Toc.from_bytes(v1.to_bytes()) == v1
    with pytest.raises(TocVersionError):
        Toc.from_bytes(v1.to_bytes().replace(b'"version":1', b'"version":3'))


def _toc_doc(toc: Toc) -> dict:
    return {"version": 2, "framing": toc.framing, "diff_id": toc.diff_id,
            "tar_size": toc.tar_size, "frames": [list(f) for f in toc.frames],
            "paths": [e.path for e in toc.entries],
            "entries": [[e.type, e.mode, e.uid, e.gid, e.size, e.mtime, e.linkname,
                         {k: base64.b64encode(v).decode() for k, v in e.xattrs.items()},
                         e.devmajor, e.devminor, e.digest, e.data_offset]
                        for e in toc.entries]}


@settings(max_examples=100, deadline=None)
@given(st.lists(entries, max_size=5, unique_by=lambda e: e.path))
def test_toc_v2_is_canonical_json_with_one_row_per_line(members):
    """v2 bytes = canonical json.dumps of the document plus a newline before each row and
    before the closing bracket of "entries"; chunks come back derived from the frames."""
    frames = [(10, 512), (30, 4096), (7, 1024)]
    for i, e in enumerate(_normal(e) for e in members):
        e.digest = "sha256:" + "ab" * 32 if e.type == "file" else None
        if e.type == "file":
            e.size = i * 700
            e.chunks = [Chunk(10, 30, 512, 4096, 100)] if e.size else []
    toc = Toc(framing="compact", diff_id="sha256:" + "0" * 64, tar_size=5632, frames=frames,
              entries=members)
    raw = toc.to_bytes()
    doc = _toc_doc(toc)
    assert raw.replace(b"\n", b"") == json.dumps(doc, sort_keys=True, separators=(",", ":"),
                                                  ensure_ascii=True).encode()
    assert json.loads(raw) == doc
    lines = raw.split(b"\n")
    assert len(lines) == len(members) + 2 and lines[0].endswith(b'"entries":[')
    back = Toc.from_bytes(raw)
    assert back == toc
    lazy = Toc.from_bytes(raw, lazy=True)
    assert [lazy.entries[i] for i in reversed(range(len(members)))] == members[::-1]
    assert lazy.entries[:] == members


def test_toc_v2_chunks_follow_the_frames():
    frames = [(10, 512), (30, 4096), (7, 1024), (9, 2048)]
    e = Entry(path="f", type="file", size=5100, digest="sha256:" + "0" * 64,
              chunks=[Chunk(10, 30, 512, 4096, 100)])
    toc = Toc(framing="lazy", diff_id="sha256:" + "0" * 64, tar_size=7680, frames=frames,
              entries=[e])
    back = Toc.from_bytes(toc.to_bytes()).entries[0]
    assert back.chunks == [Chunk(10, 30, 512, 4096, 100), Chunk(40, 7, 4608, 1024, 0),
                           Chunk(47, 9, 5632, 2048, 0)]
    e.size = 8000  # past the end of the tar
    with pytest.raises(TocFormatError, match="past the tar"):
        Toc.from_bytes(toc.to_bytes())
