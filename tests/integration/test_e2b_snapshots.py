"""Conformance: ``Sandbox.list_snapshots`` / ``delete_snapshot`` of the real ``e2b`` SDK
against ``envbuild serve`` (issue 37 item 1, snapshots), served from the store's
``e2b/snapshots/*`` and ``e2b/fs-snapshots/*`` refs; both need an API key. Real runc
sandboxes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from envbuild.store import LocalStore

pytestmark = pytest.mark.slow
TEMPLATE = "busybox-shell"


def _all(paginator) -> list[str]:
    out: list[str] = []
    while paginator.has_next:
        out += [s.snapshot_id for s in paginator.next_items()]
    return out


def test_list_and_delete_snapshots(e2b_built, e2b_server):
    from e2b import Sandbox, SandboxException

    from tests.integration.test_checkpoint import require_criu

    require_criu()
    store = LocalStore(e2b_built[1].root)
    a, b = Sandbox.create(TEMPLATE, timeout=120), Sandbox.create(TEMPLATE, timeout=120)
    try:
        full = a.create_snapshot("snap-full").snapshot_id
        fs_a = a.create_snapshot("snap-a", mode="filesystem").snapshot_id
        fs_b = b.create_snapshot("snap-b", mode="filesystem").snapshot_id
        assert (full, fs_a, fs_b) == ("e2b/snapshots/snap-full", "e2b/fs-snapshots/snap-a",
                                      "e2b/fs-snapshots/snap-b")
        mine = {full, fs_a, fs_b}
        assert mine <= set(_all(Sandbox.list_snapshots()))
        first = Sandbox.list_snapshots(limit=2)
        page = first.next_items()
        assert len(page) == 2 and first.has_next and page[0].names == [page[0].snapshot_id]
        assert sorted(_all(a.list_snapshots())) == [fs_a, full]  # this sandbox's only
        assert _all(Sandbox.list_snapshots(sandbox_id=b.sandbox_id)) == [fs_b]
        assert _all(Sandbox.list_snapshots(name="snap-a")) == [fs_a]
        assert _all(Sandbox.list_snapshots(name=full)) == [full]
        assert _all(Sandbox.list_snapshots(sandbox_id="nobody")) == []

        assert Sandbox.delete_snapshot(fs_b) is True
        assert fs_b not in store.list_refs() and fs_b not in _all(Sandbox.list_snapshots())
        assert Sandbox.delete_snapshot(fs_b) is False  # gone: E2B's 404
        with pytest.raises(SandboxException):
            Sandbox.create(fs_b, timeout=30)
        with pytest.raises(SandboxException, match="not a snapshot"):
            Sandbox.delete_snapshot(TEMPLATE)  # an env is never deleted through the API
        assert "env/busybox-shell" in store.list_refs()
        made = Sandbox.create(fs_a, timeout=30)  # the others still serve
        made.kill()

        async def async_sdk():
            from e2b import AsyncSandbox

            listed = AsyncSandbox.list_snapshots(sandbox_id=a.sandbox_id)
            ids = [s.snapshot_id for s in await listed.next_items()]
            return sorted(ids), await AsyncSandbox.delete_snapshot(full)

        assert asyncio.run(async_sdk()) == ([fs_a, full], True)
        assert full not in store.list_refs()
    finally:
        a.kill()
        b.kill()
        for ref in (full, fs_a, fs_b):
            store.delete_ref(ref)


def test_listing_and_deleting_snapshots_need_an_api_key(e2b_built, e2b_server):
    from e2b import AuthenticationException, Sandbox

    store = LocalStore(e2b_built[1].root)
    sb = Sandbox.create(TEMPLATE, timeout=60)
    try:
        snap = sb.create_snapshot("keyed", mode="filesystem").snapshot_id
        for key in ({}, {"X-API-KEY": "not-a-key"}):
            listed = httpx.get(f"{e2b_server.url}/snapshots", headers=key)
            assert listed.status_code == 401 and "keyed" not in listed.text
            gone = httpx.delete(f"{e2b_server.url}/templates/{snap.replace('/', '%2F')}",
                                headers=key)
            assert gone.status_code == 401
        assert snap in store.list_refs()  # the refused delete removed nothing
        with pytest.raises(AuthenticationException):
            Sandbox.list_snapshots(api_key="not-a-key").next_items()
        with pytest.raises(AuthenticationException):
            Sandbox.delete_snapshot(snap, api_key="not-a-key")
        assert snap in store.list_refs()
        assert Sandbox.delete_snapshot(snap) is True
    finally:
        sb.kill()
