"""Resource bombs in layers, in process and at a small scale (tests/security/test_bombs.py runs
the full-size ones through the CLI under an address-space limit): every frame and the TOC
inflate to at most what their verified record declares, and frame ends come from block
headers."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
import zstandard

from envbuild.errors import CorruptLayerError
from envbuild.layers import (
    SKIPPABLE_MAGIC,
    Footer,
    FrameError,
    _reader,
    _toc,
    decompress_frame,
    frame_size,
    verify_layer,
)
from tests.unit.test_layers_support import pack_bytes, reader_of

NAME = "sha256:b0b0"
MiB = 1 << 20


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    (src / "big").write_bytes(os.urandom(256 << 10))
    (src / "small").write_text("small\n")
    data, _ = pack_bytes(src)
    return data


def _zeros(n: int, *, declare: bool) -> bytes:
    cobj = zstandard.ZstdCompressor().compressobj(size=n if declare else -1)
    return b"".join([*(cobj.compress(bytes(MiB)) for _ in range(n // MiB)), cobj.flush()])


def _assemble(frames: list[bytes], toc_z: bytes, toc_usize: int) -> bytes:
    body = b"".join(frames)
    footer = Footer(len(body), len(toc_z), toc_usize, hashlib.sha256(toc_z).digest()).encode()
    return body + struct.pack("<II", SKIPPABLE_MAGIC, len(toc_z)) + toc_z + footer


def _with_frame(data: bytes, new_frame: bytes) -> bytes:
    """``data`` with the frame of ``big`` replaced; TOC and footer rebuilt to match."""
    r = reader_of(data)
    first = r.stat("big").chunks[0]
    frames, off, idx = [], 0, None
    for i, (csize, _) in enumerate(r.toc.frames):
        if off == first.offset:
            idx = i
        frames.append(data[off:off + csize])
        off += csize
    frames[idx] = new_frame
    toc = r.toc
    toc.entries = r.entries()
    toc.frames = [*toc.frames[:idx], (len(new_frame), toc.frames[idx][1]), *toc.frames[idx + 1:]]
    toc_json = toc.to_bytes()
    return _assemble(frames, zstandard.ZstdCompressor().compress(toc_json), len(toc_json))


def _all_actions(data: bytes, tmp_path):
    for action in ("read", "verify", "unpack"):
        r = reader_of(data, name=NAME)
        with pytest.raises(CorruptLayerError) as ei:
            if action == "read":
                r.read("big")
            elif action == "verify":
                verify_layer(r)
            else:
                r.unpack(tmp_path / action)
        msg = str(ei.value)
        assert "\n" not in msg and msg.startswith(f"layer {NAME}: frame at offset "), msg
        yield action, msg


@pytest.mark.parametrize("declare", [True, False])
def test_a_frame_inflating_past_its_toc_size_is_refused_everywhere(layer, tmp_path, declare):
    usize = reader_of(layer).stat("big").chunks[0].usize
    bomb = _with_frame(layer, _zeros(64 * MiB, declare=declare))
    for action, msg in _all_actions(bomb, tmp_path):
        if declare:
            assert f"its header declares {64 * MiB} bytes, the TOC says {usize}" in msg, action
        else:
            assert f"inflates to more than the {usize} bytes the TOC says" in msg, action


def test_a_frame_whose_header_under_declares_is_refused(layer, tmp_path):
    # a 1 MiB frame whose header claims the TOC's size: zstd stops at the end of the buffer
    usize = reader_of(layer).stat("big").chunks[0].usize
    frame = bytearray(zstandard.ZstdCompressor().compress(bytes(MiB)))
    assert zstandard.frame_content_size(bytes(frame)) == MiB
    # rewrite the 4-byte content size field (magic, FHD, a window byte unless single-segment)
    fhd = frame[4]
    assert fhd >> 6 == 2 and not fhd & 0x03, "expected a 4-byte FCS and no dictionary id"
    at = 5 if fhd & 0x20 else 6
    frame[at:at + 4] = struct.pack("<I", usize)
    assert zstandard.frame_content_size(bytes(frame)) == usize
    for _, msg in _all_actions(_with_frame(layer, bytes(frame)), tmp_path):
        assert "does not decompress" in msg or "inflates to more than" in msg, msg


def test_verify_refuses_a_frame_with_trailing_bytes(layer):
    r = reader_of(layer)
    first = r.stat("big").chunks[0]
    frame = layer[first.offset:first.offset + first.csize]
    bad = _with_frame(layer, frame + zstandard.ZstdCompressor().compress(b"more"))
    with pytest.raises(CorruptLayerError, match="does not end where the TOC says"):
        verify_layer(reader_of(bad, name=NAME))


def test_a_frame_larger_than_zstd_makes_for_its_usize_is_refused(layer):
    r = reader_of(layer)
    first = r.stat("big").chunks[0]
    frame = layer[first.offset:first.offset + first.csize]
    bad = _with_frame(layer, frame + bytes(first.usize))  # padding a reader would fetch
    for action in ("read", "iter_frames"):
        r = reader_of(bad, name=NAME)
        with pytest.raises(CorruptLayerError, match="larger than zstd makes"):
            r.read("big") if action == "read" else list(r.iter_frames())
        assert r.stats.ranges == 2, action  # refused before the frame is fetched


def test_toc_over_the_size_limit_is_refused_before_it_is_fetched(layer):
    f = Footer.decode(layer[-80:])
    r = reader_of(layer)
    big = Footer(f.toc_offset, f.toc_csize, _toc.MAX_TOC_USIZE + 1, f.toc_sha256).encode()
    with pytest.raises(CorruptLayerError, match="exceeds the reader limit of 64 MiB"):
        reader_of(layer[:-80] + big, name=NAME)
    assert r.stats.ranges == 2  # footer and TOC only, for the honest reader


@pytest.mark.parametrize("declare", [True, False])
def test_toc_inflating_past_the_footer_is_refused(layer, declare):
    r = reader_of(layer)
    toc_json = r.toc.to_bytes()
    padded = toc_json + b" " * (8 * MiB)  # JSON whitespace: a valid, bigger TOC
    cobj = zstandard.ZstdCompressor().compressobj(size=len(padded) if declare else -1)
    z = cobj.compress(padded) + cobj.flush()
    f = Footer.decode(layer[-80:])
    bomb = _assemble([layer[:f.toc_offset]], z, len(toc_json))
    with pytest.raises(CorruptLayerError, match="TOC frame: ") as ei:
        reader_of(bomb, name=NAME)
    assert ("its header declares" if declare else "inflates to more than") in str(ei.value)


def test_toc_member_count_is_limited(monkeypatch, layer):
    r = reader_of(layer)
    toc_json = r.toc.to_bytes()
    assert len(r.entries()) == 2
    monkeypatch.setattr(_toc, "MAX_TOC_ENTRIES", 1)
    with pytest.raises(_toc.TocFormatError, match="lists more than 1 members, the reader limit"):
        _toc.Toc.from_bytes(toc_json)
    r.toc.version = 1
    r.toc.entries = r.entries()
    with pytest.raises(_toc.TocFormatError, match="lists 2 members, over the reader limit of 1"):
        _toc.Toc.from_bytes(r.toc.to_bytes())


def test_toc_nested_too_deep_is_corrupt_not_a_recursion_error():
    with pytest.raises(_toc.TocFormatError):
        _toc.Toc.from_bytes(b'{"version":1,"entries":' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def test_whole_layer_reads_batch_at_most_the_decompressed_limit(monkeypatch, layer):
    monkeypatch.setattr(_reader, "_BATCH_USIZE", 1)  # one frame per batch
    r = reader_of(layer)
    frames = list(r.iter_frames())
    assert len(frames) == len(r.toc.frames)
    assert r.stats.ranges == 2 + len(frames)


# -- the zstd helpers -----------------------------------------------------------------------


@pytest.mark.parametrize("payload", [b"", b"x", os.urandom(300_000), bytes(1 << 20),
                                     b"abc" * 100_000])
@pytest.mark.parametrize("checksum", [False, True])
def test_frame_size_finds_the_end_of_every_kind_of_frame(payload, checksum):
    frame = zstandard.ZstdCompressor(write_checksum=checksum).compress(payload)
    assert frame_size(frame) == len(frame)
    assert frame_size(frame + b"trailing garbage") == len(frame)
    assert decompress_frame(zstandard.ZstdDecompressor(), frame, len(payload)) == payload
    with pytest.raises(FrameError):
        frame_size(frame[:-1] if checksum or len(frame) > 12 else frame[:5])


def test_decompress_frame_never_returns_more_than_asked():
    d = zstandard.ZstdDecompressor()
    with pytest.raises(FrameError, match="header declares 1048576 bytes"):
        decompress_frame(d, zstandard.ZstdCompressor().compress(bytes(MiB)), 10)
    with pytest.raises(FrameError, match="inflates to more than the 10 bytes"):
        decompress_frame(d, _zeros(MiB, declare=False), 10)
    with pytest.raises(FrameError, match="decompresses to 1048576 bytes, the TOC says 2097152"):
        decompress_frame(d, _zeros(MiB, declare=False), 2 * MiB)
    with pytest.raises(FrameError, match="not a zstd frame"):
        decompress_frame(d, b"not zstd at all", 10)


_DIFF = b'"sha256:' + b"0" * 64 + b'"'


@pytest.mark.parametrize("kind", ["frames", "xattrs", "paths", "lines"])
def test_a_toc_of_tiny_values_is_refused_before_it_is_parsed(kind):
    """Within 64 MiB, ``[1,1],`` is 11 million frames (2 GB decoded), ``"k":"",`` as many
    xattrs; counted before parsing."""
    n = _toc.MAX_TOC_VALUES + 10
    if kind == "frames":
        data = (b'{"diff_id":' + _DIFF + b',"entries":[\n],"frames":[' + b"[1,1]," * (n // 2)
                + b'[1,1]],"framing":"lazy","paths":[],"tar_size":1,"version":2}')
        match = "in its header"
    elif kind == "paths":
        data = (b'{"diff_id":' + _DIFF + b',"entries":[\n],"frames":[],"framing":"lazy",'
                b'"paths":[' + b'"a",' * n + b'"a"],"tar_size":0,"version":2}')
        match = "in its header"
    elif kind == "xattrs":
        row = (b'["file",420,0,0,0,0,"",{' + b'"k":"",' * n + b'"k":""},0,0,"sha256:'
               + b"0" * 64 + b'",null]')
        data = (b'{"diff_id":' + _DIFF + b',"entries":[\n' + row + b'\n],"frames":[],'
                b'"framing":"lazy","paths":["a"],"tar_size":0,"version":2}')
        match = "in entry 0"
    else:
        data = b'{"diff_id":' + _DIFF + b',"entries":[' + b"\n" * (_toc.MAX_TOC_ENTRIES + 3)
        match = f"more than {_toc.MAX_TOC_ENTRIES} members"
    assert len(data) <= _toc.MAX_TOC_USIZE
    with pytest.raises(_toc.TocFormatError, match=match):
        toc = _toc.Toc.from_bytes(data, lazy=True)
        toc.entries[0]
    if kind != "lines":
        v1 = data.replace(b"\n", b"")
        with pytest.raises(_toc.TocFormatError, match="JSON values, the reader limit"):
            _toc.Toc.from_bytes(v1)


@pytest.mark.parametrize("declare", [True, False])
def test_lazy_reads_are_bounded_by_the_toc_too(layer, declare):
    from envbuild.store import MemoryStore, put_bytes
    from envbuild.store.lazy import LazyLayer

    usize = reader_of(layer).stat("big").chunks[0].usize
    bomb = _with_frame(layer, _zeros(64 * MiB, declare=declare))
    store = MemoryStore()
    digest = put_bytes(store, bomb)
    lazy = LazyLayer(store, digest, size=len(bomb))
    with pytest.raises(CorruptLayerError) as ei:
        lazy.read("big")
    msg = str(ei.value)
    assert "\n" not in msg and "frame at offset " in msg, msg
    assert (f"its header declares {64 * MiB} bytes" if declare
            else f"inflates to more than the {usize} bytes") in msg, msg
    assert lazy.read("small") == b"small\n"


# -- tar members (already bounded; kept so they stay so) -------------------------------------


def _ustar(name: str, size: int, kind: bytes = b"0") -> bytes:
    import tarfile

    ti = tarfile.TarInfo(name)
    ti.size, ti.type = size, kind
    return ti.tobuf(format=tarfile.USTAR_FORMAT)


@pytest.mark.parametrize("tar, match", [
    (_ustar("././@PaxHeader", 1 << 30, b"x") + bytes(4096), "extended header too large"),
    (_ustar("big", (1 << 33) - 1) + b"x" * 4096, "input ends inside big"),
])
def test_tar_headers_declaring_huge_sizes_cost_nothing(tar, match):
    """A PAX header of 1 GiB and a member of 8 GiB declared in 512-byte headers: refused
    without reading or allocating what they declare (``MAX_PAX_HEADER``, streamed members)."""
    import io
    import resource

    from envbuild.errors import LayerError
    from envbuild.layers import pack_tar

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(LayerError, match=match):
        pack_tar(io.BytesIO(tar), io.BytesIO(), name="t")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB
