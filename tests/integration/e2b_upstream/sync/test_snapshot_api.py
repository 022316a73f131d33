# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/test_snapshot_api.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
# envbuild: only the list and delete tests are kept (creating from a snapshot is covered by
# test_snapshot.py and tests/integration/test_e2b_lifecycle.py); left out, for the suite's time:
# test_create_snapshot, test_create_sandbox_from_snapshot, test_create_multiple_sandboxes_from_snapshot, test_create_named_snapshot, test_snapshot_preserves_filesystem, test_create_snapshot_class_method.
import pytest
from e2b import Sandbox


@pytest.mark.skip_debug()
def test_list_snapshots(sandbox: Sandbox):
    snapshot = sandbox.create_snapshot()

    try:
        paginator = Sandbox.list_snapshots()
        assert paginator.has_next

        snapshots = paginator.next_items()
        assert isinstance(snapshots, list)

        found = any(s.snapshot_id == snapshot.snapshot_id for s in snapshots)
        assert found
    finally:
        Sandbox.delete_snapshot(snapshot.snapshot_id)


@pytest.mark.skip_debug()
def test_list_snapshots_for_sandbox(sandbox: Sandbox):
    snapshot = sandbox.create_snapshot()

    try:
        paginator = Sandbox.list_snapshots(sandbox_id=sandbox.sandbox_id)
        snapshots = paginator.next_items()

        found = any(s.snapshot_id == snapshot.snapshot_id for s in snapshots)
        assert found
    finally:
        Sandbox.delete_snapshot(snapshot.snapshot_id)


@pytest.mark.skip_debug()
def test_list_snapshots_filtered_by_name(sandbox: Sandbox, sandbox_test_id: str):
    snapshot_name = f"snap-filter-{sandbox_test_id}"

    snapshot = sandbox.create_snapshot(name=snapshot_name)

    try:
        paginator = Sandbox.list_snapshots(name=snapshot_name)
        snapshots = paginator.next_items()

        found = any(s.snapshot_id == snapshot.snapshot_id for s in snapshots)
        assert found

        empty_paginator = Sandbox.list_snapshots(name=f"{snapshot_name}-does-not-exist")
        empty_snapshots = empty_paginator.next_items()
        assert isinstance(empty_snapshots, list)
        assert len(empty_snapshots) == 0
    finally:
        Sandbox.delete_snapshot(snapshot.snapshot_id)


@pytest.mark.skip_debug()
def test_delete_snapshot(sandbox: Sandbox):
    snapshot = sandbox.create_snapshot()

    deleted = Sandbox.delete_snapshot(snapshot.snapshot_id)
    assert deleted is True

    deleted_again = Sandbox.delete_snapshot(snapshot.snapshot_id)
    assert deleted_again is False
