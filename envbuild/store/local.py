"""``LocalStore``: a directory laid out as an OCI image layout, plus envbuild's records.

On-disk format (store format version 1)::

    <root>/
      oci-layout             {"imageLayoutVersion": "1.0.0"}                (OCI)
      index.json             OCI image index; each ref is one entry of "manifests" whose
                             annotations["org.opencontainers.image.ref.name"] is the ref name (OCI)
      blobs/sha256/<hex>     blob bytes, named by their sha256                (OCI)
      blobs/sha256/.tmp-*    blobs being written (``put`` holds an flock on its temp file
                             until the rename); never listed, removed by GC when stale and
                             unlocked (``list_partials``)
      envbuild-store.json    {"version": 1}: envbuild's own layout version; other versions are
                             refused by name
      index.json.lock        flock(2) target serialising index.json updates
      keys/v1/<key-hex>      key records (any ``<namespace>/<name>`` record lives here)

Because the OCI part is standard, ``skopeo copy oci:cache:NAME docker://...`` and
``umoci ls --layout cache`` work on it directly.

Atomicity: every file is written to ``.tmp-<random>`` in its final directory, fsynced, renamed
over its final name, and the directory fsynced — a crash leaves the old file or the new one,
never half of one (STYLE.md principle 6; umoci ``oci/cas/dir``). Blobs are hashed while they
are written and renamed only once their digest matched. Two processes putting the same blob both
rename an identical file into place, so both succeed. ``index.json`` is read-modified-written
under an exclusive ``flock`` on ``index.json.lock``, which is what makes ``put_ref(expect=...)``
a real compare-and-swap between processes; readers need no lock because the rename is atomic.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from envbuild.canonical import read_json_file
from envbuild.errors import StoreError, StoreUnavailable
from envbuild.oci import is_hex64
from envbuild.store._local_files import (  # noqa: F401  (TMP_PREFIX re-exported)
    TMP_PREFIX,
    create_if_absent,
    fsync_dir,
    read_json,
    tmp_name,
    unlocked,
    write_atomic,
    write_tmp,
)
from envbuild.store.base import (
    ANY,
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_MANIFEST,
    REF_NAME_ANNOTATION,
    BlobInfo,
    ConditionalRecords,
    Descriptor,
    LocalBlobPaths,
    Locatable,
    PartialWrite,
    RefConflict,
    Store,
    StoreLocation,
    TailReader,
    VerifyingReader,
    _Any,
    blob_not_found,
    canonical_json,
    check_digest,
    check_expect,
    check_range,
    check_record_name,
    check_ref_name,
    check_tail_length,
    decode_record,
    encode_record,
    iter_chunks,
    make_descriptor,
    mismatch_on_put,
    range_beyond_end,
    ref_not_found,
)

STORE_VERSION = 1
IMAGE_LAYOUT_VERSION = "1.0.0"
VERSION_FILE = "envbuild-store.json"
LAYOUT_FILE = "oci-layout"
INDEX_FILE = "index.json"
LOCK_FILE = "index.json.lock"
_WHERE_HINT = "choose another location with --store DIR or ENVBUILD_STORE"


def _empty_index() -> dict[str, Any]:
    return {"schemaVersion": 2, "mediaType": MEDIA_TYPE_INDEX, "manifests": []}


class LocalStore(Store, TailReader, LocalBlobPaths, Locatable, ConditionalRecords):
    """A ``Store`` in a local directory (an OCI image layout); see the module docstring.

    Capabilities beyond ``Store``: ``TailReader``, ``LocalBlobPaths`` (blobs are the files
    ``blobs/sha256/<hex>``) and ``Locatable`` (its absolute path).

    Opening creates the directory and its layout if needed. It raises ``StoreUnavailable`` when
    the path is a file, cannot be created, is not writable, or holds a layout or store version
    this envbuild does not know.
    """

    supports_cas = True

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        """Open the store at ``root``; ``create=False`` (a reader: a sandbox, the lazy filler)
        never makes a missing one — ``StoreUnavailable`` instead, with no window in which a
        store that is away for a moment is made anew, empty, in its place."""
        self.root = Path(root)
        self._blobs = self.root / "blobs" / "sha256"
        self._index = self.root / INDEX_FILE
        self._create = create
        self._open()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _open(self) -> None:
        root = self.root
        if root.exists() and not root.is_dir():
            raise StoreUnavailable(f"store path {root} exists and is not a directory",
                                   hint=_WHERE_HINT)
        # An OCI layout another tool made (skopeo, umoci): opened as it is, nothing written
        # into it (no envbuild-store.json, no writability demand), so read-only commands
        # leave someone else's directory untouched. A write later fails on its own if denied.
        self.foreign = (root / LAYOUT_FILE).is_file() and not (root / VERSION_FILE).exists()
        if not self.foreign:
            self._init_layout()
        layout = read_json(root / LAYOUT_FILE)
        found = layout.get("imageLayoutVersion") if isinstance(layout, dict) else None
        if found != IMAGE_LAYOUT_VERSION:
            raise StoreUnavailable(
                f"unsupported OCI image layout version {found!r} in {root / LAYOUT_FILE}",
                hint=f"envbuild reads version {IMAGE_LAYOUT_VERSION}; {_WHERE_HINT}")
        if self.foreign:
            return
        meta = read_json(root / VERSION_FILE)
        found = meta.get("version") if isinstance(meta, dict) else None
        if found != STORE_VERSION:
            raise StoreUnavailable(
                f"unsupported envbuild store version {found!r} in {root / VERSION_FILE}",
                hint=f"this envbuild reads store version {STORE_VERSION}; use the envbuild "
                     f"that wrote it, or {_WHERE_HINT}")

    def _init_layout(self) -> None:
        """Create the store's directory and files where missing; check it is writable."""
        root = self.root
        try:
            if self._create:
                self._blobs.mkdir(parents=True, exist_ok=True)
            else:   # inside the root only: a missing root is FileNotFoundError, never made
                for d in (root / "blobs", self._blobs):
                    d.mkdir(exist_ok=True)
        except FileNotFoundError:
            raise StoreUnavailable(f"no store at {root}", hint=_WHERE_HINT) from None
        except OSError as e:
            raise StoreUnavailable(f"create store directory {root}: {e.strerror}",
                                   hint=_WHERE_HINT) from e
        if not os.access(root, os.W_OK | os.X_OK) or not os.access(self._blobs, os.W_OK):
            raise StoreUnavailable(f"store directory {root} is not writable",
                                   hint=f"fix its permissions, or {_WHERE_HINT}")
        try:
            create_if_absent(root / LAYOUT_FILE, canonical_json(
                {"imageLayoutVersion": IMAGE_LAYOUT_VERSION}))
            create_if_absent(self._index, canonical_json(_empty_index()))
            create_if_absent(root / VERSION_FILE, canonical_json({"version": STORE_VERSION}))
        except OSError as e:
            raise StoreUnavailable(f"initialise store {root}: {e}", hint=_WHERE_HINT) from e

    # -- blobs ---------------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        """Where blob ``digest`` lives (whether or not it exists). Validates the digest."""
        return self._blobs / check_digest(digest)

    def put(self, digest: str, data: bytes | BinaryIO, *, size: int | None = None) -> None:
        final = self.blob_path(digest)
        if final.exists():
            return
        if self.foreign:  # a foreign layout may have no blobs yet: made on the first write
            self._blobs.mkdir(parents=True, exist_ok=True)
        tmp = tmp_name(self._blobs)
        guard = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            # flock held until after the rename: GC never takes a temp file a writer holds
            guard = os.dup(fd)
            fcntl.flock(guard, fcntl.LOCK_EX)
            h, count = hashlib.sha256(), 0
            # a verifying stream of this very digest (a pull) hashes as it is read: once is
            # enough (it raises at its end if the bytes are wrong, before the rename below)
            proven = isinstance(data, VerifyingReader) and data.proves(digest)
            with open(fd, "wb") as f:
                for chunk in iter_chunks(data):
                    if not proven:
                        h.update(chunk)
                    f.write(chunk)
                    count += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            verified = proven and isinstance(data, VerifyingReader) and data.verified
            actual = digest if verified else "sha256:" + h.hexdigest()
            if actual != digest or (size is not None and count != size):
                raise mismatch_on_put(digest, actual, count, size)
            # A concurrent put of the same digest may have renamed first: replacing its file
            # with identical bytes is harmless, and both callers succeed.
            os.replace(tmp, final)
            fsync_dir(self._blobs)
        except OSError as e:
            raise StoreError(f"write blob {digest} to {self._blobs}: {e}") from e
        finally:
            tmp.unlink(missing_ok=True)
            if guard >= 0:
                os.close(guard)

    def get(self, digest: str) -> BinaryIO:
        path = self.blob_path(digest)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise blob_not_found(digest) from None
        except OSError as e:
            raise StoreError(f"open blob {path}: {e}") from e
        size = os.fstat(f.fileno()).st_size
        reader = VerifyingReader(f, digest, size=size, location=str(path))
        return reader  # type: ignore[return-value]

    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        path = self.blob_path(digest)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if offset > size:
                    raise range_beyond_end(digest, offset, size)
                f.seek(offset)
                return f.read(length)
        except FileNotFoundError:
            raise blob_not_found(digest) from None
        except OSError as e:
            raise StoreError(f"read blob {path}: {e}") from e

    def get_tail(self, digest: str, length: int) -> tuple[bytes, int]:
        check_tail_length(length)
        path = self.blob_path(digest)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - length))
                return f.read(length), size
        except FileNotFoundError:
            raise blob_not_found(digest) from None
        except OSError as e:
            raise StoreError(f"read blob {path}: {e}") from e

    def location(self) -> StoreLocation:
        return StoreLocation(os.path.abspath(self.root))

    def stat(self, digest: str) -> BlobInfo:
        path = self.blob_path(digest)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise blob_not_found(digest) from None
        return BlobInfo(digest, st.st_size, st.st_mtime)

    def exists(self, digest: str) -> bool:
        return self.blob_path(digest).exists()

    def delete(self, digest: str) -> None:
        path = self.blob_path(digest)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise StoreError(f"delete blob {path}: {e}") from e

    def list(self) -> Iterator[str]:
        with os.scandir(self._blobs) as entries:
            names = [e.name for e in entries]
        for name in names:
            if is_hex64(name):  # skips .tmp-* and strays
                yield "sha256:" + name

    def list_partials(self) -> Iterator[PartialWrite]:
        """The ``.tmp-*`` files anywhere in the store (blobs, records, index.json being
        written, or left by a crash) that no ``put`` holds locked; ``name`` is the path
        relative to the root."""
        for directory, _dirs, files in os.walk(self.root):
            for name in files:
                if not name.startswith(TMP_PREFIX):
                    continue
                path = Path(directory, name)
                try:
                    with unlocked(path):
                        st = path.stat()
                except (FileNotFoundError, BlockingIOError):
                    continue  # renamed into place since the listing, or being written
                yield PartialWrite(str(path.relative_to(self.root)), st.st_size, st.st_mtime)

    def delete_partial(self, partial: PartialWrite) -> None:
        path = self.root / partial.name
        if not path.name.startswith(TMP_PREFIX) or ".." in Path(partial.name).parts:
            raise StoreError(f"not a partial write of {self}: {partial.name!r}")
        try:
            with unlocked(path):
                path.unlink(missing_ok=True)
        except (FileNotFoundError, BlockingIOError):
            pass  # gone, or a writer holds it after all: leave it
        except OSError as e:
            raise StoreError(f"delete partial write {path}: {e}") from e

    # -- refs ----------------------------------------------------------------------------------

    def _read_index(self) -> dict[str, Any]:
        try:
            index = read_json_file(self._index)
        except FileNotFoundError:
            return _empty_index()
        except ValueError as e:
            raise StoreError(f"parse {self._index}: {e}",
                             hint="the store's index is damaged; repair or delete it") from e
        if not isinstance(index, dict) or not isinstance(index.get("manifests", []), list):
            raise StoreError(f"parse {self._index}: not an OCI image index")
        index.setdefault("manifests", [])
        return index

    @contextlib.contextmanager
    def _locked_index(self) -> Iterator[dict[str, Any]]:
        """Yield index.json for modification under the lock; write it back if no error."""
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            index = self._read_index()
            before = canonical_json(index)
            yield index
            after = canonical_json(index)
            if after != before:
                write_atomic(self._index, after)
        finally:
            os.close(fd)  # releases the flock

    @staticmethod
    def _find(index: dict[str, Any], name: str) -> dict[str, Any] | None:
        for entry in index["manifests"]:
            if _ref_name(entry) == name:
                return entry
        return None

    def put_ref(self, name: str, digest: str, *, media_type: str = MEDIA_TYPE_MANIFEST,
                annotations: Mapping[str, str] | None = None,
                expect: str | None | _Any = ANY) -> Descriptor:
        check_ref_name(name)
        check_expect(self, expect)
        desc = make_descriptor(media_type, digest, self.stat(digest).size, annotations)
        entry = desc.to_oci()
        entry["annotations"] = {**desc.annotations, REF_NAME_ANNOTATION: name}
        try:
            with self._locked_index() as index:
                current = self._find(index, name)
                if expect is not ANY:
                    current_digest = current.get("digest") if current else None
                    if current_digest != expect:
                        raise RefConflict(name, expect, current_digest)
                manifests = index["manifests"]
                if current is None:
                    manifests.append(entry)
                else:  # keep the entry's position; drop duplicates other tools may have left
                    at = manifests.index(current)
                    index["manifests"] = [entry if i == at else m for i, m in enumerate(manifests)
                                          if i == at or _ref_name(m) != name]
        except OSError as e:
            raise StoreError(f"update {self._index}: {e}") from e
        return desc

    def put_refs(self, refs: Mapping[str, str], *,
                 media_type: str = MEDIA_TYPE_MANIFEST) -> None:
        entries = {}
        for name, digest in refs.items():
            check_ref_name(name)
            desc = make_descriptor(media_type, digest, self.stat(digest).size, None)
            entry = desc.to_oci()
            entry["annotations"] = {**desc.annotations, REF_NAME_ANNOTATION: name}
            entries[name] = entry
        if not entries:
            return
        try:
            with self._locked_index() as index:
                replaced: set[str] = set()
                kept = []
                for m in index["manifests"]:
                    ref = _ref_name(m)
                    if ref is not None and ref in entries:
                        if ref in replaced:
                            continue  # drop duplicates other tools may have left
                        m = entries[ref]  # keep the entry's position
                        replaced.add(ref)
                    kept.append(m)
                kept.extend(e for n, e in entries.items() if n not in replaced)
                index["manifests"] = kept
        except OSError as e:
            raise StoreError(f"update {self._index}: {e}") from e

    def _cached_index(self) -> dict[str | None, Any]:
        """index.json parsed once per version of the file (reads are frequent: every lock
        resolves a ref; a 1,000-env index costs milliseconds to parse)."""
        try:
            st = self._index.stat()
        except FileNotFoundError:
            return {}  # read as an empty index (_read_index): no refs
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = getattr(self, "_index_cache", None)
        if cached is None or cached[0] != stamp:
            index = self._read_index()
            by_name: dict[str | None, Any] = {}
            for m in index["manifests"]:
                by_name.setdefault(_ref_name(m), m)
            cached = self._index_cache = (stamp, index, by_name)
        return cached[2]

    def get_ref(self, name: str) -> Descriptor:
        check_ref_name(name)
        entry = self._cached_index().get(name)
        if entry is None:
            raise ref_not_found(name)
        desc = Descriptor.from_oci(entry)
        annotations = {k: v for k, v in desc.annotations.items() if k != REF_NAME_ANNOTATION}
        return Descriptor(desc.media_type, desc.digest, desc.size, annotations)

    def list_refs(self) -> builtins.list[str]:
        names = {_ref_name(m) for m in self._read_index()["manifests"]}
        return sorted(n for n in names if n is not None)

    def delete_ref(self, name: str) -> None:
        check_ref_name(name)
        try:
            with self._locked_index() as index:
                index["manifests"] = [m for m in index["manifests"] if _ref_name(m) != name]
        except OSError as e:
            raise StoreError(f"update {self._index}: {e}") from e

    # -- records -------------------------------------------------------------------------------

    def _mkdirs(self, path: Path) -> None:
        """Make ``path`` and its parents below the store's root — never the root itself: a
        store moved or removed under an open ``LocalStore`` is an error (``FileNotFoundError``),
        not an empty store made in its place (the soak found a lazy profile save doing that)."""
        d = self.root
        for part in path.relative_to(self.root).parts:
            d = d / part
            try:
                d.mkdir()
            except FileExistsError:
                pass

    def _record_path(self, namespace: str, name: str) -> Path:
        check_record_name(namespace, name)
        return self.root.joinpath(*namespace.split("/"), name)

    def put_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> None:
        path = self._record_path(namespace, name)
        data = encode_record(obj)
        try:
            self._mkdirs(path.parent)
            write_atomic(path, data)
        except OSError as e:
            raise StoreError(f"write record {path}: {e}") from e

    def get_record(self, namespace: str, name: str) -> dict[str, Any] | None:
        path = self._record_path(namespace, name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                return None
            raise StoreError(f"read record {path}: {e}") from e
        return decode_record(data, str(path))

    def list_records(self, namespace: str) -> builtins.list[str]:
        directory = self._record_path(namespace, "x").parent
        try:
            with os.scandir(directory) as entries:
                return sorted(e.name for e in entries
                              if not e.name.startswith(".") and e.is_file())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def record_mtime(self, namespace: str, name: str) -> float | None:
        try:
            return self._record_path(namespace, name).stat().st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None

    def delete_record(self, namespace: str, name: str) -> None:
        path = self._record_path(namespace, name)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise StoreError(f"delete record {path}: {e}") from e


    # -- conditional records (ConditionalRecords; tag: sha256 of the file's bytes) ----------
    # A create is a link(2) of a complete temp file (atomic and exclusive like O_EXCL, and no
    # reader ever sees a half-written record); a replace or conditional delete compares and
    # acts under the flock of ``<namespace>/.cas.lock``, which every such writer takes.

    @contextlib.contextmanager
    def _cas_locked(self, path: Path) -> Iterator[None]:
        self._mkdirs(path.parent)
        fd = os.open(path.parent / ".cas.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def get_record_tagged(self, namespace: str, name: str) -> tuple[dict[str, Any], str] | None:
        path = self._record_path(namespace, name)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StoreError(f"read record {path}: {e}") from e
        return decode_record(data, str(path)), hashlib.sha256(data).hexdigest()

    def create_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> str | None:
        path = self._record_path(namespace, name)
        data = encode_record(obj)
        try:
            self._mkdirs(path.parent)
            tmp = write_tmp(path.parent, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return None
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(path.parent)
        except OSError as e:
            raise StoreError(f"create record {path}: {e}") from e
        return hashlib.sha256(data).hexdigest()

    def replace_record(self, namespace: str, name: str, obj: Mapping[str, Any],
                       tag: str) -> str | None:
        path = self._record_path(namespace, name)
        data = encode_record(obj)
        try:
            with self._cas_locked(path):
                try:
                    current = path.read_bytes()
                except FileNotFoundError:
                    return None
                if hashlib.sha256(current).hexdigest() != tag:
                    return None
                write_atomic(path, data)
        except OSError as e:
            raise StoreError(f"replace record {path}: {e}") from e
        return hashlib.sha256(data).hexdigest()

    def delete_record_if(self, namespace: str, name: str, tag: str) -> bool:
        path = self._record_path(namespace, name)
        try:
            with self._cas_locked(path):
                try:
                    current = path.read_bytes()
                except FileNotFoundError:
                    return False
                if hashlib.sha256(current).hexdigest() != tag:
                    return False
                path.unlink()
        except OSError as e:
            raise StoreError(f"delete record {path}: {e}") from e
        return True

def _ref_name(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return None
    annotations = entry.get("annotations")
    return annotations.get(REF_NAME_ANNOTATION) if isinstance(annotations, dict) else None

