"""Progress of long transfers: the line format, the throttling, the meter under threads, and
that ``sync`` counts what it reads (``envbuild.cli.progress``, ``envbuild.store.progress``)."""

from __future__ import annotations

import io
import threading

from envbuild.cli.progress import (
    PLAIN_INTERVAL,
    TTY_INTERVAL,
    TransferProgress,
    progress_line,
    summary_line,
)
from envbuild.sizes import human_size
from envbuild.store import MemoryStore, put_bytes, put_json
from envbuild.store.base import MEDIA_TYPE_CONFIG, VerifyingReader
from envbuild.store.progress import TransferMeter
from envbuild.store.sync import sync


def test_formats():
    assert human_size(0) == "0 B"
    assert human_size(999) == "999 B"
    assert human_size(1500) == "1.5 kB"
    assert human_size(42_000_000) == "42.0 MB"
    assert human_size(3.2e9) == "3.2 GB"
    assert progress_line("push", 4_200_000, 12_300_000, 0.5) == \
        "push: 4.2 MB / 12.3 MB (34%), 8.4 MB/s"
    assert progress_line("pull", 0, 0, 0.0) == "pull: 0 B / 0 B, -"
    assert summary_line("export", 12_300_000, 1.2) == "export: 12.3 MB in 1.2 s (10.2 MB/s)"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throttled_on_a_terminal_and_the_last_byte_always_drawn():
    out: list[str] = []
    clock = Clock()
    p = TransferProgress("push", live=True, tty=True, write=out.append, clock=clock)
    p.meter.expect(1000)
    assert len(out) == 1 and out[0].startswith("\rpush: 0 B / 1.0 kB (0%)")
    p.meter.add(100)                      # within the interval: not drawn
    clock.now += TTY_INTERVAL / 2
    p.meter.add(100)
    assert len(out) == 1
    clock.now += TTY_INTERVAL
    p.meter.add(100)                      # the interval passed: drawn in place
    assert len(out) == 2 and out[1].startswith("\rpush: 300 B / 1.0 kB (30%)")
    assert out[1].endswith("\x1b[K")
    p.meter.add(700)                      # the end is drawn however soon it comes
    assert len(out) == 3 and "(100%)" in out[2]
    clock.now += 1.0
    p.finish()
    assert out[3] == "\r\x1b[K"           # the drawn line is cleared, then the summary
    assert out[4] == "push: 1.0 kB in 1.3 s (769 B/s)\n"  # 1000 B / 1.3 s


def test_plain_mode_writes_whole_lines_less_often_and_never_mode_only_the_summary():
    out: list[str] = []
    clock = Clock()
    p = TransferProgress("pull", live=True, tty=False, write=out.append, clock=clock)
    p.meter.expect(10)
    clock.now += TTY_INTERVAL * 2         # a terminal would redraw; a log waits longer
    p.meter.add(1)
    clock.now += PLAIN_INTERVAL
    p.meter.add(1)
    p.meter.add(8)
    p.finish()
    assert all(line.endswith("\n") and "\r" not in line for line in out)
    assert [line.split(" (")[0] for line in out[:-1]] == [
        "pull: 0 B / 10 B", "pull: 2 B / 10 B", "pull: 10 B / 10 B"]
    assert out[-1].startswith("pull: 10 B in ")

    quiet: list[str] = []
    q = TransferProgress("pull", live=False, tty=True, write=quiet.append, clock=Clock())
    q.meter.expect(10)
    q.meter.add(10)
    q.finish()
    assert quiet == ["pull: 10 B in 0.0 s (-)\n"]


def test_meter_counts_exactly_from_many_threads():
    calls: list[tuple[int, int]] = []
    meter = TransferMeter(lambda done, total: calls.append((done, total)))
    meter.expect(8 * 1000)

    def work() -> None:
        for _ in range(1000):
            meter.add(1)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (meter.done, meter.total) == (8000, 8000)
    assert len(calls) == 8001 and max(calls) == (8000, 8000)


def test_track_watches_a_verifying_reader_without_replacing_it():
    data = b"x" * 5000
    store = MemoryStore()
    digest = put_bytes(store, data)
    meter = TransferMeter()
    with store.get(digest) as f:
        assert meter.track(f) is f and isinstance(f, VerifyingReader)
        assert f.read(1000) == data[:1000]
        assert meter.done == 1000
        f.read()
    assert meter.done == 5000
    plain = io.BytesIO(b"abc")
    assert meter.track(plain) is plain  # not a store's stream: returned as it is, uncounted


def test_sync_expects_then_counts_the_bytes_it_copies():
    src, dst = MemoryStore(), MemoryStore()
    layer = put_bytes(src, b"L" * 300_000)
    config = put_json(src, {"rootfs": {"diff_ids": []}}, media_type=MEDIA_TYPE_CONFIG)
    lock = put_json(src, {"schemaVersion": 2, "config": config.to_oci(),
                          "layers": [{"mediaType": "application/octet-stream",
                                      "digest": layer, "size": 300_000}]})
    src.put_ref("env/x", lock.digest)
    seen: list[tuple[int, int]] = []
    meter = TransferMeter(lambda done, total: seen.append((done, total)))
    sync(src, dst, refs=["env/x"], meter=meter)
    total = 300_000 + config.size + lock.size
    assert (meter.done, meter.total) == (total, total)
    assert seen[0] == (0, 300_000 + config.size)  # the leaves' total, known before a byte
    again = TransferMeter()
    sync(src, dst, refs=["env/x"], meter=again)    # nothing left to copy
    assert (again.done, again.total) == (0, 0)
