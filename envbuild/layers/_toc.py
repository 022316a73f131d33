"""The table of contents (TOC) of a layer: the versioned contract between writers and readers.

A layer blob (format v1, docs/layer-format.md) is a sequence of independent zstd frames that
together decompress to one POSIX tar, followed by the TOC in a zstd skippable frame and a fixed
80-byte footer. The TOC is what lets a reader list a layer, stat a member and read one file by
fetching only the frames that hold it. It is canonical JSON (``sort_keys``, separators ``,`` and
``:``, ASCII), compressed as one zstd frame::

    {
      "version": 1,                       # this module's format; readers reject anything else
      "framing": "lazy" | "compact",      # informational: how the writer cut frames
      "diff_id": "sha256:<hex>",          # sha256 of the whole uncompressed tar
      "tar_size": <int>,                  # length of the uncompressed tar in bytes
      "frames": [[csize, usize], ...],    # every data frame in blob order: compressed and
                                          # uncompressed size. Frame i starts in the blob at
                                          # sum(csize of frames < i) and in the tar at
                                          # sum(usize of frames < i); the frames cover the blob
                                          # from byte 0 to the TOC frame, and the tar exactly.
      "entries": [entry, ...]             # one per tar member, in tar order (depth first, each
                                          # directory's members sorted by name bytes, for
                                          # layers made by pack_tree)
    }

    entry = {
      "path": str,          # member name, relative, "/"-separated, no trailing "/" (even for
                            # directories, whose tar name carries one); no "./" prefix
      "type": "file" | "dir" | "symlink" | "hardlink" | "char" | "block" | "fifo",
      "mode": int,          # permission bits incl. setuid/setgid/sticky (st_mode & 0o7777)
      "uid": int, "gid": int,   # numeric owner (no names are ever recorded)
      "size": int,          # bytes of content; 0 for everything but "file"
      "mtime": int,         # seconds since the epoch, already clamped by the writer
      "linkname": str,      # symlink target as stored, or the path of the member a
                            # hardlink points to; "" otherwise
      "xattrs": {name: base64(value)},   # extended attributes, sorted by name
      "devmajor": int, "devminor": int,  # device numbers for "char"/"block", else 0
      "digest": "sha256:<hex>" | null,   # sha256 of the contents for "file", null otherwise
      "chunks": [chunk, ...]             # where a "file"'s contents are; [] if size == 0
    }

    chunk = {
      "offset": int,   # blob offset of the first byte of the zstd frame holding this piece
      "csize":  int,   # compressed size of that frame: fetch [offset, offset + csize)
      "uoffset": int,  # tar offset of the frame's first uncompressed byte
      "usize":  int,   # uncompressed size of the frame
      "inner":  int    # where this file's bytes start inside the decompressed frame
    }

A file's contents are the concatenation, over its chunks in order, of
``frame[inner : inner + n]`` where ``n = min(usize - inner, bytes still missing)``; the chunk
list is exactly the frames overlapping ``[data_offset, data_offset + size)`` of the tar, so the
first chunk's ``uoffset + inner`` is the file's data offset in the tar and every later chunk has
``inner == 0``. Each chunk repeats its frame's position (rather than naming a frame index) so a
lazy reader can fetch a file from its entry alone; ``frames`` exists for whole-layer readers
(unpack, verify) that must also decompress frames holding only headers.

Readers must verify, not trust: the TOC's own sha256 is in the footer (and, from the store, in
the layer's descriptor annotations); every file read is checked against ``digest``.
Compatibility: adding a new top-level or entry key is a new ``version``; readers reject
versions they do not know by name.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Sequence
from typing import NamedTuple

TOC_VERSION = 1
TYPES = ("file", "dir", "symlink", "hardlink", "char", "block", "fifo")
FRAMINGS = ("lazy", "compact")


class Chunk(NamedTuple):
    offset: int
    csize: int
    uoffset: int
    usize: int
    inner: int


@dataclasses.dataclass(slots=True)
class Entry:
    """One tar member as recorded in the TOC (see the module docstring for each field)."""

    path: str
    type: str
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    size: int = 0
    mtime: int = 0
    linkname: str = ""
    xattrs: dict[str, bytes] = dataclasses.field(default_factory=dict)
    devmajor: int = 0
    devminor: int = 0
    digest: str | None = None
    chunks: list[Chunk] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "path": self.path, "type": self.type, "mode": self.mode, "uid": self.uid,
            "gid": self.gid, "size": self.size, "mtime": self.mtime, "linkname": self.linkname,
            "xattrs": {k: base64.b64encode(v).decode("ascii") for k, v in self.xattrs.items()},
            "devmajor": self.devmajor, "devminor": self.devminor, "digest": self.digest,
            "chunks": [c._asdict() for c in self.chunks],
        }

    def same_header(self, other: Entry) -> bool:
        """Metadata equality (everything a tar header records): used to cross-check tar vs TOC."""
        return (self.path == other.path and self.type == other.type and self.mode == other.mode
                and self.uid == other.uid and self.gid == other.gid and self.size == other.size
                and self.mtime == other.mtime and self.linkname == other.linkname
                and self.xattrs == other.xattrs and self.devmajor == other.devmajor
                and self.devminor == other.devminor)


@dataclasses.dataclass
class Toc:
    """A decoded TOC. ``frames`` is a list of ``(csize, usize)``; see the module docstring."""

    framing: str
    diff_id: str
    tar_size: int
    frames: list[tuple[int, int]]
    entries: list[Entry]
    version: int = TOC_VERSION

    def to_bytes(self) -> bytes:
        doc = {
            "version": self.version, "framing": self.framing, "diff_id": self.diff_id,
            "tar_size": self.tar_size, "frames": [list(f) for f in self.frames],
            "entries": [e.to_json() for e in self.entries],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, lazy: bool = False) -> Toc:
        """Decode and validate. Raises ``TocFormatError`` (message without the layer name) or
        ``TocVersionError``; the reader turns them into layer errors. With ``lazy``, entries
        are validated and turned into ``Entry`` objects only when first accessed (a reader
        that stats one file out of 15,000 should not pay for all of them)."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise TocFormatError(f"TOC is not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise TocFormatError("TOC is not a JSON object")
        version = doc.get("version")
        if version != TOC_VERSION:
            raise TocVersionError(f"unsupported TOC version {version!r} (this reader knows 1)")
        try:
            frames = [(_int(c), _int(u)) for c, u in doc["frames"]]
            raw = doc["entries"]
            if not isinstance(raw, list) or not all(isinstance(d, dict) for d in raw):
                raise TypeError("entries must be a list of objects")
            entries = LazyEntries(raw) if lazy else [_entry(d) for d in raw]
            toc = cls(framing=_str(doc["framing"]), diff_id=_str(doc["diff_id"]),
                      tar_size=_int(doc["tar_size"]), frames=frames, entries=entries)
        except (KeyError, TypeError, ValueError) as e:
            raise TocFormatError(f"TOC does not match the v1 schema ({type(e).__name__}: {e})") \
                from None
        if sum(u for _, u in frames) != toc.tar_size:
            raise TocFormatError("TOC frames do not add up to tar_size")
        return toc


class TocFormatError(ValueError):
    pass


class LazyEntries(Sequence):
    """The entries of a TOC, decoded and validated one by one on first access."""

    def __init__(self, raw: list[dict]) -> None:
        self._raw = raw
        self._done: list[Entry | None] = [None] * len(raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        e = self._done[i]
        if e is None:
            try:
                e = self._done[i] = _entry(self._raw[i])
            except (KeyError, TypeError, ValueError) as err:
                raise TocFormatError(f"TOC entry {i} does not match the v1 schema "
                                     f"({type(err).__name__}: {err})") from None
        return e

    def raw_path(self, i: int):
        return self._raw[i].get("path")


class TocVersionError(ValueError):
    pass


def _int(v) -> int:
    if type(v) is not int or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


def _str(v) -> str:
    if type(v) is not str:
        raise ValueError(f"expected a string, got {v!r}")
    return v


def _entry(d: dict) -> Entry:
    t = d["type"]
    if t not in TYPES:
        raise ValueError(f"unknown entry type {t!r}")
    digest = d["digest"]
    if digest is not None:
        _str(digest)
    xattrs = {_str(k): base64.b64decode(_str(v), validate=True) for k, v in d["xattrs"].items()}
    chunks = [Chunk(_int(c["offset"]), _int(c["csize"]), _int(c["uoffset"]), _int(c["usize"]),
                    _int(c["inner"])) for c in d["chunks"]]
    return Entry(path=_str(d["path"]), type=t, mode=_int(d["mode"]), uid=_int(d["uid"]),
                 gid=_int(d["gid"]), size=_int(d["size"]), mtime=_int(d["mtime"]),
                 linkname=_str(d["linkname"]), xattrs=xattrs, devmajor=_int(d["devmajor"]),
                 devminor=_int(d["devminor"]), digest=digest, chunks=chunks)


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """What a writer (or ``verify_layer``) learned about a layer blob.

    ``digest`` is the layer digest (sha256 of the blob, the OCI descriptor digest), ``diff_id``
    the sha256 of the uncompressed tar (OCI ``rootfs.diff_ids``), ``toc_digest`` the sha256 of
    the compressed TOC (record it in the descriptor annotations and pass it to ``LayerReader``).
    """

    digest: str
    diff_id: str
    size: int
    uncompressed_size: int
    toc_digest: str
    entries: int
    frames: int
    framing: str
    media_type: str = "application/vnd.oci.image.layer.v1.tar+zstd"
