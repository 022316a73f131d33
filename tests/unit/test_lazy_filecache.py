"""The node's file cache and fetch limits (``runtime_shim.lazyfs.filecache``) and the FUSE
passthrough ABI constants (``runtime_shim.lazyfs.passthrough``), without FUSE: the real kernel
path is in tests/integration/test_lazy_passthrough.py."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from envbuild.errors import CorruptLayerError, RuntimeShimError
from runtime_shim.lazyfs.filecache import (
    BoundedRanges,
    FetchLimits,
    FetchSettings,
    FetchTimeout,
    FileCache,
)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _cache(tmp_path, timeout: float = 5.0, concurrency: int = 4) -> FileCache:
    return FileCache(str(tmp_path / "files"), FetchLimits(FetchSettings(concurrency, timeout)),
                     1 << 30)


def test_concurrent_callers_share_one_fetch(tmp_path):
    cache = _cache(tmp_path)
    data = os.urandom(1 << 16)
    calls = []
    gate = threading.Event()

    def fetch() -> bytes:
        calls.append(1)
        gate.wait(5)
        return data

    paths: list[str] = []
    threads = [threading.Thread(target=lambda: paths.append(cache.path(_digest(data), fetch,
                                                                       "f")))
               for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    gate.set()
    for t in threads:
        t.join(5)
    assert len(calls) == 1 and len(paths) == 8 and len(set(paths)) == 1
    with open(paths[0], "rb") as f:
        assert f.read() == data
    assert cache.fetches == 1
    assert cache.path(_digest(data), fetch, "f") == paths[0] and len(calls) == 1


def test_a_fetch_that_does_not_finish_is_a_timeout_and_a_later_caller_gets_the_file(tmp_path):
    cache = _cache(tmp_path, timeout=0.2)
    data = b"late"
    gate = threading.Event()

    def fetch() -> bytes:
        gate.wait(5)
        return data

    t0 = time.monotonic()
    with pytest.raises(FetchTimeout, match="did not answer within 0.2 s"):
        cache.path(_digest(data), fetch, "open x")
    assert time.monotonic() - t0 < 2
    gate.set()
    deadline = time.monotonic() + 5
    while cache.cached(_digest(data)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cache.cached(_digest(data)) is not None


def test_a_failed_fetch_reaches_every_waiter_and_caches_nothing(tmp_path):
    cache = _cache(tmp_path)

    def fetch() -> bytes:
        raise RuntimeShimError("content does not match its TOC digest")

    with pytest.raises(RuntimeShimError, match="does not match"):
        cache.path(_digest(b"x"), fetch, "f")
    assert [p for p in os.listdir(cache.dir)] == []


def test_a_cache_file_that_does_not_match_its_digest_is_dropped(tmp_path):
    cache = _cache(tmp_path)
    d = _digest(b"good")
    with open(os.path.join(cache.dir, d[7:]), "wb") as f:
        f.write(b"evil")
    assert cache.cached(d) is None
    assert not os.path.exists(os.path.join(cache.dir, d[7:]))
    assert cache.path(d, lambda: b"good", "f").endswith(d[7:])


def test_bad_digests_are_refused(tmp_path):
    cache = _cache(tmp_path)
    with pytest.raises(RuntimeShimError, match="bad content digest"):
        cache.cached("sha256:../../etc/passwd")
    bare = _digest(b"good")[7:]   # a digest without its algorithm: one form only
    with open(os.path.join(cache.dir, bare), "wb") as f:
        f.write(b"good")
    with pytest.raises(RuntimeShimError, match="bad content digest"):
        cache.cached(bare)
    assert os.path.exists(os.path.join(cache.dir, bare))   # not taken for a corrupt file


def test_eviction_keeps_the_cache_under_its_budget(tmp_path):
    cache = FileCache(str(tmp_path / "files"), FetchLimits(FetchSettings()), 3000)
    for i in range(10):
        data = bytes([i]) * 1000
        cache.path(_digest(data), lambda data=data: data, "f")
    total = sum(os.path.getsize(os.path.join(cache.dir, n)) for n in os.listdir(cache.dir))
    assert total <= 3000


class _SlowStore:
    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        time.sleep(0.02)
        return b"\0" * length


def test_the_node_budget_bounds_requests_in_flight():
    limits = FetchLimits(FetchSettings(concurrency=2, timeout=5))
    store = BoundedRanges(_SlowStore(), limits)
    threads = [threading.Thread(target=store.get_range, args=("d", 0, 10)) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert limits.max_in_flight == 2
    assert not hasattr(store, "get_tail")  # a TailReader only if the store is one


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("ENVBUILD_LAZY_FETCH_CONCURRENCY", "3")
    monkeypatch.setenv("ENVBUILD_LAZY_FETCH_TIMEOUT", "1.5")
    assert FetchSettings.from_env() == FetchSettings(3, 1.5)
    assert FetchSettings.from_env(7, None) == FetchSettings(7, 1.5)
    monkeypatch.setenv("ENVBUILD_LAZY_FETCH_CONCURRENCY", "lots")
    with pytest.raises(RuntimeShimError, match="is not a number"):
        FetchSettings.from_env()
    with pytest.raises(RuntimeShimError, match="out of range"):
        FetchSettings.from_env(0, 1)


def test_the_passthrough_abi_constants():
    from runtime_shim.lazyfs import fusewire as fw
    from runtime_shim.lazyfs import passthrough as pt

    # include/uapi/linux/fuse.h: _IOW(229, 1, struct fuse_backing_map), _IOW(229, 2, uint32_t)
    assert pt.FUSE_DEV_IOC_BACKING_OPEN == 0x4010E501
    assert pt.FUSE_DEV_IOC_BACKING_CLOSE == 0x4004E502
    assert fw.FUSE_PASSTHROUGH >> 32 == 1 << 5
    assert fw._INIT_OUT.size == 64 and fw._ATTR.size == 88 and fw._OPEN_OUT.size == 16
    assert fw._IN_HEADER.size == 40 and fw._OUT_HEADER.size == 16
    assert fw._encode_dev(os.makedev(0, 0)) == 0
    assert fw._encode_dev(os.makedev(8, 1)) == (8 << 8) | 1
    assert fw._encode_dev(os.makedev(1, 300)) == (300 & 0xFF) | (1 << 8) | ((300 & ~0xFF) << 12)


def test_the_passthrough_switch(monkeypatch):
    from runtime_shim.lazyfs.passthrough import passthrough_wanted

    for raw, want in (("off", False), ("0", False), ("on", True), ("1", True), ("auto", None)):
        monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", raw)
        assert passthrough_wanted() is want
    monkeypatch.delenv("ENVBUILD_LAZY_PASSTHROUGH")
    assert passthrough_wanted() is None


def test_pieces_are_written_as_they_come_and_a_failing_stream_leaves_nothing(tmp_path):
    cache = _cache(tmp_path)
    data = b"a" * 1000 + b"b" * 1000
    digest = _digest(data)
    assert open(cache.path(digest, lambda: iter([data[:1000], data[1000:]]), "f"),
                "rb").read() == data

    def bad():
        yield b"x" * 10
        raise CorruptLayerError("content of f does not match its TOC digest")

    other = _digest(b"y")
    with pytest.raises(CorruptLayerError):
        cache.path(other, bad, "g")
    assert sorted(os.listdir(cache.dir)) == [digest.removeprefix("sha256:")]  # no temp file


def test_preload_writes_the_file_in_the_background_once(tmp_path):
    cache = _cache(tmp_path)
    data = b"preloaded"
    digest = _digest(data)
    calls = []
    done = threading.Event()

    def fetch():
        calls.append(1)
        done.set()
        return data

    cache.preload(digest, fetch, "f")
    assert done.wait(5)
    for _ in range(100):
        if digest in cache._verified:
            break
        time.sleep(0.01)
    cache.preload(digest, fetch, "f")  # present: not again
    assert cache.path(digest, lambda: b"never", "f").endswith(digest.removeprefix("sha256:"))
    assert calls == [1]


def test_background_requests_wait_for_a_readers_requests_in_flight_but_not_forever(monkeypatch):
    import runtime_shim.lazyfs.filecache as fc
    from envbuild.store.lazy import background

    limits = FetchLimits(FetchSettings(4, 5.0))
    order: list[str] = []
    started = threading.Event()
    release = threading.Event()

    def demand() -> None:
        def slow():
            started.set()
            release.wait(5)
            order.append("demand")
        limits.request(slow)

    def guess() -> None:
        with background():
            limits.request(lambda: order.append("background"))

    t = threading.Thread(target=demand)
    t.start()
    assert started.wait(5)
    g = threading.Thread(target=guess)
    g.start()
    time.sleep(fc.BACKGROUND_YIELD / 4)
    assert order == []           # the reader's request is in flight: the guess waits
    release.set()
    t.join(5)
    g.join(5)
    assert order == ["demand", "background"]
    # a reader's request that never ends holds a background request back only briefly
    monkeypatch.setattr(fc, "BACKGROUND_YIELD", 0.05)
    hold = threading.Event()
    threading.Thread(target=limits.request, args=(lambda: hold.wait(5),), daemon=True).start()
    time.sleep(0.02)
    t0 = time.monotonic()
    with background():
        limits.request(lambda: None)
    assert 0.02 <= time.monotonic() - t0 < 2
    hold.set()


def test_the_preload_queue_is_bounded_and_drops_the_oldest(tmp_path, monkeypatch):
    import runtime_shim.lazyfs.filecache as fc

    monkeypatch.setattr(fc, "PRELOAD_QUEUE", 3)
    cache = _cache(tmp_path)
    gate = threading.Event()
    first = _digest(b"first")
    cache.preload(first, lambda: (gate.wait(5), b"first")[1], "first")  # holds the writer
    time.sleep(0.05)
    datas = [f"f{i}".encode() for i in range(5)]
    for d in datas:
        cache.preload(_digest(d), lambda d=d: d, d.decode())
    assert [what for _, _, what in cache._preloads] == ["f2", "f3", "f4"]
    gate.set()
    for _ in range(200):
        if _digest(b"f4") in cache._verified:
            break
        time.sleep(0.01)
    assert {_digest(d) for d in datas[2:]} <= cache._verified
    assert _digest(b"f0") not in cache._verified  # dropped: an open writes it when needed
