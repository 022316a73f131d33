"""Full verification of a layer blob: every byte is checked against the TOC and the digests."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from envbuild.errors import CorruptLayerError, UnsafeLayerError
from envbuild.layers._footer import FOOTER_SIZE
from envbuild.layers._names import check_member_name
from envbuild.layers._reader import LayerReader
from envbuild.layers._stream import TarStream, Truncated, iter_members
from envbuild.layers._tar import TarFormatError
from envbuild.layers._toc import Chunk, Entry, LayerInfo


def verify_layer(reader: LayerReader, *, expected_digest: str | None = None,
                 expected_diff_id: str | None = None, check_names: bool = True) -> LayerInfo:
    """Check everything, or raise ``CorruptLayerError`` / ``UnsafeLayerError`` naming the layer.

    Every frame decompresses to exactly its recorded size and ends where the TOC says; the
    frames concatenate to a tar that parses; each member matches its TOC entry (metadata,
    chunk list, content digest); the tar's sha256 is the TOC's ``diff_id``; only zero bytes
    follow the end-of-archive marker; the blob's sha256 is ``expected_digest`` when given. With
    ``check_names`` every member name (and hardlink target) must also pass the unpack safety
    rules. Returns what it measured.
    """
    toc = reader.toc
    check = _Verification(reader, check_names)
    try:
        n = check.members(reader.entries())
        if check.stream.offset != toc.tar_size:
            raise check.corrupt(f"tar is {check.stream.offset} bytes, TOC says {toc.tar_size}")
    finally:
        check.close()
    diff_id = "sha256:" + check.tar_hash.hexdigest()
    if diff_id != toc.diff_id:
        raise check.corrupt(f"diff_id mismatch (TOC says {toc.diff_id}, tar is {diff_id})")
    if expected_diff_id is not None and diff_id != expected_diff_id:
        raise check.corrupt(f"diff_id mismatch (expected {expected_diff_id}, got {diff_id})")
    digest = check.blob_digest()
    if expected_digest is not None and digest != expected_digest:
        raise check.corrupt(f"digest mismatch (expected {expected_digest}, blob is {digest})")
    return LayerInfo(digest=digest, diff_id=diff_id, size=reader.size,
                     uncompressed_size=toc.tar_size, toc_digest=reader.toc_digest,
                     entries=n, frames=len(toc.frames), framing=toc.framing)


class _Verification:
    """One ``verify_layer``: the blob and tar hashes as the frames stream by, the frame table
    chunk lists are derived from, and the names seen (for the safety rules)."""

    def __init__(self, reader: LayerReader, check_names: bool) -> None:
        self.reader, self.name, self.check_names = reader, reader.name, check_names
        self.blob_hash = hashlib.sha256()
        self.tar_hash = hashlib.sha256()
        self.frame_starts = []  # (uoffset, blob offset, csize, usize)
        off = uoff = 0
        for csize, usize in reader.toc.frames:
            self.frame_starts.append((uoff, off, csize, usize))
            off += csize
            uoff += usize
        self.fi = 0  # index into frame_starts for chunk derivation
        # The frames' reader runs a thread pool: closed by close(), never left to the cyclic
        # garbage collector (which may finalize it on any thread, inside the pool's own locks).
        # _hashed is a plain function, so no reference cycle through a generator holds self.
        self._frames = reader.iter_frames(exact=True, raw=True)
        self.stream = TarStream(_hashed(self._frames, self.blob_hash, self.tar_hash))
        self.symlinks: set[str] = set()
        self.files: set[str] = set()
        self.parents: set[str] = set()

    def close(self) -> None:
        """Stop the frame reader (its thread pool) now, whatever the checks found."""
        self._frames.close()

    def corrupt(self, what: str) -> CorruptLayerError:
        return CorruptLayerError(f"layer {self.name}: {what}")

    def members(self, entries: Sequence[Entry]) -> int:
        """Check every tar member against ``entries`` (the TOC), then the archive's end; the
        number of members."""
        stream, n, i = self.stream, len(entries), 0
        try:
            for e, data_off in iter_members(stream):
                t = entries[i] if i < n else None
                i += 1
                if t is None or not e.same_header(t):
                    raise self.corrupt(f"tar member {i} ({e.path!r}) does not match the TOC")
                if self.check_names:
                    _check_safe(self.name, e, self.symlinks, self.files, self.parents)
                if e.type == "file":
                    self.content(e, t, data_off)
            if i != n:
                raise self.corrupt(f"the TOC lists {n} members, the tar {i}")
            for piece in stream.rest():
                if any(piece):
                    raise self.corrupt("non-zero bytes after the end-of-archive marker")
        except (TarFormatError, Truncated) as err:
            raise self.corrupt(f"tar stream: {err}") from None
        return n

    def content(self, e: Entry, t: Entry, data_off: int) -> None:
        """File ``e``'s data against its TOC entry ``t``: digest and chunk list."""
        h = hashlib.sha256()
        got = 0
        for piece in self.stream.pieces(e.size):
            h.update(piece)
            got += len(piece)
        if got != e.size:
            raise Truncated("tar stream ends inside member data")
        if "sha256:" + h.hexdigest() != t.digest:
            raise self.corrupt(f"content of {e.path} does not match its TOC digest")
        if t.chunks != self.chunks(data_off, e.size):
            raise self.corrupt(f"chunk list of {e.path} does not match the frames")

    def chunks(self, data_off: int, size: int) -> list[Chunk]:
        """The chunk list the frames give ``size`` bytes of data at tar offset ``data_off``."""
        expect: list[Chunk] = []
        if not size:
            return expect
        starts = self.frame_starts
        while starts[self.fi][0] + starts[self.fi][3] <= data_off:
            self.fi += 1
        j = self.fi
        end = data_off + size
        while j < len(starts) and starts[j][0] < end:
            u, o, c, s = starts[j]
            expect.append(Chunk(o, c, u, s, max(0, data_off - u)))
            j += 1
        return expect

    def blob_digest(self) -> str:
        """The blob's sha256: the frames hashed so far, then the TOC frame and footer."""
        reader = self.reader
        f = reader.footer
        tail = reader._fetch(f.toc_offset, reader.size - f.toc_offset)
        if len(tail) < FOOTER_SIZE:
            raise self.corrupt("truncated tail")
        self.blob_hash.update(tail)
        return "sha256:" + self.blob_hash.hexdigest()


def _hashed(frames: Iterator, blob_hash, tar_hash) -> Iterator:
    """The decompressed frames of ``(compressed, decompressed)`` pairs, both hashed."""
    for compressed, data in frames:
        blob_hash.update(compressed)
        tar_hash.update(data)
        yield data


def _check_safe(name: str, e: Entry, symlinks: set[str], files: set[str],
                parents: set[str]) -> None:
    """The layer-internal safety rules unpack enforces (docs/layer-format.md, "Reader safety")."""
    parts = check_member_name(name, e.path)
    for i in range(1, len(parts)):
        p = "/".join(parts[:i])
        if p in symlinks:
            raise UnsafeLayerError(f"layer {name}: member {e.path!r} would be written through "
                                   f"the symlink {p!r}")
        parents.add(p)
    if e.type != "dir" and e.path in parents:
        # a non-directory replaces a directory holding earlier members (unsorted foreign tars):
        # what was extracted below it is gone, so it cannot be a hardlink target any more
        prefix = e.path + "/"
        files.difference_update([f for f in files if f.startswith(prefix)])
        parents.difference_update([d for d in parents if d == e.path or d.startswith(prefix)])
    if e.type == "symlink":
        symlinks.add(e.path)
    elif e.type == "file":
        files.add(e.path)
    elif e.type == "hardlink":
        check_member_name(name, e.linkname, "hardlink target")
        if e.linkname not in files:
            raise UnsafeLayerError(f"layer {name}: hardlink {e.path!r} points to {e.linkname!r}, "
                                   "which is not a regular file earlier in this layer")
