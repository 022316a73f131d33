"""A passthrough open that misses (``PassthroughFS._fetch``): it waits for its own file's
frames only, while the rest of the tar-order miss window is fetched beside it in a second
request — the same files as one window, never waiting for the window's transfer. On a fake
layer that records (and can hold back) what it is asked; no mount."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from runtime_shim.lazyfs.passthrough import PassthroughFS
from tests.unit.test_lazy_frames import KiB, files


class HeldLayer:
    """``prefetch`` records its paths and blocks while ``hold`` names one of them."""

    digest = "sha256:" + "0" * 64

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.hold: set[str] = set()
        self.release = threading.Event()
        self.lock = threading.Lock()

    def prefetch(self, paths, *, workers=None, on_frames=None, max_run=None, merge_gap=None):
        paths = list(dict.fromkeys(paths))
        with self.lock:
            self.calls.append(paths)
        if self.hold & set(paths):
            assert self.release.wait(10)
        return len(paths)

    def read(self, path: str) -> bytes:
        return b"x"


def test_a_miss_waits_for_its_own_frames_while_the_window_comes_beside_it():
    layer = HeldLayer()
    nodes = files([100 * KiB] * 6)
    with ThreadPoolExecutor(4) as workers:
        fs = PassthroughFS(layer, nodes, "/nonexistent", None,  # type: ignore[arg-type]
                           workers=workers)
        layer.hold = {"f1"}   # the window's request does not answer yet
        assert fs._fetch(nodes["f0"]) == b"x"
        # the open got its file although the window is still in flight
        assert not fs.lazy_frames.missing(nodes["f0"])
        assert fs.lazy_frames.missing(nodes["f1"])
        with fs.lazy_frames.cv:
            assert set(nodes["f1"].frames) <= fs.lazy_frames.inflight
        layer.release.set()
    with layer.lock:
        calls = sorted(layer.calls, key=len)
    # two requests: the file alone, then the rest of the window (the 1 MiB after it)
    assert calls[:2] == [["f0"], ["f1", "f2", "f3", "f4", "f5"]]
    assert not any(fs.lazy_frames.missing(n) for p, n in nodes.items() if p)


def test_a_second_reader_of_the_window_waits_for_it_instead_of_fetching_again(monkeypatch):
    monkeypatch.setattr("runtime_shim.lazyfs.frames.HEDGE_AFTER", 0.0)   # never hedged
    layer = HeldLayer()
    nodes = files([100 * KiB] * 4)
    with ThreadPoolExecutor(4) as workers:
        fs = PassthroughFS(layer, nodes, "/nonexistent", None,  # type: ignore[arg-type]
                           workers=workers)
        layer.hold = {"f1"}
        fs._fetch(nodes["f0"])
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(fs._fetch(nodes["f2"])))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not got   # f2 is in the window's request: it waits for it
        layer.release.set()
        t.join(10)
        assert got == [b"x"]
    with layer.lock:
        assert sorted(map(tuple, layer.calls)) == [("f0",), ("f1", "f2", "f3")]


def test_a_reader_kept_waiting_by_anothers_read_sends_its_own(monkeypatch):
    monkeypatch.setattr("runtime_shim.lazyfs.frames.HEDGE_AFTER", 0.05)
    layer = HeldLayer()
    nodes = files([100 * KiB] * 4 + [300 * KiB])
    with ThreadPoolExecutor(4) as workers:
        fs = PassthroughFS(layer, nodes, "/nonexistent", None,  # type: ignore[arg-type]
                           workers=workers)
        layer.hold = {"f1"}   # the window's read (f1..f4) does not answer
        fs._fetch(nodes["f0"])
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(fs._fetch(nodes["f2"])))
        t.start()
        t.join(0.02)
        assert t.is_alive() and not got   # within HEDGE_AFTER it waits for the window
        t.join(5)
        assert got == [b"x"]   # then its own read: answered while the window is still held
        assert not fs.lazy_frames.missing(nodes["f2"])
        assert fs.lazy_frames.missing(nodes["f3"]) and fs.lazy_frames.hedged == 1
        # a large file is not read twice: it waits for the window
        big: list[bytes] = []
        t2 = threading.Thread(target=lambda: big.append(fs._fetch(nodes["f4"])))
        t2.start()
        t2.join(0.3)
        assert t2.is_alive() and fs.lazy_frames.hedged == 1
        layer.release.set()
        t2.join(10)
        assert big == [b"x"]
    with layer.lock:
        assert sorted(map(tuple, layer.calls)) == [("f0",), ("f1", "f2", "f3", "f4"), ("f2",)]
