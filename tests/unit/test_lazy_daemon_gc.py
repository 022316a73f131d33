"""The lazy daemon's memory settings (``runtime_shim.lazyfs.daemon``): for the cyclic GC a
larger generation-0 threshold, the mounts' trees frozen out of the collector's reach after a
mount and handed back after an unmount, and what collections cost counted for the ping; for
glibc's malloc one arena and freed buffers kept (``tune_malloc``)."""

from __future__ import annotations

import gc

import pytest

from runtime_shim.lazyfs import daemon


@pytest.fixture
def gc_state():
    thresholds, callbacks = gc.get_threshold(), list(gc.callbacks)
    yield
    gc.set_threshold(*thresholds)
    gc.callbacks[:] = callbacks
    gc.unfreeze()


def test_install_raises_the_young_threshold_and_counts_collections(gc_state):
    pauses = daemon._GcPauses()
    pauses.install()
    assert gc.get_threshold()[0] == daemon.GC_GEN0_THRESHOLD
    assert pauses.snapshot()["collections"] == 0
    gc.collect()
    gc.collect(0)
    got = pauses.snapshot()
    assert got["collections"] == 2
    assert 0 < got["longest_s"] <= got["seconds"]


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_tree_frozen_at_mount_is_collected_after_its_unmount(gc_state):
    import weakref

    tree = _Cycle()
    alive = weakref.ref(tree)
    daemon._settle_heap()
    assert gc.get_freeze_count() > 0
    del tree
    gc.collect()
    assert alive() is not None      # frozen: no collection walks (or frees) it
    daemon._release_heap()
    assert alive() is None          # the unmounted tree's cycle is freed, at once
    kept = _Cycle()
    still = weakref.ref(kept)
    daemon._settle_heap()
    daemon._release_heap()          # what is still held is frozen again, and not freed
    assert gc.get_freeze_count() > 0 and still() is kept


def test_the_operators_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert daemon.tune_malloc() == "set by the environment"
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")
    assert daemon.tune_malloc() == "set by the environment"
