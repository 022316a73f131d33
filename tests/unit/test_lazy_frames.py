"""The tar-order window of a lazy mount's read misses (``_Frames.following``) and the profile
prefetch's batching (``prefetch_in_order``), on a fake layer that records what it is asked."""

from __future__ import annotations

import stat
import threading

import pytest

from runtime_shim.lazyfs.frames import WINDOW_MAX_FILE, _Frames, prefetch_in_order
from runtime_shim.lazyfs.tree import Node

KiB = 1 << 10


class FakeLayer:
    """What ``_Frames`` needs of a ``LazyLayer``: ``prefetch(paths, workers=)``, recorded."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def prefetch(self, paths, *, workers=None, on_frames=None, max_run=None, merge_gap=None):
        with self.lock:  # (``_Frames`` adds the files sharing a frame: deduplicated)
            self.calls.append(list(dict.fromkeys(paths)))
        return len(paths)


class SizedLayer(FakeLayer):
    """A ``FakeLayer`` that knows what each file's frames cost (default 4 KiB)."""

    def __init__(self, sizes: dict[str, int] | None = None) -> None:
        super().__init__()
        self.sizes = sizes or {}

    def compressed_size(self, path):
        return self.sizes.get(path, 4 * KiB)


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


def test_a_profile_prefetch_leaves_out_files_already_on_the_node():
    nodes = files([100 * KiB] * 10)
    layer = SizedLayer({p: n.size for p, n in nodes.items()})
    on_node = {"f1", "f3", "f4"}   # in the node's file cache (a node that ran the env before)
    frames = _Frames(layer, nodes, present=lambda n: n.read_path in on_node)  # type: ignore[arg-type]
    assert frames.on_node(nodes["f3"]) and not frames.on_node(nodes["f2"])
    assert prefetch_in_order(frames, nodes, [f"f{i}" for i in range(6)], gap=64 * KiB,
                             workers=1) == 3   # a recorded profile: f0, f2, f5
    assert sorted(p for b in layer.calls for p in b) == ["f0", "f2", "f5"]
    assert frames.missing(nodes["f1"])   # not fetched: its open reads the file cache


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


def test_profile_prefetch_coalesces_neighbours_and_starts_with_what_comes_first():
    nodes = files([256 * KiB] * 40)  # 10 MiB, one frame each, back to back
    layer = SizedLayer({p: n.size for p, n in nodes.items()})
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    order = [f"f{i}" for i in reversed(range(40))]
    assert prefetch_in_order(frames, nodes, order, gap=64 * KiB, max_run=2 << 20,
                             workers=1) == 40
    assert frames.profiled
    reads = layer.calls
    assert sorted(p for b in reads for p in b) == sorted(order)  # every file once
    assert len(reads) == 5 and all(len(b) == 8 for b in reads)   # 2 MiB reads
    assert reads[0] == [f"f{i}" for i in range(32, 40)]          # the profile's first
    assert reads[-1] == [f"f{i}" for i in range(8)]
    assert not any(frames.missing(n) for n in nodes.values() if n.read_path)


def test_profile_prefetch_does_not_span_gaps_wider_than_allowed():
    nodes = files([100 * KiB] * 10)
    layer = SizedLayer({p: n.size for p, n in nodes.items()})
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    # every other file: 100 KiB gaps; with a 64 KiB gap each file is its own read
    assert prefetch_in_order(frames, nodes, [f"f{i}" for i in range(0, 10, 2)],
                             gap=64 * KiB, workers=1) == 5
    assert len(layer.calls) == 5
    layer.calls.clear()
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    assert prefetch_in_order(frames, nodes, [f"f{i}" for i in range(1, 10, 2)],
                             gap=128 * KiB, workers=1) == 5
    assert len(layer.calls) == 1


def tree(paths: dict[str, int]) -> dict[str, Node]:
    """Regular files at ``paths`` (sizes), in this order in the blob, with their directories."""
    nodes: dict[str, Node] = {"": Node(1, stat.S_IFDIR | 0o755, 0, 0, 0, children={})}
    offset = 0
    for path, size in paths.items():
        parts = path.split("/")
        for k in range(len(parts)):
            d, name = "/".join(parts[:k]), parts[k]
            nodes[d].children[name] = None  # type: ignore[index]
            full = "/".join(parts[:k + 1])
            if full not in nodes:
                if k < len(parts) - 1:
                    nodes[full] = Node(len(nodes) + 1, stat.S_IFDIR | 0o755, 0, 0, 0,
                                       children={})
                else:
                    nodes[full] = Node(len(nodes) + 1, stat.S_IFREG | 0o644, 0, 0, 0,
                                       size=size, read_path=full, frames=(offset,))
                    offset += size
    return nodes


SP = "venv/lib/python3.11/site-packages"
EXT = ".cpython-311-x86_64-linux-gnu.so"


def test_extension_siblings_are_the_directorys_modules_and_the_wheels_vendored_libs():
    from runtime_shim.lazyfs.frames import extension_siblings

    nodes = tree({f"{SP}/np.libs/libopenblas.so": 100, f"{SP}/np/core/a{EXT}": 10,
                  f"{SP}/np/core/b{EXT}": 10, f"{SP}/np/core/c.py": 10,
                  f"{SP}/np/core/d.abi3.so": 10, f"{SP}/np/core/_x_tests{EXT}": 10,
                  f"{SP}/other/e{EXT}": 10,
                  "usr/lib/python3.11/lib-dynload/_x" + EXT: 1,
                  "usr/lib/python3.11/lib-dynload/_y" + EXT: 1})
    dirs, files = extension_siblings(nodes, f"{SP}/np/core/a{EXT}")
    assert dirs == [f"{SP}/np/core", f"{SP}/np.libs"]
    assert names(files) == [f"{SP}/np.libs/libopenblas.so", f"{SP}/np/core/a{EXT}",
                            f"{SP}/np/core/b{EXT}", f"{SP}/np/core/d.abi3.so"]
    assert extension_siblings(nodes, f"{SP}/np/core/c.py") == ([], [])
    dirs, files = extension_siblings(nodes, "usr/lib/python3.11/lib-dynload/_x" + EXT)
    assert len(files) == 2 and dirs == ["usr/lib/python3.11/lib-dynload"]  # no site-packages




def test_the_first_open_of_an_extension_module_fetches_its_siblings_once_in_the_background():
    from runtime_shim.lazyfs.frames import _Readahead

    layer = SizedLayer()
    nodes = tree({f"{SP}/np.libs/libopenblas.so": 100, f"{SP}/np/core/a{EXT}": 10,
                  f"{SP}/np/core/b{EXT}": 10, f"{SP}/np/core/c.py": 10})
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    ra = _Readahead(layer, nodes, frames)  # type: ignore[arg-type]
    ra.schedule_extensions(nodes[f"{SP}/np/core/c.py"])  # not an extension: nothing
    ra.schedule_extensions(nodes[f"{SP}/np/core/a{EXT}"])
    ra.schedule_extensions(nodes[f"{SP}/np/core/b{EXT}"])  # same directory: once
    for _ in range(200):
        if not frames.missing(nodes[f"{SP}/np.libs/libopenblas.so"]):
            break
        threading.Event().wait(0.01)
    assert layer.calls == [[f"{SP}/np.libs/libopenblas.so", f"{SP}/np/core/b{EXT}"]]
    assert frames.missing(nodes[f"{SP}/np/core/a{EXT}"])  # the opened one is the reader's
    assert frames.missing(nodes[f"{SP}/np/core/c.py"])


def test_the_extension_readahead_leaves_out_siblings_already_on_the_node():
    from runtime_shim.lazyfs.frames import _Readahead

    layer = SizedLayer()
    nodes = tree({f"{SP}/np.libs/libopenblas.so": 100, f"{SP}/np/core/a{EXT}": 10,
                  f"{SP}/np/core/b{EXT}": 10, f"{SP}/np/core/c{EXT}": 10})
    frames = _Frames(layer, nodes,  # type: ignore[arg-type]
                     present=lambda n: n.read_path.endswith(("libopenblas.so", f"b{EXT}")))
    ra = _Readahead(layer, nodes, frames)  # type: ignore[arg-type]
    ra.schedule_extensions(nodes[f"{SP}/np/core/a{EXT}"])
    for _ in range(200):
        if not frames.missing(nodes[f"{SP}/np/core/c{EXT}"]):
            break
        threading.Event().wait(0.01)
    assert layer.calls == [[f"{SP}/np/core/c{EXT}"]]


def test_a_profiled_mount_fetches_no_extension_siblings():
    from runtime_shim.lazyfs.frames import _Readahead

    layer = SizedLayer()
    nodes = tree({f"{SP}/np/core/a{EXT}": 10, f"{SP}/np/core/b{EXT}": 10})
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    frames.profiled = True
    _Readahead(layer, nodes, frames).schedule_extensions(  # type: ignore[arg-type]
        nodes[f"{SP}/np/core/a{EXT}"])
    threading.Event().wait(0.1)
    assert layer.calls == []


def test_a_loaded_window_reports_every_file_it_made_present():
    layer = FakeLayer()
    nodes = files([100 * KiB] * 6)
    got: list[list[str]] = []
    frames = _Frames(layer, nodes, on_loaded=lambda ns: got.append(names(ns)))  # type: ignore[arg-type]
    frames.load([nodes["f0"], nodes["f1"]])
    assert got == [["f0", "f1"]]
    frames.load([nodes["f0"]])  # already loaded: nothing new
    assert got == [["f0", "f1"]]


def test_without_report_all_only_files_asked_for_ahead_are_reported():
    """``report_all=False`` (a passthrough mount without ``PRELOAD``): a window's or a
    readahead's guesses are not reported (their first open writes them); files loaded
    ``ahead`` are, when their frames land or at once if they are loaded already."""
    layer = FakeLayer()
    nodes = files([100 * KiB] * 6)
    got: list[list[str]] = []
    frames = _Frames(layer, nodes, on_loaded=lambda ns: got.append(names(ns)),  # type: ignore[arg-type]
                     report_all=False)
    frames.load([nodes["f0"], nodes["f1"]])            # a miss and its window
    assert got == [] and len(layer.calls) == 1
    frames.load([nodes["f2"], nodes["f3"]], ahead=True)  # start-up files, say
    assert got == [["f2", "f3"]]
    frames.load([nodes["f1"]], ahead=True)   # loaded by the window already: no request
    assert got == [["f2", "f3"], ["f1"]] and len(layer.calls) == 2
    frames.load([nodes["f2"]], ahead=True)   # reported once it was written: again, once
    assert got[-1] == ["f2"]
    frames.load([nodes["f4"]])
    assert got[-1] == ["f2"]                 # a guess again: not reported


def test_a_file_asked_for_ahead_while_a_guess_fetches_it_is_reported_when_it_lands():
    gate, entered = threading.Event(), threading.Event()

    class SlowLayer(FakeLayer):
        def prefetch(self, paths, **kw):
            entered.set()
            gate.wait(5)
            return super().prefetch(paths, **kw)

    nodes = files([100 * KiB] * 3)
    got: list[list[str]] = []
    frames = _Frames(SlowLayer(), nodes, on_loaded=lambda ns: got.append(names(ns)),  # type: ignore[arg-type]
                     report_all=False)
    guess = threading.Thread(target=frames.load, args=([nodes["f0"], nodes["f1"]],))
    guess.start()
    assert entered.wait(5)
    frames.load([nodes["f1"]], wait=False, ahead=True)   # in flight: nothing to fetch
    assert got == []
    gate.set()
    guess.join(5)
    assert got == [["f1"]]


class StreamingLayer(FakeLayer):
    """A ``FakeLayer`` whose ``stream`` yields two pieces, or raises after the first."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail

    def stream(self, path):
        yield b"first"
        if self.fail:
            raise RuntimeError("does not match its TOC digest")
        yield b"second"


def test_a_large_file_is_streamed_and_its_frames_marked_loaded_only_once_it_verified():
    nodes = files([9 << 20])  # three frames
    big = nodes["f0"]
    layer = StreamingLayer()
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    stream = frames.stream(big)
    assert frames.inflight == set(big.frames)  # claimed: a second reader waits for it
    assert list(stream) == [b"first", b"second"]
    assert not frames.missing(big) and not frames.inflight

    failing = _Frames(StreamingLayer(fail=True), nodes)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        list(failing.stream(big))
    assert failing.missing(big) and not failing.inflight  # released, not loaded


def test_a_large_file_whose_frames_are_being_fetched_is_not_streamed_twice():
    nodes = files([9 << 20])
    big = nodes["f0"]
    layer = StreamingLayer()
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    frames.inflight.add(big.frames[0])  # someone else's fetch
    done = threading.Event()

    def other_fetch_lands() -> None:
        threading.Event().wait(0.1)
        with frames.cv:
            frames.inflight.discard(big.frames[0])
            frames.loaded.add(big.frames[0])
            frames.cv.notify_all()
        done.set()

    threading.Thread(target=other_fetch_lands).start()
    layer.read = lambda path: b"whole"  # type: ignore[attr-defined]
    assert list(frames.stream(big)) == [b"whole"]   # loaded the rest, then read whole
    assert done.is_set() and layer.calls == [["f0"]]
    assert not frames.missing(big)


def test_ahead_loaded_looks_half_a_window_ahead_of_a_reader():
    nodes = files([100 * KiB] * 20)
    frames = _Frames(FakeLayer(), nodes)  # type: ignore[arg-type]
    assert not frames.ahead_loaded(nodes["f0"], 512 * KiB)  # f6 (600 KiB on) is not loaded
    frames.loaded.add(nodes["f6"].frames[0])
    assert frames.ahead_loaded(nodes["f0"], 512 * KiB)
    frames.inflight.add(nodes["f11"].frames[0])
    assert frames.ahead_loaded(nodes["f5"], 512 * KiB)      # f11: being fetched
    assert not frames.ahead_loaded(nodes["f6"], 512 * KiB)  # f12
    assert frames.ahead_loaded(nodes["f19"], 512 * KiB)     # nothing after the last file


def test_a_deferred_tar_readahead_waits_its_delay_then_loads():
    """``schedule_after(node, delay=)``: nothing is asked of the store before the delay, the
    window after ``node`` once it passed."""
    import time

    from runtime_shim.lazyfs.frames import _Readahead

    layer = SizedLayer()
    nodes = files([100 * KiB] * 16)   # more than half a window ahead of f0
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    ra = _Readahead(layer, nodes, frames)  # type: ignore[arg-type]
    t0 = time.monotonic()
    ra.schedule_after(nodes["f0"], delay=0.4)
    time.sleep(0.15)
    assert layer.calls == []   # not yet
    for _ in range(300):
        if layer.calls:
            break
        time.sleep(0.01)
    assert layer.calls and time.monotonic() - t0 >= 0.4
    assert "f1" in layer.calls[0] and "f0" not in layer.calls[0]


def test_a_guessed_load_brings_each_files_companion_and_an_exact_one_does_not():
    """``_Frames.companion`` (a checked-hash pyc's source, in passthrough): a window's or the
    readahead's load of a file (in the background) fetches its companion in the same load; a
    load ``ahead`` (an exact prediction) and a reader's own (it waits) do not."""
    layer = FakeLayer()
    nodes = files([100 * KiB] * 6)
    frames = _Frames(layer, nodes)  # type: ignore[arg-type]
    frames.companion = lambda n: nodes["f5"] if n.read_path == "f0" else None
    frames.load([nodes["f0"], nodes["f1"]], wait=False)
    assert layer.calls == [["f0", "f1", "f5"]]
    assert not frames.missing(nodes["f5"])
    frames.companion = lambda n: nodes["f4"]
    frames.load([nodes["f2"]], wait=False, ahead=True)   # an exact prediction
    frames.load([nodes["f3"]])                           # a reader's own miss waits
    assert layer.calls[1:] == [["f2"], ["f3"]]
