"""The tar-order window of a lazy mount's read misses (``_Frames.following``) and the profile
prefetch's batching (``prefetch_in_order``), on a fake layer that records what it is asked."""

from __future__ import annotations

import stat
import threading

from runtime_shim.lazyfs.frames import WINDOW_MAX_FILE, _Frames, prefetch_in_order
from runtime_shim.lazyfs.tree import Node

KiB = 1 << 10


class FakeLayer:
    """What ``_Frames`` needs of a ``LazyLayer``: ``prefetch(paths, workers=)``, recorded."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def prefetch(self, paths, *, workers=None):
        with self.lock:  # (``_Frames`` adds the files sharing a frame: deduplicated)
            self.calls.append(list(dict.fromkeys(paths)))
        return len(paths)


def files(sizes: list[int]) -> dict[str, Node]:
    """Regular files f0, f1, ... laid out one after another in the blob, one frame each
    (a large file: one frame per 4 MiB), each frame as big as the file (incompressible)."""
    nodes: dict[str, Node] = {"": Node(1, stat.S_IFDIR | 0o755, 0, 0, 0, children={})}
    offset = 0
    for i, size in enumerate(sizes):
        frames = tuple(offset + k * (4 << 20) for k in range(max(1, -(-size // (4 << 20)))))
        nodes[f"f{i}"] = Node(i + 2, stat.S_IFREG | 0o644, 0, 0, 0, size=size,
                              read_path=f"f{i}", frames=frames)
        offset += max(size, 1)
    return nodes


def names(nodes: list[Node]) -> list[str]:
    return [n.read_path for n in nodes]


def test_the_window_is_the_following_small_files_within_the_budget():
    nodes = files([100 * KiB] * 20)
    frames = _Frames(FakeLayer(), nodes)  # type: ignore[arg-type]
    # 350 KiB after the end of f3's frame start: f4, f5, f6 (f7 starts 400 KiB after f3)
    assert names(frames.following(nodes["f3"], 350 * KiB)) == ["f4", "f5", "f6"]
    assert frames.following(nodes["f19"], 1 << 20) == []  # the last file


def test_the_window_skips_loaded_and_inflight_frames_and_stops_at_a_large_file():
    nodes = files([100 * KiB] * 5 + [WINDOW_MAX_FILE + 1] + [100 * KiB] * 5)
    frames = _Frames(FakeLayer(), nodes)  # type: ignore[arg-type]
    frames.loaded.add(nodes["f2"].frames[0])
    frames.inflight.add(nodes["f3"].frames[0])
    assert names(frames.following(nodes["f0"], 4 << 20)) == ["f1", "f4"]  # f5 is large


def test_a_miss_window_is_one_load_and_marks_every_frame_loaded():
    layer = FakeLayer()
    nodes = files([100 * KiB] * 10)
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    window = [nodes["f0"], *frames.following(nodes["f0"], 300 * KiB)]
    frames.load(window)
    assert layer.calls == [["f0", "f1", "f2", "f3"]]
    assert not any(frames.missing(nodes[f"f{i}"]) for i in range(4))
    assert frames.missing(nodes["f4"])
    assert names(frames.following(nodes["f0"], 300 * KiB)) == []  # nothing left to fetch


def test_profile_prefetch_goes_in_small_batches_in_order_and_stops_guessing():
    layer = FakeLayer()
    nodes = files([256 * KiB] * 40)  # 10 MiB
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    order = [f"f{i}" for i in reversed(range(40))]
    assert prefetch_in_order(frames, nodes, order, first_batch=512 * KiB,
                             max_batch=2 << 20, workers=1) == 40
    assert frames.profiled
    batches = layer.calls
    assert [p for b in batches for p in b] == order  # every file once, in profile order
    assert len(batches[0]) == 2 and all(len(b) <= 8 for b in batches)
    assert not any(frames.missing(n) for n in nodes.values() if n.read_path)
