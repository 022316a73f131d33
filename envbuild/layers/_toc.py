r"""The table of contents (TOC) of a layer: the versioned contract between writers and readers.

A layer blob (format v1, docs/layer-format.md) is a sequence of independent zstd frames that
together decompress to one POSIX tar, followed by the TOC in a zstd skippable frame and a fixed
80-byte footer. The TOC is what lets a reader list a layer, stat a member and read one file by
fetching only the frames that hold it. It is one JSON document (ASCII, ``\u`` escapes, keys
sorted, no spaces), compressed as one zstd frame. Writers produce **version 2**; readers accept
versions 1 and 2 and reject any other by name.

Version 2 (written since layers/perf; ~2x smaller and opened ~10x faster than v1 on 15k
entries) stores paths as one array and every other entry field as a fixed-order array, one
entry per line::

    {"diff_id":"sha256:<hex>","entries":[        <- line 0 ends exactly here
    [row of entry 0],                            <- one line per entry, "," after all but the last
    [row of entry n-1]
    ],"frames":[[csize,usize],...],"framing":"lazy","paths":[path 0, ...],"tar_size":N,"version":2}

The bytes are exactly ``json.dumps(doc, sort_keys=True, separators=(",", ":"),
ensure_ascii=True)`` with a ``\n`` inserted before each row and before the closing ``]`` of
``entries`` (JSON whitespace, so any JSON parser reads the document; no other ``\n`` can occur,
since strings escape control characters). A reader can therefore parse line 0 + the last line
as the header (with ``"entries":[]``), index ``paths`` and decode only the rows it needs.

    "version": 2                # readers reject versions they do not know, by number
    "framing": "lazy" | "compact"   # informational: how the writer cut frames
    "diff_id": "sha256:<hex>"   # sha256 of the whole uncompressed tar
    "tar_size": <int>           # length of the uncompressed tar in bytes
    "frames": [[csize, usize], ...]   # every data frame in blob order: compressed and
                                # uncompressed size. Frame i starts in the blob at
                                # sum(csize of frames < i) and in the tar at sum(usize of frames
                                # < i); the frames cover the blob from byte 0 to the TOC frame,
                                # and the tar exactly.
    "paths": [str, ...]         # member names, one per tar member, in tar order: relative,
                                # "/"-separated, no trailing "/" (even for directories, whose
                                # tar name carries one), no "./" prefix; unique
    "entries": [row, ...]       # row i describes paths[i]:

    row = [type, mode, uid, gid, size, mtime, linkname, xattrs, devmajor, devminor, digest, data]
      type      "file" | "dir" | "symlink" | "hardlink" | "char" | "block" | "fifo"
      mode      permission bits incl. setuid/setgid/sticky (st_mode & 0o7777)
      uid, gid  numeric owner (no names are ever recorded)
      size      bytes of content; 0 for everything but "file"
      mtime     seconds since the epoch, already clamped by the writer
      linkname  symlink target as stored, or the path of the member a hardlink points to; ""
      xattrs    {name: base64(value)}, extended attributes, sorted by name
      devmajor, devminor   device numbers for "char"/"block", else 0
      digest    "sha256:<hex>" of the contents for "file" (also when empty), null otherwise
      data      tar offset of the first content byte for a "file" with size > 0, else null

A file's *chunks* are the frames overlapping ``[data, data + size)`` of the tar, in order; the
reader derives them from ``frames`` (``Entry.chunks``: blob ``offset`` and ``csize`` of the
frame, its tar ``uoffset`` and ``usize``, and ``inner`` = where the file's bytes start inside
the decompressed frame, non-zero only for the first chunk). The contents are the concatenation,
over the chunks, of ``frame[inner : inner + n]`` with ``n = min(usize - inner, bytes still
missing)``.

Version 1 (read for layers written before): the same top-level fields without ``paths``, and
``entries`` as objects ``{"path", "type", "mode", "uid", "gid", "size", "mtime", "linkname",
"xattrs", "devmajor", "devminor", "digest", "chunks": [{"offset", "csize", "uoffset",
"usize", "inner"}, ...]}`` with the chunks spelled out; no line breaks.

Limits (readers refuse more, before inflating it: a 5 MB blob can carry a TOC that inflates to
600 MB of JSON): the TOC is at most ``MAX_TOC_USIZE`` (64 MiB) of JSON, lists at most
``MAX_TOC_ENTRIES`` (262,144) members, and holds at most ``MAX_TOC_VALUES`` (6,000,000) JSON
values, counted as commas before any part is parsed (a member row has 12, a frame 2): 64 MiB
of ``[1,1],`` would otherwise decode to 11 million frames and 2 GB. Real layers are far below
all three: a 14,700-member layer (a Python env with its site-packages) has a 2.7 MB TOC, ~185
bytes and ~13 values per member (18 times fewer than the limits allow). Decoding a TOC at the
limits costs a reader at most ~0.6 GiB and a few seconds.

Readers must verify, not trust: the TOC's own sha256 is in the footer (and, from the store, in
the layer's descriptor annotations); every file read is checked against ``digest``.
Compatibility: adding a new top-level or entry field, or changing the layout, is a new
``version``; readers reject versions they do not know by name.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import itertools
import json
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as json_string
from typing import Any, NamedTuple

TOC_VERSION = 2
MAX_TOC_USIZE = 64 << 20      # bytes of TOC JSON a reader accepts (see "Limits" above)
MAX_TOC_ENTRIES = 1 << 18     # members a reader accepts
MAX_TOC_VALUES = 6_000_000    # JSON values (counted as commas) a reader decodes
READABLE_VERSIONS = (1, 2)
TYPES = ("file", "dir", "symlink", "hardlink", "char", "block", "fifo")
_TYPE_SET = frozenset(TYPES)
FRAMINGS = ("lazy", "compact")
_V2_OPEN = b'"entries":['  # a v2 TOC's first line ends here (see the module docstring)


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
        """The v1 entry object."""
        return {
            "path": self.path, "type": self.type, "mode": self.mode, "uid": self.uid,
            "gid": self.gid, "size": self.size, "mtime": self.mtime, "linkname": self.linkname,
            "xattrs": {k: base64.b64encode(v).decode("ascii") for k, v in self.xattrs.items()},
            "devmajor": self.devmajor, "devminor": self.devminor, "digest": self.digest,
            "chunks": [c._asdict() for c in self.chunks],
        }

    @property
    def data_offset(self) -> int | None:
        """Tar offset of the first content byte (files with chunks), else None."""
        c = self.chunks[0] if self.chunks else None
        return None if c is None else c.uoffset + c.inner

    def same_header(self, other: Entry) -> bool:
        """Metadata equality (everything a tar header records): used to cross-check tar vs TOC."""
        return (self.path == other.path and self.type == other.type and self.mode == other.mode
                and self.uid == other.uid and self.gid == other.gid and self.size == other.size
                and self.mtime == other.mtime and self.linkname == other.linkname
                and self.xattrs == other.xattrs and self.devmajor == other.devmajor
                and self.devminor == other.devminor)


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def entry_row(e: Entry, data: int | None) -> str:
    """The v2 row of an entry: canonical JSON, byte-identical to ``_canonical(list)`` (a test
    checks), formatted by hand because the writer makes one per member."""
    x = e.xattrs
    link = e.linkname
    d = e.digest
    # %-formatting on purpose: this runs once per TOC entry and is faster than an f-string here.
    return "[%s,%d,%d,%d,%d,%d,%s,%s,%d,%d,%s,%s]" % (  # noqa: UP031
        _TYPE_JSON.get(e.type) or json_string(e.type), e.mode, e.uid, e.gid, e.size, e.mtime,
        json_string(link) if link else '""',
        _canonical({k: base64.b64encode(v).decode("ascii") for k, v in x.items()}) if x else "{}",
        e.devmajor, e.devminor, "null" if d is None else json_string(d),
        "null" if data is None else "%d" % data)  # noqa: UP031


_TYPE_JSON = {t: f'"{t}"' for t in TYPES}


def encode_v2(framing: str, diff_id: str, tar_size: int, frames: Sequence[tuple[int, int]],
              json_paths: list[str], rows: list[str]) -> bytes:
    """Assemble a v2 TOC from its parts: ``json_paths[i]`` = ``json_string`` of entry ``i``'s
    path, ``rows[i]`` = its ``entry_row``."""
    body = "".join(["\n" + r + "," for r in rows])
    if body:
        body = body[:-1]
    return "".join([
        '{"diff_id":', json_string(diff_id), ',"entries":[', body, '\n],"frames":',
        _canonical([list(f) for f in frames]), ',"framing":', json_string(framing), ',"paths":[',
        ",".join(json_paths), '],"tar_size":', format(tar_size, "d"), ',"version":2}',
    ]).encode("ascii")


@dataclasses.dataclass
class Toc:
    """A decoded TOC. ``frames`` is a list of ``(csize, usize)``; see the module docstring.

    ``version`` is the layout ``to_bytes`` writes (2; 1 for compatibility tests); readers
    accept both."""

    framing: str
    diff_id: str
    tar_size: int
    frames: list[tuple[int, int]]
    entries: Sequence[Entry]  # a list, or LazyEntries/RowEntries from from_bytes(lazy=True)
    version: int = TOC_VERSION

    def to_bytes(self) -> bytes:
        if self.version == 2:
            entries = self.entries
            return encode_v2(self.framing, self.diff_id, self.tar_size, self.frames,
                             [json_string(e.path) for e in entries],
                             [entry_row(e, e.data_offset) for e in entries])
        doc = {
            "version": self.version, "framing": self.framing, "diff_id": self.diff_id,
            "tar_size": self.tar_size, "frames": [list(f) for f in self.frames],
            "entries": [e.to_json() for e in self.entries],
        }
        return _canonical(doc).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, lazy: bool = False) -> Toc:
        """Decode and validate. Raises ``TocFormatError`` (message without the layer name) or
        ``TocVersionError``; the reader turns them into layer errors. With ``lazy``, entries
        are validated and turned into ``Entry`` objects only when first accessed (a reader
        that stats one file out of 15,000 should not pay for all of them)."""
        _check_size(len(data))
        if data.find(b"\n") >= 0:  # only a v2 TOC has line breaks
            toc = cls._from_v2(data, lazy)
            if toc is not None:
                return toc
        _check_values(data.count(b","), "")
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise TocFormatError(f"TOC is not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise TocFormatError("TOC is not a JSON object")
        version = doc.get("version")
        if version not in READABLE_VERSIONS:
            raise TocVersionError(f"unsupported TOC version {version!r} (this reader knows "
                                  f"{', '.join(map(str, READABLE_VERSIONS))})")
        if version == 2:
            raise TocFormatError("TOC version 2 is not in its canonical line layout")
        try:
            frames = [(_int(c), _int(u)) for c, u in doc["frames"]]
            raw = doc["entries"]
            if not isinstance(raw, list) or not all(isinstance(d, dict) for d in raw):
                raise TypeError("entries must be a list of objects")
            _check_count(len(raw))
            entries = LazyEntries(raw) if lazy else [_entry(d) for d in raw]
            toc = cls(framing=_str(doc["framing"]), diff_id=_str(doc["diff_id"]),
                      tar_size=_int(doc["tar_size"]), frames=frames, entries=entries, version=1)
        except (KeyError, TypeError, ValueError) as e:
            raise TocFormatError(f"TOC does not match the v1 schema ({type(e).__name__}: {e})") \
                from None
        if sum(u for _, u in frames) != toc.tar_size:
            raise TocFormatError("TOC frames do not add up to tar_size")
        return toc

    @classmethod
    def _from_v2(cls, data: bytes, lazy: bool) -> Toc | None:
        """Decode the v2 line layout; None if the first and last lines are not a v2 header
        (the caller then parses the whole document to name its version)."""
        # at most MAX + 2 pieces: 64 MiB of line breaks must not become 64 million objects
        lines = data.split(b"\n", MAX_TOC_ENTRIES + 2)
        if len(lines) > MAX_TOC_ENTRIES + 2:
            raise TocFormatError(f"TOC lists more than {MAX_TOC_ENTRIES} members, the reader "
                                 "limit")
        if len(lines) < 2 or not lines[0].endswith(_V2_OPEN):
            return None
        head_bytes = lines[0] + lines[-1]
        head_values = head_bytes.count(b",")  # the paths and frames: most of the header
        _check_values(head_values, " in its header")
        try:
            head = json.loads(head_bytes)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if not isinstance(head, dict) or head.get("version") != 2:
            return None
        try:
            if set(head) != _V2_KEYS or head["entries"] != []:
                raise ValueError(f"TOC keys are {sorted(head)}")
            frames = _frames(head["frames"])
            paths = head["paths"]
            # map/set run in C: this is on the path of every layer open
            if type(paths) is not list or not set(map(type, paths)) <= {str}:
                raise TypeError("paths must be a list of strings")
            toc = cls(framing=_str(head["framing"]), diff_id=_str(head["diff_id"]),
                      tar_size=_int(head["tar_size"]), frames=frames, entries=[], version=2)
        except (KeyError, TypeError, ValueError) as e:
            raise TocFormatError(f"TOC does not match the v2 schema ({type(e).__name__}: {e})") \
                from None
        if len(lines) != len(paths) + 2:
            raise TocFormatError(f"TOC lists {len(paths)} paths but {len(lines) - 2} entry rows")
        index = _FrameIndex(frames, toc.tar_size)
        if index.uoffsets[-1] != toc.tar_size:
            raise TocFormatError("TOC frames do not add up to tar_size")
        entries = RowEntries(paths, lines, index, MAX_TOC_VALUES - head_values)
        toc.entries = entries if lazy else entries[:]
        return toc


_V2_KEYS = {"diff_id", "entries", "frames", "framing", "paths", "tar_size", "version"}


class TocFormatError(ValueError):
    pass


def check_writable(toc_json: bytes, members: int) -> None:
    """Raise ``TocFormatError`` if a reader would refuse ``toc_json`` (of ``members``
    entries) by the limits above: the writer's check, with the readers' own checks, so no
    layer is published that no reader can open."""
    _check_size(len(toc_json))
    _check_count(members)
    _check_values(toc_json.count(b","), "")


def _check_size(n: int) -> None:
    if n > MAX_TOC_USIZE:
        raise TocFormatError(f"TOC of {n} bytes exceeds the reader limit of "
                             f"{MAX_TOC_USIZE >> 20} MiB")


def _check_count(n: int) -> None:
    if n > MAX_TOC_ENTRIES:
        raise TocFormatError(f"TOC lists {n} members, over the reader limit of "
                             f"{MAX_TOC_ENTRIES}")


def _check_values(n: int, where: str, limit: int | None = None) -> None:
    limit = MAX_TOC_VALUES if limit is None else limit
    if n > limit:
        raise TocFormatError(f"TOC has more than {limit} JSON values{where}, the reader limit")


class LazyEntries(Sequence[Entry]):
    """The entries of a v1 TOC, decoded and validated one by one on first access."""

    def __init__(self, raw: list[dict[str, Any]]) -> None:
        self._raw = raw
        self._done: list[Entry | None] = [None] * len(raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, i: int | slice) -> Any:  # an Entry; a list of them for a slice
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

    def raw_path(self, i: int) -> str:
        path: Any = self._raw[i].get("path")  # unchecked: fails when the entry is decoded
        return path

    def path_index(self) -> dict[str, int]:
        """path -> entry index (a path listed twice makes it shorter than the TOC)."""
        index: dict[Any, int] = {self._raw[i].get("path"): i for i in range(len(self._raw))}
        return index  # keys unchecked, as in raw_path


class _FrameIndex:
    """Blob and tar offsets of every frame, to turn a v2 entry's data offset into chunks."""

    def __init__(self, frames: list[tuple[int, int]], tar_size: int) -> None:
        self.frames = frames
        self.tar_size = tar_size
        self.offsets = [0, *itertools.accumulate(c for c, _ in frames)]
        self.uoffsets = [0, *itertools.accumulate(u for _, u in frames)]

    def chunks(self, data: int, size: int) -> list[Chunk]:
        """The frames overlapping ``[data, data + size)`` of the tar."""
        end = data + size
        if end > self.tar_size:
            raise ValueError(f"data at {data} + {size} bytes ends past the tar")
        uoffs, offs, frames = self.uoffsets, self.offsets, self.frames
        i = bisect.bisect_right(uoffs, data) - 1
        out = [Chunk(offs[i], frames[i][0], uoffs[i], frames[i][1], data - uoffs[i])]
        i += 1
        while uoffs[i] < end:
            out.append(Chunk(offs[i], frames[i][0], uoffs[i], frames[i][1], 0))
            i += 1
        return out


class RowEntries(Sequence[Entry]):
    """The entries of a v2 TOC: one JSON row per line, decoded on first access; a full slice
    decodes all rows with one ``json.loads`` (what unpack and verify need)."""

    def __init__(self, paths: list[str], lines: list[bytes], index: _FrameIndex,
                 budget: int = MAX_TOC_VALUES) -> None:
        self._paths = paths
        self._lines = lines  # [first line, row 0, ..., row n-1, last line]
        self._index = index
        self._budget = budget  # JSON values the rows may hold (MAX_TOC_VALUES - the header's)
        self._done: list[Entry | None] = [None] * len(paths)

    def __len__(self) -> int:
        return len(self._paths)

    def raw_path(self, i: int) -> str:
        return self._paths[i]

    def path_index(self) -> dict[str, int]:
        return dict(zip(self._paths, range(len(self._paths))))

    def __getitem__(self, i: int | slice) -> Any:  # an Entry; a list of them for a slice
        if isinstance(i, slice):
            idx = range(*i.indices(len(self)))
            if len(idx) == len(self) and idx.step == 1 and len(self) > 1:
                self._decode_all()
                return list(self._done)
            return [self[j] for j in idx]
        e = self._done[i]
        if e is None:
            n = len(self._paths)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(i)
            line = self._lines[i + 1]
            if i < n - 1:
                if not line.endswith(b","):
                    raise TocFormatError(f"TOC entry {i} is not followed by a comma")
                line = line[:-1]
            _check_values(line.count(b","), f" in entry {i}", self._budget)
            try:
                row = json.loads(line)
            except (ValueError, UnicodeDecodeError, RecursionError) as err:
                raise TocFormatError(f"TOC entry {i} is not valid JSON ({err})") from None
            e = self._done[i] = self._decode(i, row)
        return e

    def _decode(self, i: int, row) -> Entry:
        try:
            return _entry_v2(self._paths[i], row, self._index)
        except (KeyError, TypeError, ValueError) as err:
            raise TocFormatError(f"TOC entry {i} does not match the v2 schema "
                                 f"({type(err).__name__}: {err})") from None

    def columns(self) -> list[tuple]:
        """Every row's 12 fields as 12 columns (``type``, ``mode``, ... ``data``, each a tuple
        in entry order), validated as ``_entry_v2`` validates a row but with C-level checks
        per column instead of an ``Entry`` per member (the lazy filler's tree, built for every
        layer of a stack at create). Xattr values stay base64 strings (the caller decodes the
        few non-empty ones) and data offsets are not checked against ``tar_size`` (the caller
        turns them into frames). ``TocFormatError`` names the first bad entry."""
        rows = self._rows()
        n = len(rows)
        if not n:
            return [()] * 12
        if set(map(type, rows)) == {list} and set(map(len, rows)) == {12}:
            cols = list(zip(*rows))
            t, mode, uid, gid, size, mtime, link, xattrs, dmaj, dmin, digest, data = cols
            ints = (mode, uid, gid, size, mtime, dmaj, dmin)
            files = [s for k, s in zip(t, size) if k == "file"]
            if (set(t) <= _TYPE_SET
                    and all(set(map(type, c)) == {int} and min(c) >= 0 for c in ints)
                    and set(map(type, link)) == {str} and set(map(type, xattrs)) == {dict}
                    and set(map(type, digest)) <= {str, type(None)}
                    and set(map(type, data)) <= {int, type(None)}
                    and min((d for d in data if d is not None), default=0) >= 0
                    # a data offset exactly for the files with content
                    and sum(d is not None for d in data) == sum(1 for s in files if s)
                    and all(d is not None for k, s, d in zip(t, size, data)
                            if s and k == "file")):
                return cols
        self._decode_all()  # names the first bad entry
        raise TocFormatError("TOC entry rows do not match the v2 schema")

    def _rows(self) -> list:
        """Every entry row, parsed in one ``json.loads`` (bounded by the value budget), one
        per path."""
        joined = b"".join(self._lines[1:-1])
        _check_values(joined.count(b","), " in its entry rows", self._budget)
        try:
            rows = json.loads(b"[" + joined + b"]")
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise TocFormatError(f"TOC entry rows are not valid JSON ({err})") from None
        if len(rows) != len(self._paths):
            raise TocFormatError(f"TOC lists {len(self._paths)} paths but {len(rows)} entry rows")
        return rows

    def _decode_all(self) -> None:
        done = self._done
        if all(e is not None for e in done):
            return
        rows = self._rows()
        for i, row in enumerate(rows):
            if done[i] is None:  # keep entries already handed out (callers may hold them)
                done[i] = self._decode(i, row)


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


def _frames(raw) -> list[tuple[int, int]]:
    """``[[csize, usize], ...]`` validated without a Python loop per frame."""
    if type(raw) is not list or not set(map(type, raw)) <= {list} or not set(map(len, raw)) <= {2}:
        raise TypeError("frames must be a list of [csize, usize] pairs")
    flat = list(itertools.chain.from_iterable(raw))
    if not set(map(type, flat)) <= {int} or (flat and min(flat) < 0):
        raise ValueError("frame sizes must be non-negative integers")
    return list(map(tuple, raw))


def _xattrs(d) -> dict[str, bytes]:
    if type(d) is not dict:
        raise TypeError("xattrs must be an object")
    return {_str(k): base64.b64decode(_str(v), validate=True) for k, v in d.items()}


def _entry(d: dict) -> Entry:
    t = d["type"]
    if t not in TYPES:
        raise ValueError(f"unknown entry type {t!r}")
    digest = d["digest"]
    if digest is not None:
        _str(digest)
    xattrs = _xattrs(d["xattrs"])
    chunks = [Chunk(_int(c["offset"]), _int(c["csize"]), _int(c["uoffset"]), _int(c["usize"]),
                    _int(c["inner"])) for c in d["chunks"]]
    return Entry(path=_str(d["path"]), type=t, mode=_int(d["mode"]), uid=_int(d["uid"]),
                 gid=_int(d["gid"]), size=_int(d["size"]), mtime=_int(d["mtime"]),
                 linkname=_str(d["linkname"]), xattrs=xattrs, devmajor=_int(d["devmajor"]),
                 devminor=_int(d["devminor"]), digest=digest, chunks=chunks)


def _entry_v2(path: str, row, index: _FrameIndex) -> Entry:
    # unpack and verify decode every row: checks are spelled out rather than looped
    if type(row) is not list or len(row) != 12:
        raise ValueError("an entry row is an array of 12 values")
    t, mode, uid, gid, size, mtime, linkname, xattrs, dmaj, dmin, digest, data = row
    if t not in TYPES:
        raise ValueError(f"unknown entry type {t!r}")
    if not (type(mode) is int and type(uid) is int and type(gid) is int and type(size) is int
            and type(mtime) is int and type(dmaj) is int and type(dmin) is int
            and min(mode, uid, gid, size, mtime, dmaj, dmin) >= 0):
        raise ValueError(f"expected non-negative integers, got {row[1:6] + row[8:10]!r}")
    if type(linkname) is not str:
        raise ValueError(f"expected a string, got {linkname!r}")
    if digest is not None and type(digest) is not str:
        raise ValueError(f"expected a string or null digest, got {digest!r}")
    if data is None:
        if t == "file" and size:
            raise ValueError(f"file entry of size {size} has no data offset")
        chunks = []
    elif t == "file" and size:
        chunks = index.chunks(_int(data), size)
    else:
        raise ValueError(f"{t} entry of size {size} has a data offset")
    return Entry(path, t, mode, uid, gid, size, mtime, linkname,
                 {} if xattrs == {} else _xattrs(xattrs), dmaj, dmin, digest, chunks)


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

    def to_json(self) -> dict:
        """The fields as a JSON object (``envbuild layer pack/verify --json``)."""
        return dataclasses.asdict(self)
