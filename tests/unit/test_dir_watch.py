"""``runtime_shim.isolation.watch.DirWatch`` on a host directory standing for a sandbox's root:
events by kind with names relative to the watched dir; recursive watches follow new
subdirectories but never a symlink; the path resolves inside the root; the watches are
bounded (an overflow event says so)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from runtime_shim.isolation.watch import DirWatch, WatchEvent


def _collect(w: DirWatch, want: set[WatchEvent], seconds: float = 5.0) -> list[WatchEvent]:
    got: list[WatchEvent] = []
    deadline = time.monotonic() + seconds
    while not want <= set(got) and time.monotonic() < deadline:
        got += w.wait(0.2)
    return got


@pytest.fixture
def root(tmp_path):
    (tmp_path / "w" / "sub").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    return tmp_path


def test_events_by_kind_relative_names(root):
    w = DirWatch.open(str(root), "/w")
    try:
        (root / "w" / "a").write_text("x")
        os.chmod(root / "w" / "a", 0o600)
        os.rename(root / "w" / "a", root / "w" / "b")
        os.unlink(root / "w" / "b")
        (root / "w" / "sub" / "deep").write_text("not watched: not recursive")
        want = {WatchEvent("create", "a"), WatchEvent("write", "a"), WatchEvent("chmod", "a"),
                WatchEvent("rename", "a"), WatchEvent("create", "b"), WatchEvent("remove", "b")}
        got = _collect(w, want)
        assert want <= set(got)
        assert not any(e.name.startswith("sub/") for e in got)
    finally:
        w.close()


def test_recursive_follows_new_dirs_never_symlinks(root):
    os.symlink(str(root / "outside"), root / "w" / "link")  # a dir symlink: never descended
    os.symlink("/", root / "w" / "slash")
    w = DirWatch.open(str(root), "/w", recursive=True)
    try:
        (root / "w" / "sub" / "f").write_text("1")
        (root / "w" / "new").mkdir()
        got = _collect(w, {WatchEvent("create", "sub/f"), WatchEvent("create", "new")})
        (root / "w" / "new" / "g").write_text("2")  # watched once its dir's create was read
        (root / "outside" / "h").write_text("through the link: not reported")
        got += _collect(w, {WatchEvent("create", "new/g")})
        assert {WatchEvent("create", "sub/f"), WatchEvent("create", "new"),
                WatchEvent("create", "new/g")} <= set(got)
        got += w.wait(0.3)
        assert not any(e.name.endswith("h") for e in got), got
    finally:
        w.close()


def test_the_path_resolves_inside_the_root(root):
    os.symlink("/", root / "w" / "up")
    w = DirWatch.open(str(root), "/w/up/outside")  # "/" is the root: root/outside
    try:
        (root / "outside" / "x").write_text("1")
        assert WatchEvent("create", "x") in _collect(w, {WatchEvent("create", "x")})
    finally:
        w.close()
    with pytest.raises(FileNotFoundError):
        DirWatch.open(str(root), "/nope")
    (root / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        DirWatch.open(str(root), "/file")


def test_watches_are_bounded(root):
    for n in range(5):
        (root / "w" / f"d{n}").mkdir()
    w = DirWatch.open(str(root), "/w", recursive=True, max_watches=3)
    try:
        assert WatchEvent("overflow", "") in w.read()
        assert len(w._dirs) == 3
    finally:
        w.close()


def test_async_next_events(root):
    async def scenario():
        w = DirWatch.open(str(root), "/w")
        try:
            loop = asyncio.get_running_loop()
            loop.call_later(0.1, (root / "w" / "late").write_text, "x")
            events = await asyncio.wait_for(w.next_events(), 5)
            assert WatchEvent("create", "late") in events
        finally:
            w.close()

    asyncio.run(scenario())


def test_close_while_waited_on_frees_the_loop_and_the_fd_number(root):
    """A watch closed while ``next_events`` waits (a sandbox killed, a client gone): the wait
    ends with no events, and the loop keeps nothing of the closed fd, so the next file that
    gets its number (a command's socket in the server) can be waited on (it failed with
    ENOENT from epoll)."""

    async def scenario():
        loop = asyncio.get_running_loop()
        w = DirWatch.open(str(root), "/w")
        old_fd = w.fileno()
        waiting = asyncio.ensure_future(w.next_events())
        await asyncio.sleep(0.05)
        w.close()
        assert await asyncio.wait_for(waiting, 5) == []
        r, wfd = os.pipe()
        try:
            assert old_fd in (r, wfd)  # the number came back: the check below means something
            got = asyncio.Event()
            loop.add_writer(wfd, got.set)
            loop.add_reader(r, lambda: None)
            await asyncio.wait_for(got.wait(), 5)
            loop.remove_writer(wfd)
            loop.remove_reader(r)
        finally:
            os.close(r)
            os.close(wfd)

    asyncio.run(scenario())


def test_close_ends_a_waiting_next_events_at_once(root):
    """``close`` (a sandbox killed, a watcher removed) wakes a ``next_events`` that waits:
    it returns no events at once rather than hanging until a timeout (the server's
    ``WatchDir`` stream held its shutdown for its 30 s keepalive), and the loop keeps no
    reader on the closed descriptor."""
    w = DirWatch.open(str(root), "/w")

    async def scenario():
        loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(w.next_events())
        await asyncio.sleep(0.05)
        fd = w.fileno()
        start = time.monotonic()
        w.close()
        assert await asyncio.wait_for(waiting, 5) == []
        assert time.monotonic() - start < 1
        assert not loop.remove_reader(fd)  # none left registered

    asyncio.run(scenario())
