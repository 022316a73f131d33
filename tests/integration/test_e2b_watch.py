"""Conformance: ``sandbox.files.watch_dir`` of the real ``e2b`` SDK against ``envbuild serve``
(issue 37 item 1: ``WatchDir`` for the async SDK, the polling ``CreateWatcher`` /
``GetWatcherEvents`` / ``RemoveWatcher`` for the sync one), real runc sandboxes."""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = pytest.mark.slow
TEMPLATE = "busybox-shell"


def _names(events) -> set[tuple[str, str]]:
    return {(e.type.value, e.name) for e in events}


def test_sync_watch_dir_polls_events(e2b_server):
    from e2b import Sandbox, SandboxException

    sb = Sandbox.create(TEMPLATE, timeout=120)
    try:
        sb.files.make_dir("/workspace/w/sub")
        handle = sb.files.watch_dir("/workspace/w", recursive=True)
        sb.commands.run("echo 1 > /workspace/w/a; echo 2 > /workspace/w/sub/b; "
                        "rm /workspace/w/a")
        seen: set = set()
        deadline = time.monotonic() + 10
        want = {("create", "a"), ("write", "a"), ("remove", "a"), ("create", "sub/b")}
        while not want <= seen and time.monotonic() < deadline:
            seen |= _names(handle.get_new_events())
            time.sleep(0.1)
        assert want <= seen, seen
        handle.stop()
        with pytest.raises(SandboxException):
            handle.get_new_events()
        with pytest.raises(SandboxException):
            sb.files.watch_dir("/workspace/nothing-here")
    finally:
        sb.kill()


def test_async_watch_dir_streams_events(e2b_server):
    from e2b import AsyncSandbox

    async def scenario():
        sb = await AsyncSandbox.create(TEMPLATE, timeout=120)
        try:
            events = []
            got = asyncio.Event()

            def on_event(e):
                events.append(e)
                if e.name == "made.txt":
                    got.set()

            handle = await sb.files.watch_dir("/workspace", on_event=on_event)
            await sb.files.write("/workspace/made.txt", "x")
            await asyncio.wait_for(got.wait(), 10)
            await handle.stop()
            assert ("create", "made.txt") in _names(events)
        finally:
            await sb.kill()

    asyncio.run(scenario())


def test_a_polling_watcher_follows_a_new_subdirectory_before_it_is_polled(e2b_server):
    """A recursive polling watcher sees a file written in a directory made after it started
    and before its first poll (E2B's test_watch_recursive_directory_after_nested_folder_
    addition): the server reads its events as they come, so the new directory is watched
    at once, not at the next poll (then the write was missed)."""
    from e2b import Sandbox

    sb = Sandbox.create(TEMPLATE, timeout=120)
    try:
        sb.files.make_dir("/workspace/w")
        handle = sb.files.watch_dir("/workspace/w", recursive=True)
        sb.files.make_dir("/workspace/w/new")
        sb.files.write("/workspace/w/new/f.txt", "x")
        seen: set = set()
        want = {("create", "new"), ("write", "new/f.txt")}
        deadline = time.monotonic() + 5
        while not want <= seen and time.monotonic() < deadline:
            seen |= _names(handle.get_new_events())
            time.sleep(0.1)
        assert want <= seen, seen
        handle.stop()
    finally:
        sb.kill()
