"""PAX/ustar header encoding and a small streaming header decoder.

Only what layer format v1 uses (see docs/layer-format.md, "Tar stream"): ustar headers, PAX
``x`` extended headers with the records ``path``, ``linkpath``, ``size``, ``uid``, ``gid``,
``mtime`` and ``SCHILY.xattr.*``. GNU long-name records, global PAX headers and base-256 numbers
are refused when reading: v1 writers never produce them.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

from envbuild.layers._toc import Entry

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
END_OF_ARCHIVE = bytes(2 * BLOCK)
PAX_NAME = b"././@PaxHeader"
MAX_PAX_HEADER = 1 << 20  # writers refuse, readers reject larger extended headers

# ustar octal field limits (digits fit the field with a trailing NUL)
_MAX_7 = 0o7777777
_MAX_11 = 0o77777777777

TYPEFLAG = {
    "file": b"0",
    "hardlink": b"1",
    "symlink": b"2",
    "char": b"3",
    "block": b"4",
    "dir": b"5",
    "fifo": b"6",
}
TYPE_OF_FLAG = {v: k for k, v in TYPEFLAG.items()}
TYPE_OF_FLAG[b"\0"] = "file"

_HDR = struct.Struct("100s8s8s8s12s12s8s1s100s6s2s32s32s8s8s155s12x")


_USTAR_TAIL = b"ustar\x0000" + bytes(64)  # magic, version, empty uname and gname
_NO_DEVICE = _USTAR_TAIL + b"0000000\x000000000\x00" + bytes(167)  # + devmajor/minor, prefix


def _ustar(name: bytes, mode: int, uid: int, gid: int, size: int, mtime: int, flag: bytes,
           linkname: bytes, devmajor: int, devminor: int) -> bytes:
    """One ustar header block. Built with two %-formats around the checksum rather than
    ``_HDR.pack`` (4x faster; once per member). Callers keep every value within its field."""
    head = b"%s%07o\0%07o\0%07o\0%011o\0%011o\0" % (name.ljust(100, b"\0"), mode, uid, gid,
                                                     size, mtime)
    rest = b"%s%s%s" % (flag, linkname.ljust(100, b"\0"), _NO_DEVICE if not (
        devmajor or devminor) else _USTAR_TAIL + b"%07o\0%07o\0" % (devmajor, devminor)
        + bytes(167))
    if len(head) != 148 or len(rest) != 356:
        raise ValueError(f"tar header field overflow (name {name[:40]!r}..., mode {mode:o}, "
                         f"devices {devmajor},{devminor})")
    # the checksum field counts as 8 spaces (256)
    return b"%s%06o\0 %s" % (head, _checksum(rest, zlib.adler32(head)) + 256, rest)


def _checksum(data: bytes, start: int = 1) -> int:
    """The ustar checksum ``sum`` of the header bytes, computed as Adler-32's low half minus
    one (5x faster than ``sum`` over 512 bytes). Exact because the sum of a header we build
    stays below the Adler modulus 65521: at most 2 x 100 name bytes x 255, octal digits in the
    numeric fields, 8 spaces, magic, version and typeflag (< 56,000)."""
    return (zlib.adler32(data, start) & 0xFFFF) - 1


def pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    n = len(body) + 1
    while len(b"%d" % n) + len(body) != n:
        n = len(b"%d" % n) + len(body)
    return b"%d" % n + body


def _pad(n: int) -> int:
    return -n % BLOCK


def encode_header(e: Entry) -> bytes:
    """The header block(s) of one member: an optional PAX ``x`` member, then the ustar header.

    Deterministic: records sorted by keyword bytes, PAX only for values ustar cannot hold
    (non-ASCII or > 100-byte names, big numbers, xattrs). Directory names end in ``/``.
    """
    name = e.path.encode("utf-8") + (b"/" if e.type == "dir" else b"")
    link = e.linkname.encode("utf-8")
    size = e.size if e.type == "file" else 0
    pax: dict[bytes, bytes] = {}
    if len(name) > 100 or not name.isascii():
        pax[b"path"] = name
        name = name[:100]
    if len(link) > 100 or not link.isascii():
        pax[b"linkpath"] = link
        link = link[:100]
    uid, gid, mtime = e.uid, e.gid, e.mtime
    if size > _MAX_11:
        pax[b"size"] = b"%d" % size
        size = 0
    if uid > _MAX_7:
        pax[b"uid"] = b"%d" % uid
        uid = 0
    if gid > _MAX_7:
        pax[b"gid"] = b"%d" % gid
        gid = 0
    if mtime > _MAX_11:
        pax[b"mtime"] = b"%d" % mtime
        mtime = 0
    for k, v in e.xattrs.items():
        pax[b"SCHILY.xattr." + k.encode("utf-8")] = v
    hdr = _ustar(name, e.mode, uid, gid, size, mtime, TYPEFLAG[e.type], link,
                 e.devmajor, e.devminor)
    if not pax:
        return hdr
    records = b"".join(pax_record(k, pax[k]) for k in sorted(pax))
    if len(records) > MAX_PAX_HEADER:
        raise ValueError(f"extended header of {e.path!r} is larger than {MAX_PAX_HEADER} bytes")
    xhdr = _ustar(PAX_NAME, 0o644, 0, 0, len(records), 0, b"x", b"", 0, 0)
    return xhdr + records + bytes(_pad(len(records))) + hdr


class TarFormatError(ValueError):
    """The bytes are not a v1 tar member header; the caller adds the layer name."""


def _octal(field: bytes, what: str) -> int:
    s = field.rstrip(b"\0 ").lstrip(b" ")
    if not s:
        return 0
    if field[0] & 0x80:
        raise TarFormatError(f"base-256 {what} field is not allowed")
    try:
        return int(s, 8)
    except ValueError:
        raise TarFormatError(f"bad octal {what} field {field!r}") from None


def _cstr(field: bytes) -> bytes:
    i = field.find(b"\0")
    return field if i < 0 else field[:i]


def is_zero_block(hdr: bytes | memoryview) -> bool:
    return hdr == ZERO_BLOCK


def parse_ustar(hdr: bytes) -> tuple[bytes, dict]:
    """Decode one 512-byte header: (typeflag, fields). Verifies the checksum and magic."""
    f = _HDR.unpack(hdr)
    stored = _octal(f[6], "checksum")
    if stored != sum(hdr[:148]) + 256 + sum(hdr[156:]):
        raise TarFormatError("header checksum mismatch")
    if f[9] != b"ustar\0":
        raise TarFormatError(f"not a POSIX ustar header (magic {f[9]!r})")
    name = _cstr(f[0])
    prefix = _cstr(f[15])
    if prefix:
        name = prefix + b"/" + name
    return f[7], _fields(f, name, _octal)


def _fields(f: tuple, name: bytes, number: Callable[[bytes, str], int]) -> dict:
    """The fields of an unpacked header ``f`` (its name already joined with the prefix), its
    numbers read by ``number`` (octal only, or GNU base-256 too)."""
    return {
        "name": name,
        "mode": number(f[1], "mode"),
        "uid": number(f[2], "uid"),
        "gid": number(f[3], "gid"),
        "size": number(f[4], "size"),
        "mtime": number(f[5], "mtime"),
        "linkname": _cstr(f[8]),
        "devmajor": number(f[13], "devmajor"),
        "devminor": number(f[14], "devminor"),
    }


def parse_pax(data: bytes) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        if sp < 0:
            raise TarFormatError("malformed PAX record")
        try:
            n = int(data[pos:sp])
        except ValueError:
            raise TarFormatError("malformed PAX record length") from None
        rec = data[sp + 1:pos + n]
        if n <= 0 or pos + n > len(data) or not rec.endswith(b"\n") or b"=" not in rec:
            raise TarFormatError("malformed PAX record")
        k, _, v = rec[:-1].partition(b"=")
        out[k] = v
        pos += n
    return out


def make_entry(flag: bytes, f: dict, pax: dict[bytes, bytes] | None) -> Entry:
    """Combine a ustar header and its PAX records into an ``Entry`` (no digest/chunks yet)."""
    xattrs: dict[str, bytes] = {}
    if pax:
        for k, v in pax.items():
            if k == b"path":
                f["name"] = v
            elif k == b"linkpath":
                f["linkname"] = v
            elif k in (b"size", b"uid", b"gid", b"mtime"):
                try:
                    f[k.decode()] = int(v.split(b".")[0])
                except ValueError:
                    raise TarFormatError(f"bad PAX {k.decode()} record") from None
            elif k.startswith(b"SCHILY.xattr."):
                xattrs[k[13:].decode("utf-8", "surrogateescape")] = v
            elif k in (b"atime", b"ctime", b"comment", b"hdrcharset"):
                pass  # tolerated from foreign writers; not part of the layer's contents
            else:
                raise TarFormatError(f"unsupported PAX record {k.decode(errors='replace')!r}")
    kind = TYPE_OF_FLAG.get(flag)
    if kind is None:
        raise TarFormatError(f"unsupported tar member type {flag!r}")
    try:
        path = f["name"].decode("utf-8")
        linkname = f["linkname"].decode("utf-8")
    except UnicodeDecodeError:
        raise TarFormatError("member name is not UTF-8") from None
    if kind == "dir":
        path = path.rstrip("/") or path
    size = f["size"]
    if kind != "file" and size:
        if kind in ("hardlink", "symlink", "dir"):
            raise TarFormatError(f"{kind} member {path!r} has data")
    return Entry(path=path, type=kind, mode=f["mode"] & 0o7777, uid=f["uid"], gid=f["gid"],
                 size=size if kind == "file" else 0, mtime=f["mtime"], linkname=linkname,
                 xattrs=dict(sorted(xattrs.items())), devmajor=f["devmajor"],
                 devminor=f["devminor"])


def padded(n: int) -> int:
    return n + _pad(n)


# ----------------------------------------------------------------------------- foreign tars
# Tarballs envbuild did not write (rootfs tarballs, OCI layers, git archives): GNU and POSIX
# formats as GNU tar, Go's archive/tar and bsdtar write them. Only the header decoding is
# lenient; what may be written where is decided by the one safe unpacker (_unpack.py).

GNU_LONG_NAME, GNU_LONG_LINK = b"L", b"K"
FOREIGN_FILE_FLAGS = (b"0", b"\0", b"7")  # 7: contiguous file, a regular file everywhere else
FOREIGN_SKIP_FLAGS = (b"V",)  # a volume label: no member
MAX_GNU_LONG = 1 << 16


def _number(field: bytes, what: str) -> int:
    """An octal or base-256 (GNU, first byte 0x80/0xff) numeric field."""
    if field and field[0] & 0x80:
        n = int.from_bytes(field, "big", signed=False) & ~(0xFF << (8 * (len(field) - 1)))
        if field[0] == 0xFF:
            n -= 1 << (8 * len(field) - 1)  # negative (a pre-1970 mtime)
        return n
    s = field.rstrip(b"\0 ").lstrip(b" ")
    if not s:
        return 0
    try:
        return int(s, 8)
    except ValueError:
        raise TarFormatError(f"bad octal {what} field {field!r}") from None


def parse_foreign_header(hdr: bytes) -> tuple[bytes, dict]:
    """Decode one 512-byte header of a POSIX, ustar or GNU tar: (typeflag, fields)."""
    f = _HDR.unpack(hdr)
    stored = _number(f[6], "checksum")
    unsigned = sum(hdr[:148]) + 256 + sum(hdr[156:])
    signed = unsigned - 2 * (sum(b for b in hdr[:148] if b > 127) + sum(b for b in hdr[156:]
                                                                        if b > 127))
    if stored not in (unsigned, signed):
        raise TarFormatError("header checksum mismatch")
    magic = f[9] + f[10]
    name = _cstr(f[0])
    if f[9] == b"ustar\0":
        prefix = _cstr(f[15])
        if prefix:
            name = prefix + b"/" + name
    elif magic != b"ustar  \0":
        raise TarFormatError(f"not a ustar or GNU tar header (magic {magic!r})")
    return f[7], _fields(f, name, _number)


def foreign_pax(records: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """The PAX records of a foreign member that matter to its contents; the rest (times,
    owner names, charset, ACLs, libarchive's duplicate xattrs, ...) are dropped. Sparse
    files (``GNU.sparse.*``) are refused: their data is not the file's bytes."""
    out = {}
    for k, v in records.items():
        if k in (b"path", b"linkpath", b"size", b"uid", b"gid", b"mtime") \
                or k.startswith(b"SCHILY.xattr."):
            out[k] = v
        elif k.startswith(b"GNU.sparse."):
            raise TarFormatError("GNU sparse members are not supported")
    return out


def make_foreign_entry(flag: bytes, f: dict, pax: dict[bytes, bytes] | None
                       ) -> tuple[Entry, int]:
    """``make_entry`` for a foreign header, and how many data bytes follow it in the tar:
    contiguous files are files; a non-file's size (some writers record a hardlink's target
    size) is data to skip, not part of the entry."""
    if flag == b"7":
        flag = b"0"
    kind = TYPE_OF_FLAG.get(flag)
    if kind is None:
        raise TarFormatError(f"unsupported tar member type {flag!r}")
    size = f["size"]
    if pax and b"size" in pax:
        try:
            size = int(pax[b"size"])
        except ValueError:
            raise TarFormatError("bad PAX size record") from None
    if kind != "file":
        f = {**f, "size": 0}
        if pax:
            pax = {k: v for k, v in pax.items() if k != b"size"}
    if size < 0:
        raise TarFormatError("negative member size")
    return make_entry(flag, f, pax), size
