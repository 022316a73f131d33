"""Parsed definitions by file content digest, so a big tree is re-parsed only where it changed.

Parsing (YAML, limits, schema, model) is ~90 % of loading a tree of 100,000 definitions, and
``envbuild plan --changed-since REV`` loads two trees that differ in a few files. A
``ParseCache`` maps ``sha256(file bytes)`` to the definitions that file yields; the loader
(``collect_definitions(root, parse_cache=...)``) hashes each file, takes a hit as it is (its
``Origin.file`` pointed at where the file is now: the checkout of REV is a temporary
directory), and parses only misses. Only files that parsed without a single problem are
cached, so every problem is still found and reported by a real parse.

It also maps git blob ids to content digests (``blob(oid)``/``note_blob``): a blob id is the
sha1 of the content with a ``blob <size>\\0`` header, so the mapping is exact, and ``plan
--changed-since REV`` reads from git only the blobs of REV it has never seen
(``envbuild.build.gitrev``); the loader notes the blob id of every working-tree file it hashes.
The same map holds ``pin:<git mode>:<object id>:<umask>`` -> the digest pinning gave that
object checked out (a revision's source tree), so an unchanged source of REV is not checked
out again. ``original(d)`` tells which cached definition a placed copy came from, so the keys
of REV reuse the working tree's for definitions that did not change (``compute_keys``).

It also remembers, per working-tree file, the ``os.stat`` it had when it was hashed (size,
mtime, ctime, inode, device), as git's index does: a file whose stat is the same as recorded is
not read again (``file_digest``/``note_file``). Only a stat taken ``RACY_NS`` after the file's
last change is ever recorded, so a file changed within the same timestamp tick as it was hashed
is always read (git's "racily clean" rule); a change that keeps size, mtime, ctime and inode is
not something a program can do without changing the clock. And it remembers layer keys and env
lock digests by what they are computed from (``key``/``note_key``: the definition's content,
its pins, its upstream keys/abi; ``envbuild.plan.keys.compute_keys(memo=...)``), so an
unchanged tree is keyed by lookups, not canonical JSON.

On disk (version 3): one file ``<dir>/defs-v3.cache``: a header line ``envbuild parse cache``,
the version, the ``code_fingerprint()`` and the sha256 of the payload, each on a line, then the
payload, a pickle of ``{"entries": {digest: [Definition, ...]}, "blobs": {oid: digest},
"files": {path: (size, mtime_ns, ctime_ns, ino, dev, digest, oid)}, "keys": {what: key}}``.
A file whose header, version, code or checksum does not match (another envbuild sharing the
node dir, a truncated or corrupt write) is not used (``rejected`` says why): the next save
replaces it. ``save`` replaces it atomically and keeps only what this process used (hit or
added): the cache is about the size of the trees last loaded. Definitions are stored with their
field positions packed (``_Positions``, unpacked on first use: only problems read them). It is
trusted host state like the rest of the node cache (a pickle runs code when loaded): it lives
in the node dir (``0700``), never in a checkout or a store. One that cannot be written is
skipped.
"""

from __future__ import annotations

import array
import contextlib
import copyreg
import dataclasses
import hashlib
import io
import os
import pickle
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from envbuild.atomic import atomic_file
from envbuild.defs.model import Definition, Origin

VERSION = 3
MAGIC = b"envbuild parse cache\n"
#: A file's stat is recorded only when its mtime and ctime are this much older than the moment
#: the run started: a later change then always moves them (timestamps tick at least this often).
RACY_NS = 2_000_000_000


def git_blob_id(data: bytes) -> str:
    """The git (sha1) blob id of ``data``: what ``git hash-object`` prints."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def code_fingerprint() -> str:
    """sha256 over the code that turns bytes into definitions (this package's modules and
    schemas) and definitions into keys (``envbuild.plan.keys``, ``envbuild.canonical``) and
    over what parsing reads from the environment — the platform an image base
    resolves to (``host_platform``: ``--platform``/``$ENVBUILD_PLATFORM``) is filled in when a
    definition is parsed: a cache written by other code (another envbuild version, another
    checkout sharing the node dir) or for another platform is not used."""
    from envbuild.defs.model import host_platform

    h = hashlib.sha256()
    here = Path(__file__).parent
    # and the code that turns definitions into keys: remembered keys (``note_key``)
    keys = [here.parent / "plan" / "keys.py", here.parent / "canonical.py"]
    for path in sorted([*here.glob("*.py"), *here.glob("schema/*")]) + keys:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(b"platform\0" + host_platform().encode())
    return h.hexdigest()


def _proxy(d: dict[Any, Any]) -> MappingProxyType[Any, Any]:
    return MappingProxyType(d)


_EMPTY: MappingProxyType[Any, Any] = MappingProxyType({})


def _empty_proxy() -> MappingProxyType[Any, Any]:
    return _EMPTY


def _reduce_proxy(m: MappingProxyType[Any, Any]) -> tuple[Any, ...]:
    return (_proxy, (dict(m),)) if m else (_empty_proxy, ())


class _Positions(Mapping[str, tuple[int, int]]):
    """``Origin.field_positions`` as stored: the paths (one tuple shared by every definition of
    the same shape) and the (line, column) pairs packed in an array, unpacked on first use."""

    __slots__ = ("_paths", "_packed", "_map")

    def __init__(self, paths: tuple[str, ...], packed: bytes) -> None:
        self._paths, self._packed = paths, packed
        self._map: dict[str, tuple[int, int]] | None = None

    def _get(self) -> dict[str, tuple[int, int]]:
        if self._map is None:
            v = array.array("I")
            v.frombytes(self._packed)
            self._map = {p: (v[2 * i], v[2 * i + 1]) for i, p in enumerate(self._paths)}
        return self._map

    def __getitem__(self, path: str) -> tuple[int, int]:
        return self._get()[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._paths)

    def __reduce__(self) -> tuple[Any, ...]:
        return _Positions, (self._paths, self._packed)


class _Pickler(pickle.Pickler):
    """Writes the model compactly: the read-only mappings, origins with packed positions whose
    path tuples are shared (the pickle memo then writes each shape once)."""

    def __init__(self, f: io.BufferedIOBase) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self._shapes: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._positions: dict[tuple[tuple[str, ...], bytes], _Positions] = {}
        self._values: dict[tuple[type, str], Any] = {}
        self.dispatch_table = {**copyreg.dispatch_table, MappingProxyType: _reduce_proxy,
                               Origin: self._reduce_origin}

    def _reduce_origin(self, o: Origin) -> tuple[Any, ...]:
        fp = o.field_positions
        if isinstance(fp, _Positions):
            paths, packed = fp._paths, fp._packed
        else:
            paths = tuple(fp)
            values = [x for p in paths for x in fp[p]]
            if any(not 0 <= x < 1 << 32 for x in values):
                return Origin, (o.file, o.line, o.column, _proxy(dict(fp)))
            packed = array.array("I", values).tobytes()
        paths = self._shapes.setdefault(paths, paths)
        shared = self._positions.setdefault((paths, packed), _Positions(paths, packed))
        return Origin, (o.file, o.line, o.column, shared)

    def shared(self, d: Definition) -> Definition:
        """``d`` with each part equal to one already written (a step, a source, a config, a
        check: the same in thousands of definitions) replaced by that one, so the pickle memo
        writes it once and loading builds it once. Parts are immutable; equal = same type and
        repr (every field of the model's parts is in its repr)."""
        changes = {}
        for f in dataclasses.fields(d):
            if f.name in ("name", "origin"):
                continue
            v = getattr(d, f.name)
            if isinstance(v, (tuple, MappingProxyType)) or dataclasses.is_dataclass(v):
                one = self._values.setdefault((type(v), repr(v)), v)
                if one is not v:
                    changes[f.name] = one
        return dataclasses.replace(d, **changes) if changes else d


#: What ``note_file`` records of a file: (size, mtime_ns, ctime_ns, ino, dev).
def _stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


class ParseCache:
    #: New entries + blob ids + keys a ``save`` may leave unwritten (see there).
    SMALL_CHANGE = 256

    def __init__(self, directory: Path | str) -> None:
        self.path = Path(directory) / f"defs-v{VERSION}.cache"
        self._entries: dict[str, tuple[Definition, ...]] | None = None
        self._used: dict[str, tuple[Definition, ...]] = {}
        self._blobs: dict[str, str] = {}
        self._used_blobs: dict[str, str] = {}
        self._files: dict[str, tuple[Any, ...]] = {}
        self._used_files: dict[str, tuple[Any, ...]] = {}
        self._keys: dict[str, str] = {}
        self._used_keys: dict[str, str] = {}
        self._placed: dict[int, tuple[Definition, Definition]] = {}
        #: every working-tree file loaded with this cache -> its git blob id (this run)
        self.tree_files: dict[str, str] = {}
        self._ident: dict[int, tuple[Definition, str]] = {}
        self.code = code_fingerprint()
        self.started_ns = time.time_ns()
        self._new_pins = False
        self.rejected: str | None = None  # why the file on disk was not used, if it was not
        self.hits = 0
        self.misses = 0

    # ------------------------------------------------------------------ the file

    def _load(self) -> dict[str, tuple[Definition, ...]]:
        if self._entries is None:
            self._entries = {}
            try:
                with open(self.path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                return self._entries
            except OSError as e:
                self.rejected = f"unreadable: {e.strerror}"
                return self._entries
            payload = self._check(data)
            if payload is None:
                return self._entries
            try:
                got = pickle.loads(payload)  # noqa: S301 - our own node-dir file, see docstring
                entries, blobs, files, keys = (got["entries"], got["blobs"], got["files"],
                                               got["keys"])
                if not all(isinstance(x, dict) for x in (entries, blobs, files, keys)):
                    raise TypeError("not a table")
            except Exception as e:  # noqa: BLE001 - a checksummed payload that still fails
                self.rejected = f"unreadable payload: {type(e).__name__}"
                return self._entries
            self._entries, self._blobs, self._files, self._keys = entries, blobs, files, keys
        return self._entries

    def _check(self, data: bytes) -> memoryview | None:
        """The payload of a cache file, if its header says this code wrote it and the payload
        has the checksum the header names; else None (and ``rejected`` says why)."""
        view = memoryview(data)
        lines: list[bytes] = []
        at = 0
        for _ in range(4):
            end = data.find(b"\n", at, at + 200)
            if end < 0:
                self.rejected = "truncated header"
                return None
            lines.append(data[at:end])
            at = end + 1
        magic, version, code, digest = lines
        if magic + b"\n" != MAGIC:
            self.rejected = "not a parse cache"
        elif version != str(VERSION).encode():
            self.rejected = f"version {version[:20].decode(errors='replace')}"
        elif code != self.code.encode():
            self.rejected = "written by other code"
        elif hashlib.sha256(view[at:]).hexdigest().encode() != digest:
            self.rejected = "checksum mismatch (truncated or corrupt)"
        else:
            return view[at:]
        return None

    # ------------------------------------------------------------------ files of a tree

    def file_digest(self, path: str, st: os.stat_result) -> tuple[str, str] | None:
        """(content digest, git blob id) of the file at ``path`` if it was hashed before with
        exactly this stat (see the module docstring); None: read and hash it."""
        found = self._used_files.get(path)
        if found is None:
            self._load()
            found = self._files.get(path)
        if found is None or found[:5] != _stat_key(st):
            return None
        self._used_files[path] = found
        self.tree_files[path] = found[6]
        return found[5], found[6]

    def known_file(self, path: str, st: os.stat_result) -> list[Definition] | None:
        """``get`` of ``file_digest``, in one call (the loader's common case); None: read it."""
        entries = self._load()
        found = self._files.get(path) or self._used_files.get(path)
        if (found is None or found[0] != st.st_size or found[1] != st.st_mtime_ns
                or found[2] != st.st_ctime_ns or found[3] != st.st_ino or found[4] != st.st_dev):
            return None
        digest, oid = found[5], found[6]
        defs = self._used.get(digest)
        if defs is None:
            defs = entries.get(digest)
            if defs is None:
                return None
            self._used[digest] = defs
            self._identify(digest, defs)
        self.hits += 1
        self._used_files[path] = found
        self.tree_files[path] = oid
        self._used_blobs[oid] = digest
        return [d if d.origin.file == path else self.place(d, path) for d in defs]

    def note_file(self, path: str, st: os.stat_result, digest: str, oid: str) -> None:
        """Record that the file at ``path`` with stat ``st`` has these bytes (digest, blob id);
        kept only when its last change is ``RACY_NS`` older than this run's start."""
        self._used_blobs[oid] = digest
        self.tree_files[path] = oid
        limit = self.started_ns - RACY_NS
        if st.st_mtime_ns < limit and st.st_ctime_ns < limit:
            self._used_files[path] = (*_stat_key(st), digest, oid)

    # ------------------------------------------------------------------ blobs and pins

    def blob(self, oid: str) -> str | None:
        """The content digest of git blob ``oid`` if a file with its bytes was ever hashed."""
        found = self._used_blobs.get(oid)
        if found is None:
            self._load()
            found = self._blobs.get(oid)
            if found is not None:
                self._used_blobs[oid] = found
        return found

    def note_blob(self, oid: str, digest: str) -> None:
        self._used_blobs[oid] = digest

    def pin(self, key: str) -> str | None:
        """A pinned digest recorded under ``key`` (``"pin:<mode>:<oid>:<umask>"``: a source
        tree of a git revision, ``envbuild.build.gitrev``), if known."""
        return self.blob(key)

    def note_pin(self, key: str, digest: str) -> None:
        if self._blobs.get(key) != digest:
            self._new_pins = True
        self._used_blobs[key] = digest

    # ------------------------------------------------------------------ definitions

    def get(self, digest: str, file: str) -> list[Definition] | None:
        """The definitions of a file with these bytes, placed at ``file``; None on a miss."""
        found = self._used.get(digest) or self._load().get(digest)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        if digest not in self._used:
            self._used[digest] = found
            self._identify(digest, found)
        return [d if d.origin.file == file else self.place(d, file) for d in found]

    def place(self, d: Definition, file: str) -> Definition:
        """A copy of ``d`` (a cached definition, or a copy of one) with its origin at ``file``,
        whose ``original`` is ``d``'s."""
        d = self.original(d)
        placed = dataclasses.replace(d, origin=dataclasses.replace(d.origin, file=file))
        self._placed[id(placed)] = (placed, d)  # holding it keeps its id unique
        return placed

    def original(self, d: Definition) -> Definition:
        """The cached definition ``d`` is a copy of (placed at another file), else ``d``: two
        definitions with the same original have the same content (origins aside), which is
        what ``compute_keys(previous=...)`` needs to reuse a key."""
        entry = self._placed.get(id(d))
        return entry[1] if entry is not None and entry[0] is d else d

    def put(self, digest: str, definitions: list[Definition]) -> None:
        self._used[digest] = found = tuple(definitions)
        self._identify(digest, found)

    def _identify(self, digest: str, found: tuple[Definition, ...]) -> None:
        for i, d in enumerate(found):
            self._ident[id(d)] = (d, f"{digest}:{i}")

    # ------------------------------------------------------------------ keys

    def ident(self, d: Definition) -> str | None:
        """A name for ``d``'s content (its file's digest and its place in the file) if it is a
        cached definition or a copy of one placed elsewhere; None otherwise (a definition
        changed after parsing, e.g. a Dockerfile base given its FROM envs: keyed as usual)."""
        d = self.original(d)
        entry = self._ident.get(id(d))
        return entry[1] if entry is not None and entry[0] is d else None

    def key(self, what: str) -> str | None:
        """The key or digest recorded for ``what`` (``compute_keys``' description of every
        input of one key), if any."""
        if self._entries is None:
            self._load()
        found = self._keys.get(what)
        if found is not None:
            self._used_keys[what] = found
            return found
        return self._used_keys.get(what)

    def note_key(self, what: str, key: str) -> None:
        self._used_keys[what] = key

    # ------------------------------------------------------------------ saving

    def save(self, force: bool = False) -> None:
        """Write what this process used (atomically); skipped when the directory cannot be
        written, and (unless ``force``) when nothing changed or all that is new is at most
        ``SMALL_CHANGE`` entries, blob ids, file stats and keys (no new pin): re-parsing and
        re-keying a few files next time costs milliseconds, rewriting 100,000 entries seconds.
        Entries no longer used are dropped only by a write."""
        if not force and self._entries is not None:
            tables = ((self._used, self._entries), (self._used_blobs, self._blobs),
                      (self._used_files, self._files), (self._used_keys, self._keys))
            new = sum(len(used.keys() - old.keys()) for used, old in tables)
            changed = any(used.keys() != old.keys() for used, old in tables)
            pins = self._new_pins
            if not pins and (not changed or (self._entries and new <= self.SMALL_CHANGE)):
                return
        buf = io.BytesIO()
        pickler = _Pickler(buf)
        entries = {k: tuple(pickler.shared(d) for d in v) for k, v in self._used.items()}
        pickler.dump({"entries": entries, "blobs": self._used_blobs,
                      "files": self._used_files, "keys": self._used_keys})
        payload = buf.getbuffer()
        header = b"%s%d\n%s\n%s\n" % (MAGIC, VERSION, self.code.encode(),
                                         hashlib.sha256(payload).hexdigest().encode())
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with atomic_file(self.path, mode=0o600) as f:
                f.write(header)
                f.write(payload)
            with contextlib.suppress(OSError):  # the format before this one, 60+ MB
                os.unlink(self.path.parent / "defs-v2.pickle")
        except OSError:
            return
        self._entries, self._blobs = dict(self._used), dict(self._used_blobs)
        self._files, self._keys = dict(self._used_files), dict(self._used_keys)
        self._new_pins = False
