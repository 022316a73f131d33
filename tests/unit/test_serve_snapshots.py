"""``envbuild.serve.snapshots.Snapshots`` over a ``MemoryStore``: which refs are snapshots,
the ``sandboxID`` and ``name`` filters, ``mark`` keeping the ref's target and other
annotations, and delete refusing what is not a snapshot."""

from __future__ import annotations

import pytest

from envbuild.serve.snapshots import SOURCE_ANNOTATION, Snapshots
from envbuild.store import MemoryStore
from envbuild.store.helpers import put_bytes


@pytest.fixture
def snaps():
    store = MemoryStore()
    digest = put_bytes(store, b"lock")
    for ref in ("env/busybox-shell", "e2b/paused/x", "e2b/snapshots/full",
                "e2b/fs-snapshots/files", "e2b/fs-snapshots/other"):
        store.put_ref(ref, digest, annotations={"keep": "me"})
    s = Snapshots(store)
    s.mark("e2b/snapshots/full", "sb-1")
    s.mark("e2b/fs-snapshots/files", "sb-1")
    s.mark("e2b/fs-snapshots/other", "sb-2")
    return s


def test_only_snapshot_refs_are_listed_and_filtered(snaps):
    assert snaps.find() == ["e2b/fs-snapshots/files", "e2b/fs-snapshots/other",
                            "e2b/snapshots/full"]
    assert snaps.find(sandbox_id="sb-1") == ["e2b/fs-snapshots/files", "e2b/snapshots/full"]
    assert snaps.find(sandbox_id="sb-3") == []
    assert snaps.find(name="other") == snaps.find(name="e2b/fs-snapshots/other") == \
        ["e2b/fs-snapshots/other"]
    assert snaps.find(name="fs-snapshots/other") == []
    assert snaps.find(sandbox_id="sb-2", name="full") == []


def test_mark_keeps_the_target_and_the_other_annotations(snaps):
    desc = snaps.store.get_ref("e2b/snapshots/full")
    assert desc.annotations == {"keep": "me", SOURCE_ANNOTATION: "sb-1"}
    assert desc.digest == snaps.store.get_ref("env/busybox-shell").digest


def test_delete_removes_a_snapshot_ref_only(snaps):
    assert snaps.delete("e2b/fs-snapshots/files") is True
    assert snaps.delete("e2b/fs-snapshots/files") is False
    assert "e2b/fs-snapshots/files" not in snaps.store.list_refs()
    for other in ("env/busybox-shell", "e2b/paused/x"):
        with pytest.raises(ValueError):
            snaps.delete(other)
        assert other in snaps.store.list_refs()
