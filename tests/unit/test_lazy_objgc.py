"""The filler's forgetting of evicted layers (``runtime_shim.lazyfs.objgc.forget``) on a fake
worker's state, and the shrink's refusal without a private write mount."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from runtime_shim.lazyfs import objgc
from runtime_shim.lazyfs.fillhints import Hints

A, B = "a" * 64, "b" * 64
SHARED, ONLY_A, ONLY_B = "1" * 64, "2" * 64, "3" * 64


def _worker() -> SimpleNamespace:
    rec_a = {"layer": "sha256:" + A, "objects": {SHARED: ["lib/x.so", 5], ONLY_A: ["a", 1]}}
    rec_b = {"layer": "sha256:" + B, "objects": {SHARED: ["usr/x.so", 5], ONLY_B: ["b", 1]}}
    hints = Hints(lambda _h: None)
    hints.add_stack([A, B])
    hints._stacks[(A, B)] = object()   # a stack's cache, as a prediction made it
    return SimpleNamespace(
        _lock=threading.Lock(), _tree_lock=threading.Lock(), hints=hints,
        _layers_loaded={A, B}, _records={A: rec_a, B: rec_b}, _index_urls={A: "u"},
        _sources={SHARED: (rec_a, "lib/x.so", 5), ONLY_A: (rec_a, "a", 1),
                  ONLY_B: (rec_b, "b", 1)},
        _orders={"sha256:" + A: 1, "sha256:" + B: 2}, _ranges={"sha256:" + A: "r"},
        _readers={f"dir\0None\0sha256:{A}": 1, f"dir\0None\0sha256:{B}": 2},
        _trees={"sha256:" + A: {}, "sha256:" + B: {}})


def test_forget_drops_a_layer_and_sources_its_shared_objects_from_the_one_left(monkeypatch):
    monkeypatch.setattr(objgc, "_release_memory", lambda: None)
    w = _worker()
    objgc.forget(w, [A])
    assert w._layers_loaded == {B} and list(w._records) == [B] and w._index_urls == {}
    assert w._sources[SHARED][1] == "usr/x.so" and ONLY_A not in w._sources
    assert list(w._orders) == list(w._trees) == ["sha256:" + B] and w._ranges == {}
    assert list(w._readers) == [f"dir\0None\0sha256:{B}"]
    assert w.hints._stacks == {} and w.hints._stack_of == {}   # the stack held A


def test_forget_of_nothing_touches_nothing(monkeypatch):
    monkeypatch.setattr(objgc, "_release_memory", lambda: pytest.fail("collected"))
    w = _worker()
    objgc.forget(w, [])
    assert set(w._records) == {A, B}


def test_no_shrink_without_a_private_write_mount(tmp_path):
    w = SimpleNamespace(wdata=str(tmp_path), objects=SimpleNamespace(data=str(tmp_path)))
    got = objgc.shrink(w, set(), 0)
    assert got["emptied"] == 0 and "private write mount" in got["shrink_skipped"]
