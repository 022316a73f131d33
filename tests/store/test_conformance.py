"""The ``Store`` contract, checked against every backend in ``conftest.BACKENDS``."""

from __future__ import annotations

import hashlib
import io
import random
import tracemalloc

import pytest

from envbuild.errors import BlobNotFound, DigestMismatch, RefNotFound, StoreError
from envbuild.store import (
    ANY,
    MEDIA_TYPE_INDEX,
    KeyRecord,
    MemoryStore,
    RefConflict,
    copy_blobs,
    digest_bytes,
    get_json,
    get_key_record,
    put_bytes,
    put_file,
    put_json,
    put_key_record,
    read_bytes,
)

DATA = b"hello, store\n" * 100
D = digest_bytes(DATA)
OTHER = b"other"
D_OTHER = digest_bytes(OTHER)
ABSENT = "sha256:" + "0" * 64


# -- blobs ---------------------------------------------------------------------------------


def test_put_get_round_trip_bytes_and_stream(store):
    store.put(D, DATA)
    store.put(D_OTHER, io.BytesIO(OTHER), size=len(OTHER))
    with store.get(D) as f:
        assert f.read() == DATA
    assert read_bytes(store, D_OTHER) == OTHER


def test_put_is_idempotent(store):
    store.put(D, DATA)
    store.put(D, DATA)
    store.put(D, io.BytesIO(DATA))
    assert read_bytes(store, D) == DATA


@pytest.mark.needs("list-unreferenced")
def test_list_yields_each_blob_once(store):
    store.put(D, DATA)
    store.put(D, io.BytesIO(DATA))
    assert list(store.list()) == [D]


def test_empty_blob(store):
    empty = digest_bytes(b"")
    store.put(empty, b"")
    assert store.stat(empty).size == 0
    assert read_bytes(store, empty) == b""
    assert store.get_range(empty, 0, 10) == b""


@pytest.mark.parametrize("size", [None, len(DATA)])
def test_wrong_content_is_refused_and_leaves_nothing(store, size):
    with pytest.raises(DigestMismatch) as e:
        store.put(D, DATA + b"x", size=size)
    assert D in e.value.message
    assert e.value.hint
    assert not store.exists(D)
    assert list(store.list()) == []


def test_wrong_size_is_refused_and_leaves_nothing(store):
    with pytest.raises(DigestMismatch, match="bytes, expected"):
        store.put(D, DATA, size=len(DATA) + 1)
    assert not store.exists(D)


def test_missing_blob(store):
    with pytest.raises(BlobNotFound):
        store.get(ABSENT)
    with pytest.raises(BlobNotFound):
        store.stat(ABSENT)
    with pytest.raises(BlobNotFound):
        store.get_range(ABSENT, 0, 1)
    assert store.exists(ABSENT) is False


def test_stat_and_exists(store):
    store.put(D, DATA)
    info = store.stat(D)
    assert (info.digest, info.size) == (D, len(DATA))
    assert store.exists(D)


@pytest.mark.parametrize(("offset", "length", "want"), [
    (0, 5, DATA[:5]),                       # start
    (100, 50, DATA[100:150]),               # middle
    (len(DATA) - 3, 10, DATA[-3:]),         # runs past the end: short read
    (len(DATA), 10, b""),                   # exactly at the end
    (7, 0, b""),                            # empty range
    (0, len(DATA), DATA),                   # the whole blob
])
def test_get_range(store, offset, length, want):
    store.put(D, DATA)
    assert store.get_range(D, offset, length) == want


@pytest.mark.parametrize(("offset", "length"), [(len(DATA) + 1, 1), (-1, 1), (0, -1)])
def test_get_range_out_of_bounds(store, offset, length):
    store.put(D, DATA)
    with pytest.raises(StoreError) as e:
        store.get_range(D, offset, length)
    assert e.value.reference == "invalid-range"


def test_delete(store):
    store.put(D, DATA)
    store.put(D_OTHER, OTHER)
    store.delete(D)
    assert not store.exists(D)
    assert store.exists(D_OTHER)
    with pytest.raises(BlobNotFound):
        store.stat(D)
    store.delete(D)  # idempotent
    store.delete(ABSENT)
    store.put(D, DATA)  # and it can come back
    assert read_bytes(store, D) == DATA


@pytest.mark.needs("list-unreferenced")
def test_list_and_delete(store):
    assert list(store.list()) == []
    store.put(D, DATA)
    store.put(D_OTHER, OTHER)
    assert sorted(store.list()) == sorted([D, D_OTHER])
    store.delete(D)
    assert not store.exists(D)
    assert list(store.list()) == [D_OTHER]
    store.delete(D)  # idempotent
    store.delete(ABSENT)
    store.put(D, DATA)  # and it can come back
    assert read_bytes(store, D) == DATA


BAD_DIGESTS = [
    "sha256:" + "A" * 64,                     # upper case
    "sha256:" + "0" * 63,                     # short
    "sha512:" + "0" * 128,                    # other algorithm
    "0" * 64,                                 # no algorithm
    "sha256:../../../../etc/passwd",
    "sha256:" + "0" * 62 + "/x",
    "sha256:" + "0" * 64 + "\n",
    "",
    None,
]


@pytest.mark.parametrize("bad", BAD_DIGESTS, ids=repr)
@pytest.mark.parametrize("call", [
    lambda s, d: s.put(d, b"x"),
    lambda s, d: s.get(d),
    lambda s, d: s.get_range(d, 0, 1),
    lambda s, d: s.stat(d),
    lambda s, d: s.exists(d),
    lambda s, d: s.delete(d),
    lambda s, d: s.put_ref("r", d),
], ids=["put", "get", "get_range", "stat", "exists", "delete", "put_ref"])
def test_bad_digest_strings_are_refused(store, call, bad):
    with pytest.raises(StoreError) as e:
        call(store, bad)
    assert e.value.reference == "invalid-digest"
    assert "64 lower-case hex" in e.value.hint


def _chunks(n_chunks: int, chunk: int = 1 << 20):
    block = random.Random(0).randbytes(chunk)
    for i in range(n_chunks):
        yield bytes([i]) + block[1:]


class _GeneratedStream(io.RawIOBase):
    """A large stream that never exists in memory at once."""

    def __init__(self, n_chunks: int) -> None:
        self._it = _chunks(n_chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if not self._buf:
            self._buf = next(self._it, b"")
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def test_large_blob_is_streamed(backend):
    store, n = backend.store, 20
    h = hashlib.sha256()
    for c in _chunks(n):
        h.update(c)
    digest, size = "sha256:" + h.hexdigest(), n << 20

    tracemalloc.start()
    try:
        store.put(digest, _GeneratedStream(n), size=size)
        put_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        got, count = hashlib.sha256(), 0
        with store.get(digest) as f:
            while chunk := f.read(1 << 20):
                got.update(chunk)
                count += len(chunk)
        get_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ("sha256:" + got.hexdigest(), count) == (digest, size)
    assert store.stat(digest).size == size
    assert store.get_range(digest, (5 << 20) + 1, 4) == next(
        c for i, c in enumerate(_chunks(n)) if i == 5)[1:5]
    if backend.streams:
        assert put_peak < 8 << 20, f"put held {put_peak >> 20} MiB of a 20 MiB blob"
        assert get_peak < 8 << 20, f"get held {get_peak >> 20} MiB of a 20 MiB blob"


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_corrupted_blob_is_detected_on_read(backend, damage):
    store = backend.store
    store.put(D, DATA)
    bad = {"flip": b"X" + DATA[1:], "truncate": DATA[:-1], "extend": DATA + b"!"}[damage]
    backend.corrupt(D, bad)
    with pytest.raises(DigestMismatch) as e:
        read_bytes(store, D)
    assert D in e.value.message and "corrupt" in e.value.message
    assert "delete" in e.value.hint
    with pytest.raises(DigestMismatch):  # also when reading in small pieces
        with store.get(D) as f:
            while f.read(7):
                pass


def test_reading_exactly_the_size_verifies_without_eof(backend):
    store = backend.store
    store.put(D, DATA)
    backend.corrupt(D, b"X" + DATA[1:])
    with pytest.raises(DigestMismatch):
        with store.get(D) as f:
            f.read(len(DATA))


# -- refs ----------------------------------------------------------------------------------


def test_refs_put_get_list_delete(store):
    store.put(D, DATA)
    store.put(D_OTHER, OTHER)
    desc = store.put_ref("envs/swe-requests", D, annotations={"org.example": "1"})
    assert (desc.digest, desc.size) == (D, len(DATA))
    assert store.get_ref("envs/swe-requests") == desc
    assert store.get_ref("envs/swe-requests").annotations == {"org.example": "1"}
    store.put_ref("base:2024-06", D_OTHER, media_type=MEDIA_TYPE_INDEX)
    assert store.get_ref("base:2024-06").media_type == MEDIA_TYPE_INDEX
    assert store.list_refs() == ["base:2024-06", "envs/swe-requests"]

    store.put_ref("envs/swe-requests", D_OTHER)  # overwrite
    assert store.get_ref("envs/swe-requests").digest == D_OTHER
    assert store.get_ref("envs/swe-requests").annotations == {}
    assert store.list_refs() == ["base:2024-06", "envs/swe-requests"]

    store.delete_ref("envs/swe-requests")
    store.delete_ref("envs/swe-requests")  # idempotent
    assert store.list_refs() == ["base:2024-06"]
    with pytest.raises(RefNotFound):
        store.get_ref("envs/swe-requests")
    assert store.exists(D_OTHER)  # deleting a ref keeps its blob


def test_put_refs_sets_several_at_once(store):
    store.put(D, DATA)
    store.put(D_OTHER, OTHER)
    store.put_ref("env/a", D)
    store.put_refs({"env/a": D_OTHER, "env/b": D, "env/c": D_OTHER})
    assert store.list_refs() == ["env/a", "env/b", "env/c"]
    assert [store.get_ref(n).digest for n in ("env/a", "env/b", "env/c")] == [D_OTHER, D, D_OTHER]
    assert store.get_ref("env/b").size == len(DATA)
    store.put_refs({})  # nothing to do
    with pytest.raises(BlobNotFound):
        store.put_refs({"env/d": ABSENT})
    assert "env/d" not in store.list_refs()


def test_ref_to_missing_blob_is_refused(store):
    with pytest.raises(BlobNotFound):
        store.put_ref("r", ABSENT)
    assert store.list_refs() == []


@pytest.mark.needs("cas")
def test_ref_compare_and_swap(store):
    assert store.supports_cas
    store.put(D, DATA)
    store.put(D_OTHER, OTHER)
    store.put_ref("r", D, expect=None)  # create: must not exist
    with pytest.raises(RefConflict) as e:
        store.put_ref("r", D_OTHER, expect=None)
    assert (e.value.expected, e.value.current) == (None, D)
    with pytest.raises(RefConflict) as e:
        store.put_ref("r", D_OTHER, expect=D_OTHER)
    assert e.value.current == D
    assert store.get_ref("r").digest == D  # a failed swap changes nothing
    store.put_ref("r", D_OTHER, expect=D)
    assert store.get_ref("r").digest == D_OTHER
    with pytest.raises(RefConflict) as e:
        store.put_ref("absent", D, expect=D)
    assert e.value.current is None
    store.put_ref("r", D, expect=ANY)
    assert store.get_ref("r").digest == D


@pytest.mark.parametrize("bad", ["", "/r", "r/", "a//b", "../x", "-r", "a b", "r\n", "é",
                                 "x" * 256, None])
def test_bad_ref_names_are_refused(store, bad):
    store.put(D, DATA)
    for call in (lambda: store.put_ref(bad, D), lambda: store.get_ref(bad),
                 lambda: store.delete_ref(bad)):
        with pytest.raises(StoreError) as e:
            call()
        assert e.value.reference == "invalid-name"


def test_bad_descriptor_fields_are_refused(store):
    store.put(D, DATA)
    with pytest.raises(StoreError, match="media type"):
        store.put_ref("r", D, media_type="not a media type")
    with pytest.raises(StoreError, match="ref name"):
        store.put_ref("r", D, annotations={"org.opencontainers.image.ref.name": "x"})
    assert store.list_refs() == []


# -- records -------------------------------------------------------------------------------


def test_records_round_trip(store):
    assert store.get_record("keys/v1", "abc") is None
    assert store.list_records("keys/v1") == []
    store.put_record("keys/v1", "abc", {"layer": D, "n": [1, 2]})
    assert store.get_record("keys/v1", "abc") == {"layer": D, "n": [1, 2]}
    store.put_record("keys/v1", "abc", {"layer": D_OTHER})  # last writer wins
    store.put_record("keys/v1", "def", {})
    store.put_record("other", "abc", {"x": 1})
    assert store.get_record("keys/v1", "abc") == {"layer": D_OTHER}
    assert store.list_records("keys/v1") == ["abc", "def"]
    store.delete_record("keys/v1", "abc")
    store.delete_record("keys/v1", "abc")  # idempotent
    assert store.get_record("keys/v1", "abc") is None
    assert store.get_record("other", "abc") == {"x": 1}


@pytest.mark.parametrize(("namespace", "name"), [
    ("keys/v1", "../x"), ("keys/v1", ".."), ("keys/v1", "a/b"), ("keys/v1", ""),
    ("keys/v1", ".hidden"), ("../keys", "a"), ("/keys", "a"), ("keys//v1", "a"),
    ("blobs/sha256", "a"), ("", "a"), ("Keys", "a"), ("keys/v1/", "a"),
])
def test_bad_record_names_are_refused(store, namespace, name):
    with pytest.raises(StoreError) as e:
        store.put_record(namespace, name, {})
    assert e.value.reference == "invalid-name"
    with pytest.raises(StoreError):
        store.get_record(namespace, name)


@pytest.mark.parametrize("obj", [[1, 2], "s", {"x": float("nan")}, {"x": object()}])
def test_records_must_be_json_objects(store, obj):
    with pytest.raises(StoreError):
        store.put_record("keys/v1", "a", obj)
    assert store.get_record("keys/v1", "a") is None


def test_key_records(store):
    key = digest_bytes(b"the key")
    assert get_key_record(store, key) is None
    rec = KeyRecord(layer=D, toc=D_OTHER, diff_id=D, size=len(DATA),
                    built_from={"base": "debian12"}, extra={"future": True})
    put_key_record(store, key, rec)
    assert get_key_record(store, key) == rec
    assert store.list_records("keys/v1") == [key.removeprefix("sha256:")]
    store.put_record("keys/v1", key.removeprefix("sha256:"), {"layer": D})
    with pytest.raises(StoreError, match="lacks toc, diff_id, size"):
        get_key_record(store, key)


# -- helpers over the interface ------------------------------------------------------------


def test_put_file(store, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(DATA)
    info = put_file(store, path)
    assert (info.digest, info.size) == (D, len(DATA))
    assert read_bytes(store, D) == DATA


def test_put_json_and_get_json_are_canonical(store):
    a = put_json(store, {"b": 1, "a": [1, "é"]})
    b = put_json(store, {"a": [1, "é"], "b": 1})
    assert a == b
    assert read_bytes(store, a.digest) == b'{"a":[1,"\\u00e9"],"b":1}'
    assert get_json(store, a.digest) == {"a": [1, "é"], "b": 1}
    store.put_ref("m", a.digest)
    with pytest.raises(StoreError, match="parse JSON blob"):
        get_json(store, put_bytes(store, b"\x00not json"))


def test_copy_blobs_copies_only_missing(store):
    src = MemoryStore()
    for blob in (DATA, OTHER, b"third"):
        put_bytes(src, blob)
    store.put(D, DATA)
    copied = copy_blobs(src, store, [D, D_OTHER, digest_bytes(b"third"), D_OTHER])
    assert copied == [D_OTHER, digest_bytes(b"third")]
    assert src.calls["get"] == 2
    assert read_bytes(store, digest_bytes(b"third")) == b"third"
    assert copy_blobs(src, store, [D, D_OTHER]) == []


def test_copy_refuses_a_corrupt_source(backend):
    src = MemoryStore()
    put_bytes(src, DATA)
    src.blobs[D] = b"X" + DATA[1:]
    with pytest.raises(DigestMismatch):
        copy_blobs(src, backend.store, [D])
    assert not backend.store.exists(D)


def test_second_handle_sees_the_same_store(backend):
    backend.store.put(D, DATA)
    backend.store.put_ref("r", D)
    backend.store.put_record("keys/v1", "k", {"a": 1})
    other = backend.reopen()
    assert read_bytes(other, D) == DATA
    assert other.get_ref("r").digest == D
    assert other.get_record("keys/v1", "k") == {"a": 1}


# -- optional capabilities (envbuild.store.base: TailReader, LocalBlobPaths, ...) ------------

from envbuild.store import open_store  # noqa: E402
from envbuild.store._http import RangeClient  # noqa: E402
from envbuild.store.base import (  # noqa: E402
    CAPABILITIES,
    BlobMounter,
    ConditionalRecords,
    LocalBlobPaths,
    Locatable,
    Presigner,
    RangeReader,
    StoreLocation,
    TailReader,
    capabilities,
)
from tests.store.conftest import BACKEND_TYPES, declaring  # noqa: E402

#: What each backend declares; a change here is a change of what callers may rely on.
DECLARED = {
    "memory": frozenset({ConditionalRecords}),
    "local": frozenset({TailReader, LocalBlobPaths, Locatable, ConditionalRecords}),
    "s3": frozenset({TailReader, Locatable, Presigner, ConditionalRecords}),
    **dict.fromkeys(("registry", "registry-auth", "registry-token"),
                    frozenset({TailReader, Locatable, BlobMounter})),
}


def test_every_backend_is_pinned_in_declared():
    assert set(DECLARED) == set(BACKEND_TYPES)


def test_declared_capabilities_match_the_methods(backend):
    """A backend declares exactly what it implements: the structural (``runtime_checkable``)
    check agrees with the declaration, so an undeclared method with a similar name is not
    mistaken for the capability, and every store is a ``RangeReader``."""
    store = backend.store
    name = next(n for n, cls in BACKEND_TYPES.items() if type(store) is cls)
    assert capabilities(store) == DECLARED[name]
    assert isinstance(store, RangeReader)
    for cap in CAPABILITIES:
        assert isinstance(store, cap) == (cap in DECLARED[name]), cap.__name__


@pytest.mark.parametrize("declared", declaring(TailReader), indirect=True)
@pytest.mark.parametrize("length", [1, 80, len(DATA), len(DATA) + 100])
def test_tail_reader(declared, length):
    store = declared.store
    store.put(D, DATA)
    assert store.get_tail(D, length) == (DATA[-length:], len(DATA))


@pytest.mark.parametrize("declared", declaring(TailReader), indirect=True)
def test_tail_reader_edges(declared):
    store = declared.store
    empty = digest_bytes(b"")
    store.put(empty, b"")
    assert store.get_tail(empty, 80) == (b"", 0)
    with pytest.raises(BlobNotFound):
        store.get_tail(ABSENT, 80)
    for bad in (0, -1):
        with pytest.raises(StoreError) as e:
            store.get_tail(empty, bad)
        assert e.value.reference == "invalid-range"
    with pytest.raises(StoreError) as e:
        store.get_tail("sha256:../../etc/passwd", 10)
    assert e.value.reference == "invalid-digest"


@pytest.mark.parametrize("declared", declaring(LocalBlobPaths), indirect=True)
def test_local_blob_paths(declared):
    store = declared.store
    assert not store.blob_path(D).exists()  # the path of an absent blob: no error, no file
    store.put(D, DATA)
    assert store.blob_path(D).is_file() and store.blob_path(D).read_bytes() == DATA
    store.delete(D)
    assert not store.blob_path(D).exists()
    with pytest.raises(StoreError) as e:
        store.blob_path("sha256:../../etc/passwd")
    assert e.value.reference == "invalid-digest"


@pytest.mark.parametrize("declared", declaring(Locatable), indirect=True)
def test_locatable_reopens_the_same_store(declared, monkeypatch):
    from tests.store.s3server import CREDENTIALS

    for k, v in CREDENTIALS.items():  # the contract: credentials come from the environment
        monkeypatch.setenv(k, v)
    store = declared.store
    loc = store.location()
    assert isinstance(loc, StoreLocation)
    other = open_store(loc.url, s3_endpoint=loc.s3_endpoint)
    store.put(D, DATA)
    assert read_bytes(other, D) == DATA
    other.put(D_OTHER, OTHER)
    assert store.exists(D_OTHER)
    assert other.location() == loc


@pytest.mark.parametrize("declared", declaring(Presigner), indirect=True)
def test_presigner_urls_serve_plain_ranged_gets(declared):
    store = declared.store
    store.put(D, DATA)
    url = store.presigned_get_url(D, expires=600)
    assert url.startswith(("http://", "https://"))
    client = RangeClient(attempts=1)
    got = client.get(url, 100, 50)
    assert got.status == 206 and got.body == DATA[100:150]
    assert client.get(url, len(DATA) - 3, 10).body == DATA[-3:]
    assert client.get(store.presigned_get_url(ABSENT), 0, 1).status == 404
    with pytest.raises(StoreError):
        store.presigned_get_url(D, expires=0)


@pytest.mark.parametrize("declared", declaring(Presigner), indirect=True)
def test_presigner_record_urls_take_a_plain_put(declared):
    """A record written with a plain PUT to its presigned URL (how the removed FUSE daemon
    saved a profile) is the record ``get_record`` reads; a second PUT replaces it; names are
    checked as ``put_record`` checks them."""
    from envbuild.store._http import put_bytes
    from envbuild.store.base import encode_record

    store = declared.store
    ns, name = "lazy-profiles", "cd" * 32
    url = store.presigned_put_record_url(ns, name, expires=600)
    assert url.startswith(("http://", "https://"))
    assert store.get_record(ns, name) is None   # making the URL writes nothing
    assert put_bytes(url, encode_record({"version": 1, "n": 1})).status in (200, 201, 204)
    assert store.get_record(ns, name) == {"version": 1, "n": 1}
    assert put_bytes(url, encode_record({"version": 1, "n": 2})).status in (200, 201, 204)
    assert store.get_record(ns, name) == {"version": 1, "n": 2}
    assert name in store.list_records(ns)
    with pytest.raises(StoreError):
        store.presigned_put_record_url(ns, "../escape", expires=600)
    with pytest.raises(StoreError):
        store.presigned_put_record_url(ns, name, expires=0)
    # an unanswerable URL is an answer with status 0 and a reason, not an exception
    bad = put_bytes("http://127.0.0.1:9/x", b"{}", attempts=1, timeout=2)
    assert bad.status == 0 and bad.error


@pytest.mark.parametrize("declared", declaring(ConditionalRecords), indirect=True)
def test_conditional_records(declared):
    """Create only if absent (of 8 racing creators exactly one wins), replace and delete only
    the version last seen; a stale tag changes nothing."""
    import concurrent.futures

    store = declared.store
    ns, name = "leases/v1", "ab" * 32
    assert store.get_record_tagged(ns, name) is None
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(lambda i: store.create_record(ns, name, {"owner": i}), range(8)))
    winners = [i for i, tag in enumerate(wins) if tag is not None]
    assert len(winners) == 1
    obj, tag = store.get_record_tagged(ns, name)
    assert obj == {"owner": winners[0]} and tag == wins[winners[0]]
    assert store.get_record(ns, name) == obj
    new_tag = store.replace_record(ns, name, {"owner": "b"}, tag)
    assert new_tag and new_tag != tag
    assert store.replace_record(ns, name, {"owner": "c"}, tag) is None  # stale
    assert store.get_record_tagged(ns, name) == ({"owner": "b"}, new_tag)
    assert not store.delete_record_if(ns, name, tag)
    assert store.get_record(ns, name) == {"owner": "b"}
    assert store.delete_record_if(ns, name, new_tag)
    assert store.get_record_tagged(ns, name) is None
    assert store.replace_record(ns, name, {"owner": "d"}, new_tag) is None  # gone: no resurrect
    assert not store.delete_record_if(ns, name, new_tag)
    assert store.get_record(ns, name) is None
    assert store.create_record(ns, name, {"owner": "e"})
    assert store.create_record(ns, name, {"owner": "f"}) is None
