"""LazyLayer and the chunk cache (envbuild.store.lazy) over a MemoryStore: request counts,
merged reads, verification, content-keyed cache hits across layers."""

from __future__ import annotations

import io
import os
import random

import pytest

from envbuild.errors import CorruptLayerError, LayerError
from envbuild.layers import pack_tree
from envbuild.store import MemoryStore, put_bytes
from envbuild.store.lazy import LazyLayer, MemoryChunkCache

MiB = 1 << 20
BIG = random.Random(1).randbytes(9 * MiB // 2)  # 4.5 MiB: two frames of its own


def make_tree(root, extra: bytes = b""):
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "hello.txt").write_bytes(b"hello\n" + extra)
    (root / "dir" / "a.txt").write_bytes(b"a" * 100)
    (root / "dir" / "sub" / "b.bin").write_bytes(random.Random(2).randbytes(40_000))
    (root / "big.bin").write_bytes(BIG)
    for i in range(30):
        (root / "dir" / f"f{i:02}.py").write_bytes(f"print({i})\n".encode() * (2000 + i))
    os.link(root / "dir" / "a.txt", root / "dir" / "a-link")
    os.symlink("a.txt", root / "dir" / "a-sym")
    return root


def put_layer(store, root) -> tuple[str, int, str]:
    out = io.BytesIO()
    info = pack_tree(root, out)
    return put_bytes(store, out.getvalue()), info.size, info.toc_digest


@pytest.fixture
def layer(tmp_path):
    store = MemoryStore()
    digest, size, toc = put_layer(store, make_tree(tmp_path / "t"))
    return store, digest, size, toc


def test_open_is_one_ranged_read_when_the_size_is_known(layer):
    store, digest, size, toc = layer
    lazy = LazyLayer(store, digest, size=size, expected_toc_digest=toc)
    assert store.calls["get_range"] == 1 and store.calls["stat"] == 0
    assert lazy.stats.requests == 1 and lazy.stats.bytes_fetched == lazy.stats.toc_bytes


def test_open_fetches_a_toc_larger_than_the_tail_guess(layer, monkeypatch):
    import envbuild.store.lazy as lazy_mod

    store, digest, size, toc = layer
    monkeypatch.setattr(lazy_mod, "TOC_GUESS", 100)  # the footer, not the whole TOC
    lazy = LazyLayer(store, digest, size=size, expected_toc_digest=toc)
    assert store.calls["get_range"] == 2 and lazy.stats.requests == 2
    assert lazy.read("hello.txt").startswith(b"hello")


def test_open_with_get_tail_needs_no_size(layer):
    store, digest, size, _ = layer

    class Tailing(MemoryStore):
        def get_tail(self, d, n):
            data = self.blobs[d]
            return data[-n:], len(data)

    tailing = Tailing()
    tailing.blobs = store.blobs
    lazy = LazyLayer(tailing, digest)
    assert lazy.stats.requests == 2 and tailing.calls["stat"] == 0


def test_wrong_toc_digest_is_refused(layer):
    store, digest, size, _ = layer
    with pytest.raises(CorruptLayerError, match="TOC digest mismatch"):
        LazyLayer(store, digest, size=size, expected_toc_digest="sha256:" + "0" * 64)


def test_stat_listdir_read(layer):
    store, digest, size, _ = layer
    lazy = LazyLayer(store, digest, size=size)
    assert lazy.listdir("") == ["big.bin", "dir", "hello.txt"]
    assert lazy.listdir("/dir/") == sorted(["a.txt", "a-link", "a-sym", "sub"]
                                           + [f"f{i:02}.py" for i in range(30)])
    with pytest.raises(LayerError, match="not a directory"):
        lazy.listdir("hello.txt")
    assert lazy.stat("dir/a-sym").linkname == "a.txt"
    requests = lazy.stats.requests
    assert lazy.read("hello.txt") == b"hello\n"
    assert lazy.stats.requests == requests + 1
    assert lazy.read("dir/a-link") == b"a" * 100  # a hardlink reads its target
    assert lazy.read("hello.txt", 2, 2) == b"ll"
    assert lazy.read("hello.txt", 10) == b""
    with pytest.raises(LayerError, match="not a regular file"):
        lazy.read("dir/a-sym")


def test_a_file_entry_is_decoded_from_the_toc_once_and_the_memo_is_bounded(layer,
                                                                            monkeypatch):
    import envbuild.store.lazy as lazy_mod

    store, digest, size, _ = layer
    lazy = LazyLayer(store, digest, size=size)
    decoded = []
    stat = lazy.reader.stat
    monkeypatch.setattr(lazy.reader, "stat", lambda p: decoded.append(p) or stat(p))
    assert lazy.read("dir/sub/b.bin") == random.Random(2).randbytes(40_000)
    assert decoded == ["dir/sub/b.bin"]
    for _ in range(3):
        assert lazy.read("dir/sub/b.bin", 5, 5) == random.Random(2).randbytes(40_000)[5:10]
        assert lazy.compressed_size("dir/sub/b.bin") > 0
        assert lazy.read("dir/a.txt") == b"a" * 100   # one of the pair is a hardlink
    assert decoded[0] == "dir/sub/b.bin" and len(decoded) <= 3   # b.bin once; a.txt's once
    monkeypatch.setattr(lazy_mod, "MAX_REMEMBERED_ENTRIES", 2)
    for name in ("f00.py", "f01.py", "f02.py"):
        assert lazy.read(f"dir/{name}").startswith(b"print(")
    assert len(lazy._files) <= 2 and len(lazy._piece_lists) <= 2
    with pytest.raises(LayerError, match="not a regular file"):   # errors are not remembered
        lazy.read("dir/a-sym")
    with pytest.raises(LayerError, match="not a regular file"):
        lazy.read("dir/a-sym")


def test_reading_one_file_fetches_only_its_frames(layer):
    store, digest, size, _ = layer
    lazy = LazyLayer(store, digest, size=size)
    before = lazy.stats.bytes_fetched
    assert lazy.read("dir/sub/b.bin") == random.Random(2).randbytes(40_000)
    fetched = lazy.stats.bytes_fetched - before
    assert fetched < 60_000 < size // 10


def test_big_file_range_and_merged_frames(layer):
    store, digest, size, _ = layer
    lazy = LazyLayer(store, digest, size=size)
    assert len(lazy.stat("big.bin").chunks) == 2
    before = lazy.stats.requests
    assert lazy.read("big.bin", 4 * MiB - 10, 20) == BIG[4 * MiB - 10:4 * MiB + 10]
    assert lazy.stats.requests == before + 1  # two adjacent frames, one request
    assert lazy.stats.frames_fetched == 2
    assert lazy.read("big.bin", 5, 10) == BIG[5:15]  # now from the cache
    assert lazy.stats.requests == before + 1


def test_prefetch_merges_and_then_reads_hit_the_cache(layer):
    store, digest, size, _ = layer
    lazy = LazyLayer(store, digest, size=size, workers=4)
    paths = [f"dir/f{i:02}.py" for i in range(30)] + ["dir/sub/b.bin", "dir", "missing"]
    assert lazy.prefetch(paths) == 31
    frames = lazy.stats.frames_fetched
    assert lazy.stats.requests - 2 < frames  # adjacent frames went together
    requests = lazy.stats.requests
    for i in range(30):
        assert lazy.read(f"dir/f{i:02}.py") == f"print({i})\n".encode() * (2000 + i)
    assert lazy.stats.requests == requests and lazy.stats.cache_hits >= 30


def test_same_file_in_another_layer_hits_the_cache(tmp_path):
    store = MemoryStore()
    d1, s1, _ = put_layer(store, make_tree(tmp_path / "one"))
    d2, s2, _ = put_layer(store, make_tree(tmp_path / "two", extra=b"different"))
    assert d1 != d2
    cache = MemoryChunkCache(64 * MiB)
    LazyLayer(store, d1, size=s1, chunk_cache=cache).read("big.bin")
    other = LazyLayer(store, d2, size=s2, chunk_cache=cache)
    assert other.read("big.bin") == BIG
    assert other.stats.requests == 1  # footer and TOC (one tail read) only
    assert other.stats.cache_hits == 2
    assert other.read("hello.txt") == b"hello\ndifferent"  # different content: fetched
    assert other.stats.requests == 2


def test_corrupt_frame_is_detected_and_not_cached(layer):
    store, digest, size, _ = layer
    lazy = LazyLayer(store, digest, size=size)
    c = lazy.stat("dir/sub/b.bin").chunks[0]
    blob = bytearray(store.blobs[digest])
    blob[c.offset + c.csize // 2] ^= 0xFF
    store.blobs[digest] = bytes(blob)
    cache = MemoryChunkCache()
    lazy = LazyLayer(store, digest, size=size, chunk_cache=cache)
    with pytest.raises(CorruptLayerError, match=f"{digest}.*(b.bin|offset {c.offset})"):
        lazy.read("dir/sub/b.bin")
    assert cache._items == {}


def test_http_ranges_use_the_store_once_the_url_expired(layer):
    """``HttpRanges`` (the filler's boto3-free reader) hands an expired presigned URL's reads to
    the full store, opened only then."""
    from envbuild.store.lazy import HttpRanges

    store, digest, size, toc = layer
    opened = []

    def fallback():
        opened.append(1)
        return store

    url = ("http://127.0.0.1:9/b/k?X-Amz-Date=20200101T000000Z&X-Amz-Expires=3600"
           "&X-Amz-Signature=x")
    ranges = HttpRanges(digest, url, fallback)
    assert ranges.expires < 1.6e9 and opened == []
    lazy = LazyLayer(ranges, digest, size=size, expected_toc_digest=toc)
    assert lazy.read("hello.txt") == b"hello\n" and opened == [1]


def test_stream_yields_a_big_file_in_order_one_request_per_frame(layer):
    store, digest, size, _ = layer
    cache = MemoryChunkCache()
    lazy = LazyLayer(store, digest, size=size, chunk_cache=cache)
    before = lazy.stats.requests
    pieces = list(lazy.stream("big.bin"))
    assert b"".join(pieces) == BIG and len(pieces) == 2
    assert lazy.stats.requests == before + 2  # each frame its own request (in parallel)
    assert lazy.stats.files_verified == 1
    assert lazy.read("big.bin", 5, 10) == BIG[5:15]  # verified pieces went to the cache
    assert lazy.stats.requests == before + 2
    assert b"".join(lazy.stream("big.bin")) == BIG  # and a second stream is all hits
    assert lazy.stats.requests == before + 2


def test_stream_raises_at_the_end_on_corrupt_content_and_caches_nothing(layer):
    store, digest, size, _ = layer
    lazy = LazyLayer(store, digest, size=size)
    # a second frame that decompresses fine but to other bytes: a content swap, found only
    # by the whole-file digest once every piece was yielded
    e = lazy.stat("big.bin")
    first, second = e.chunks
    import zstandard

    other = zstandard.ZstdCompressor().compress(bytes(second.usize))
    blob = bytearray(store.blobs[digest])
    assert len(other) <= second.csize
    blob[second.offset:second.offset + second.csize] = other + bytes(second.csize - len(other))
    store.blobs[digest] = bytes(blob)
    cache = MemoryChunkCache()
    lazy = LazyLayer(store, digest, size=size, chunk_cache=cache)
    got = []
    with pytest.raises(CorruptLayerError, match="big.bin"):
        for piece in lazy.stream("big.bin"):
            got.append(piece)
    assert cache._items == {}


def test_prefetch_reports_each_read_once_its_files_are_verified(layer):
    store, digest, size, _ = layer
    cache = MemoryChunkCache()
    lazy = LazyLayer(store, digest, size=size, chunk_cache=cache, workers=2)
    big = lazy.stat("big.bin")
    reports: list[list[int]] = []

    def on_frames(offsets):
        # every file wholly inside the reported frames is readable from the cache by now
        reports.append(sorted(offsets))
        if set(offsets) >= {c.offset for c in lazy.stat("dir/sub/b.bin").chunks}:
            assert cache.get(LazyLayer._pieces(lazy.stat("dir/sub/b.bin"))[0].key) is not None

    # max_run below a frame: the big file's two frames are two reads, reported one by one
    lazy.prefetch(["big.bin", "dir/sub/b.bin"], on_frames=on_frames, max_run=1)
    assert sorted(o for r in reports for o in r) == sorted(
        {c.offset for c in big.chunks} | {c.offset for c in lazy.stat("dir/sub/b.bin").chunks})
    assert len(reports) == 3
    assert lazy.read("big.bin") == BIG


class _Gauge(MemoryStore):
    """A ``MemoryStore`` that records how many ranged reads run at once, and on which
    threads."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.now = self.most = 0
        self.threads: set[str] = set()
        self._gauge = threading.Lock()

    def get_range(self, digest, offset, length):
        import threading
        import time

        with self._gauge:
            self.now += 1
            self.most = max(self.most, self.now)
            self.threads.add(threading.current_thread().name)
        time.sleep(0.01)
        try:
            return super().get_range(digest, offset, length)
        finally:
            with self._gauge:
                self.now -= 1


def test_parallel_reads_keep_to_their_worker_count_on_threads_kept_across_calls(tmp_path):
    """``_fetch_frames`` on the process's leaf pools: at most ``workers`` of one call's reads
    at once, the same threads (and so the same keep-alive connections) for the next call,
    and background work on a pool of its own."""
    from envbuild.store.lazy import background

    store = _Gauge()
    digest, size, _ = put_layer(store, make_tree(tmp_path / "t"))
    lazy = LazyLayer(store, digest, size=size)
    files = [f"dir/f{i:02}.py" for i in range(30)]
    store.threads.clear()
    lazy.prefetch(files[:15], workers=3, max_run=8 << 10, merge_gap=0)
    assert 1 < store.most <= 3
    first = set(store.threads)
    assert first and all(t.startswith("lazy-get_") for t in first), first
    store.most = 0
    lazy.prefetch(files[15:], workers=3, max_run=8 << 10, merge_gap=0)
    assert store.threads == first        # no new threads: their connections are reused
    assert 1 < store.most <= 3
    other = LazyLayer(store, digest, size=size)   # its TOC read on this thread
    store.threads.clear()
    with background():
        other.prefetch(files, workers=2, max_run=8 << 10, merge_gap=0)
    assert store.threads and all(t.startswith("lazy-get-bg_") for t in store.threads)


def test_a_stream_fetches_at_most_its_workers_ahead_of_its_consumer(tmp_path):
    store = _Gauge()
    root = tmp_path / "t"
    root.mkdir()
    big = random.Random(3).randbytes(20 * MiB)   # five frames of its own
    (root / "big.bin").write_bytes(big)
    digest, size, _ = put_layer(store, root)
    lazy = LazyLayer(store, digest, size=size)
    assert len(lazy.stat("big.bin").chunks) == 5
    calls = store.calls["get_range"]
    stream = lazy.stream("big.bin", workers=2)
    first = next(stream)
    import time

    time.sleep(0.2)   # a consumer that stops: no more than 2 frames were asked for
    assert store.calls["get_range"] - calls <= 2
    assert first + b"".join(stream) == big
    assert store.calls["get_range"] - calls == 5
