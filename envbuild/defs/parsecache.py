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

On disk (version 2): one pickle ``<dir>/defs-v2.pickle`` holding ``{"version": 2, "code":
<code_fingerprint()>, "entries": {digest: [Definition, ...]}, "blobs": {oid: digest}}`` (a
cache of other code, e.g. another envbuild sharing the node dir, is not used), replaced
atomically by ``save``, which keeps only the entries this process used (hit or added): the
cache is about the size of the trees last loaded. It is trusted host state like the rest of
the node cache (a pickle runs code when loaded): it lives in the node dir (``0700``), never in
a checkout or a store. An unreadable, corrupt or other-version file is treated as empty; one
that cannot be written is skipped.
"""

from __future__ import annotations

import copyreg
import dataclasses
import hashlib
import os
import pickle
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Any

from envbuild.defs.model import Definition

VERSION = 2


def git_blob_id(data: bytes) -> str:
    """The git (sha1) blob id of ``data``: what ``git hash-object`` prints."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def code_fingerprint() -> str:
    """sha256 over the code that turns bytes into definitions (this package's modules and
    schemas) and over what parsing reads from the environment — the platform an image base
    resolves to (``host_platform``: ``--platform``/``$ENVBUILD_PLATFORM``) is filled in when a
    definition is parsed: a cache written by other code (another envbuild version, another
    checkout sharing the node dir) or for another platform is not used."""
    from envbuild.defs.model import host_platform

    h = hashlib.sha256()
    here = Path(__file__).parent
    for path in sorted([*here.glob("*.py"), *here.glob("schema/*")]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(b"platform\0" + host_platform().encode())
    return h.hexdigest()


def _proxy(d: dict[Any, Any]) -> MappingProxyType[Any, Any]:
    return MappingProxyType(d)


def _reduce_proxy(m: MappingProxyType[Any, Any]) -> tuple[Any, ...]:
    return _proxy, (dict(m),)


class ParseCache:
    #: New entries + blob ids a ``save`` may leave unwritten (see there).
    SMALL_CHANGE = 256

    def __init__(self, directory: Path | str) -> None:
        self.path = Path(directory) / f"defs-v{VERSION}.pickle"
        self._entries: dict[str, tuple[Definition, ...]] | None = None
        self._used: dict[str, tuple[Definition, ...]] = {}
        self._blobs: dict[str, str] | None = None
        self._used_blobs: dict[str, str] = {}
        self._placed: dict[int, tuple[Definition, Definition]] = {}
        self.code = code_fingerprint()
        self.hits = 0
        self.misses = 0

    def _load(self) -> dict[str, tuple[Definition, ...]]:
        if self._entries is None:
            try:
                with open(self.path, "rb") as f:
                    data = pickle.load(f)  # noqa: S301 - our own node-dir file, see docstring
                ok = (isinstance(data, dict) and data.get("version") == VERSION
                      and data.get("code") == self.code)
                self._entries = data["entries"] if ok else {}
                self._blobs = data["blobs"] if ok else {}
            except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError,
                    KeyError, TypeError, ValueError):
                self._entries, self._blobs = {}, {}
        return self._entries

    def blob(self, oid: str) -> str | None:
        """The content digest of git blob ``oid`` if a file with its bytes was ever hashed."""
        found = self._used_blobs.get(oid)
        if found is None:
            self._load()
            assert self._blobs is not None
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
        self._used_blobs[key] = digest

    def get(self, digest: str, file: str) -> list[Definition] | None:
        """The definitions of a file with these bytes, placed at ``file``; None on a miss."""
        found = self._used.get(digest) or self._load().get(digest)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._used[digest] = found
        out = []
        for d in found:
            if d.origin.file != file:
                placed = dataclasses.replace(d, origin=dataclasses.replace(d.origin, file=file))
                self._placed[id(placed)] = (placed, d)  # holding it keeps its id unique
                d = placed
            out.append(d)
        return out

    def original(self, d: Definition) -> Definition:
        """The cached definition ``d`` is a copy of (placed at another file), else ``d``: two
        definitions with the same original have the same content (origins aside), which is
        what ``compute_keys(previous=...)`` needs to reuse a key."""
        entry = self._placed.get(id(d))
        return entry[1] if entry is not None and entry[0] is d else d

    def put(self, digest: str, definitions: list[Definition]) -> None:
        self._used[digest] = tuple(definitions)

    def save(self, force: bool = False) -> None:
        """Write the entries used by this process (atomically); skipped when the directory
        cannot be written, and (unless ``force``) when nothing changed or all that is new is
        at most ``SMALL_CHANGE`` entries and blob ids (no new pin): re-parsing a few files
        next time costs milliseconds, rewriting 100,000 entries seconds. Entries no longer
        used are dropped only by a write."""
        if not force and self._entries is not None and self._blobs is not None:
            new = (len(self._used.keys() - self._entries.keys())
                   + len(self._used_blobs.keys() - self._blobs.keys()))
            pins = any(k.startswith("pin:") and k not in self._blobs for k in self._used_blobs)
            changed = (self._used.keys() != self._entries.keys()
                       or self._used_blobs.keys() != self._blobs.keys())
            if not pins and (not changed or (self._entries and new <= self.SMALL_CHANGE)):
                return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".defs-", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    pickler = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
                    # the model's read-only mappings; only this pickler learns to write them
                    pickler.dispatch_table = {**copyreg.dispatch_table,
                                              MappingProxyType: _reduce_proxy}
                    pickler.dump({"version": VERSION, "code": self.code,
                                  "entries": self._used, "blobs": self._used_blobs})
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            return
        self._entries, self._blobs = dict(self._used), dict(self._used_blobs)
