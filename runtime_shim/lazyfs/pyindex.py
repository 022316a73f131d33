"""A layer's import index: the module-level imports of every CPython ``.pyc`` in a layer,
scanned once when the layer is packed and kept in the store beside it, so the native filler
knows what a module will import *before* its pyc is filled: the first open of
``numpy/__init__``'s pyc resolves numpy's whole import closure at once (``fillhints``:
looked up here, resolved with ``pydeps.predict``), and its files are filled while the
importer runs its first module.

Record ``lazy-pyimports/<layer digest hex>`` (``INDEX_NAMESPACE``), one per layer::

    {"version": 1, "layer": "sha256:...", "names": [NAME, ...],
     "pycs": {PATH: [NAME_INDEX, LEVEL, N, FROM_INDEX * N, ...], ...}}

``names`` is a string table of module and fromlist names; each pyc's imports are flattened
triples (name, level, fromlist) in bytecode order, as ``pydeps.scan`` reports them. A layer
without pycs of a version ``pydeps`` reads gets no record. A hint only: a missing, damaged or
foreign record means no prediction, never a failed sandbox.

Hostile input both ways: the pycs come from a layer anyone may have built (``pydeps.scan``
is a bounded reader that never raises; the whole index is bounded by ``MAX_PYCS``,
``MAX_SECONDS`` and ``MAX_RECORD``), and the record comes back from the store, where anyone
with write access may have replaced it (``decode_index`` checks every type and bound before
use, and entries are decoded only when looked up).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterable, Iterator
from typing import Any

from envbuild.errors import EnvbuildError
from envbuild.store.helpers import PYIMPORT_RECORDS
from runtime_shim.lazyfs import pydeps

log = logging.getLogger("envbuild.lazyfs")

INDEX_NAMESPACE = PYIMPORT_RECORDS
INDEX_VERSION = 1
#: Pycs indexed per layer (a large venv has ~20,000).
MAX_PYCS = 100_000
#: Seconds of scanning per layer before the index is cut short (a hint: what was scanned is
#: kept). Measured: ~0.5 ms per pyc.
MAX_SECONDS = 120.0
#: Largest record read back (bytes of JSON).
MAX_RECORD = 32 << 20
#: Distinct names in one record.
MAX_NAMES = 1_000_000


def record_name(layer_digest: str) -> str:
    return layer_digest.removeprefix("sha256:")


def build_index(members: Iterable[tuple[str, bytes]], layer_digest: str,
                *, max_seconds: float = MAX_SECONDS) -> dict[str, Any] | None:
    """The record of a layer from its ``(path, bytes)`` pycs (``pyc_members``); ``None`` when
    none of them has an import ``pydeps`` can read (no record is stored then)."""
    names: dict[str, int] = {}
    pycs: dict[str, list[int]] = {}
    deadline = time.monotonic() + max_seconds

    def ref(name: str) -> int:
        i = names.get(name)
        if i is None:
            i = names[name] = len(names)
        return i

    for path, data in members:
        if len(pycs) >= MAX_PYCS or time.monotonic() > deadline:
            log.warning("import index of %s cut short after %d pycs", layer_digest[:19],
                        len(pycs))
            break
        imports = pydeps.scan(data)
        flat: list[int] = []
        for imp in imports:
            flat += [ref(imp.name), imp.level, len(imp.fromlist)]
            flat += [ref(x) for x in imp.fromlist]
        if imports or data[:4] == pydeps._MAGIC_311:
            pycs[path] = flat   # a module without imports is known too (nothing to predict)
    if not any(pycs.values()):
        return None
    return {"version": INDEX_VERSION, "layer": layer_digest, "names": list(names),
            "pycs": pycs}


def pyc_members(reader: Any) -> Iterator[tuple[str, bytes]]:
    """``(path, bytes)`` of each regular-file pyc of the layer ``reader`` (an
    ``envbuild.layers.LayerReader``), in one pass over its frames (reading each pyc by path
    would decompress a frame once per file in it)."""
    from envbuild.layers import TarStream, iter_members

    stream = TarStream(reader.iter_frames())
    for entry, _ in iter_members(stream):
        size = entry.size if entry.type == "file" else 0
        if size and size <= pydeps.MAX_PYC and pydeps.is_pyc(entry.path):
            data = stream.read(size)
            yield entry.path, bytes(data)
        elif size:
            stream.skip(size)


def index_layer_file(store: Any, path: str, layer_digest: str) -> int:
    """Scan the packed layer at ``path`` (blob ``layer_digest``) and store its record in
    ``store``; returns the pycs indexed (0: none, no record). A hint: any failure is logged
    and gives 0, never an error for the build that packed the layer."""
    from envbuild.layers import LayerReader

    t0 = time.monotonic()
    try:
        with LayerReader.open_file(path, name=layer_digest[:19]) as reader:
            rec = index_reader(store, reader, layer_digest)
        if rec is None:
            return 0
    except (EnvbuildError, OSError, ValueError) as e:
        log.warning("import index of %s: %s (lazy sandboxes of it predict no imports)",
                    layer_digest[:19], getattr(e, "message", e))
        return 0
    log.info("import index of %s: %d pycs in %.2f s", layer_digest[:19], len(rec["pycs"]),
             time.monotonic() - t0)
    return len(rec["pycs"])


def index_reader(store: Any, reader: Any, layer_digest: str) -> dict[str, Any] | None:
    """Scan the open layer ``reader`` (blob ``layer_digest``) and store its record in
    ``store`` (replacing one there); returns the record, or None when the layer has no pycs
    (any record of it is then left as it is). Errors are the reader's and the store's
    (``envbuild layer index``: a user asked for it, so they are reported)."""
    rec = build_index(pyc_members(reader), layer_digest)
    if rec is not None:
        store.put_record(INDEX_NAMESPACE, record_name(layer_digest), rec)
    return rec


class ImportIndex:
    """A decoded record: ``imports(path)`` gives a pyc's imports (``pydeps.Import``s, in
    bytecode order), ``None`` for a path the index does not know. Entries are checked and
    decoded when first looked up (a workload resolves a few thousand of a layer's pycs)."""

    def __init__(self, names: list[str], pycs: dict[str, Any]) -> None:
        self.names, self.pycs = names, pycs
        self._decoded: dict[str, tuple[pydeps.Import, ...]] = {}

    def __len__(self) -> int:
        return len(self.pycs)

    def imports(self, path: str) -> tuple[pydeps.Import, ...] | None:
        got = self._decoded.get(path)
        if got is not None:
            return got
        flat = self.pycs.get(path)
        if flat is None:
            return None
        got = self._decoded[path] = _decode_entry(flat, self.names)
        return got


def _decode_entry(flat: Any, names: list[str]) -> tuple[pydeps.Import, ...]:
    """One pyc's flattened triples, checked: a malformed entry gives what was well formed
    before the damage (a hint), never an exception."""
    out: list[pydeps.Import] = []
    if not isinstance(flat, list):
        return ()
    n, i, total = len(names), 0, 0

    def name(k: Any) -> str | None:
        if type(k) is not int or not 0 <= k < n:
            return None
        s = names[k]
        return s if isinstance(s, str) and 0 < len(s) <= pydeps.MAX_NAME else None

    while i + 3 <= len(flat) and len(out) < pydeps.MAX_IMPORTS:
        mod, level, count = name(flat[i]), flat[i + 1], flat[i + 2]
        if (type(level) is not int or not 0 <= level <= 64 or type(count) is not int
                or not 0 <= count <= pydeps.MAX_FROMLIST or i + 3 + count > len(flat)):
            break
        fromlist = [name(k) for k in flat[i + 3:i + 3 + count]]
        i += 3 + count
        total += count
        if total > pydeps.MAX_NAMES_TOTAL:
            break
        if (mod is None and level == 0) or None in fromlist:
            continue
        out.append(pydeps.Import(mod or "", level, tuple(x for x in fromlist if x)))
    return tuple(out)


def decode_index(rec: Any, layer_digest: str) -> ImportIndex | None:
    """The index in record ``rec`` (from the store: untrusted) for layer ``layer_digest``;
    ``None`` for another version, another layer's record, or a damaged one."""
    if not isinstance(rec, dict) or rec.get("version") != INDEX_VERSION \
            or rec.get("layer") != layer_digest:
        return None
    names, pycs = rec.get("names"), rec.get("pycs")
    if not isinstance(names, list) or not isinstance(pycs, dict) or len(names) > MAX_NAMES \
            or len(pycs) > MAX_PYCS:
        return None
    return ImportIndex(names, pycs)


def read_index_bytes(data: bytes, layer_digest: str) -> ImportIndex | None:
    """``decode_index`` of a record's bytes (a presigned GET's body): bounded JSON."""
    from envbuild.canonical import load_json

    if len(data) > MAX_RECORD:
        return None
    try:
        return decode_index(load_json(data, max_bytes=MAX_RECORD), layer_digest)
    except ValueError:
        return None


def read_local_index(store_root: str, layer_digest: str) -> ImportIndex | None:
    """The index record of ``layer_digest`` in the store directory ``store_root``, read
    bounded as a presigned GET is: a record over ``MAX_RECORD`` bytes, a symlink or anything
    but a regular file is no index (the filler, root, reads what anyone who can write the
    store's records may have put there)."""
    from envbuild.store import LocalStore

    path = LocalStore(store_root, create=False)._record_path(  # one copy of the layout
        INDEX_NAMESPACE, record_name(layer_digest))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD:
            return None
        return read_index_bytes(f.read(MAX_RECORD + 1), layer_digest)
