"""Streaming callbacks and the asyncio API over ``FakeBackend``: one event loop, no thread per
exec, the same exchange as the sync API."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from envbuild.errors import SandboxClosed
from envbuild.store import LocalStore
from runtime_shim import AsyncSandbox
from runtime_shim.backends import base as registry
from runtime_shim.backends.fake import FakeBackend, FakeReply, fake_lock

CHUNKS = [("stdout", b"o1"), ("stderr", b"e1"), ("stdout", b"o2"), ("stdout", b"o3"),
          ("stderr", b"e2")]
# what the callbacks see: in order, a stream's adjacent chunks as one (the host coalesces a
# run of frames of one stream: a sandbox writing one byte at a time costs one callback per
# run, not per byte; issue 34, item 7)
SEEN = [("stdout", b"o1"), ("stderr", b"e1"), ("stdout", b"o2o3"), ("stderr", b"e2")]


def _scripted(req, stdin):
    return FakeReply(chunks=CHUNKS, exit_code=3)


@pytest.fixture
def env(tmp_path):
    store = LocalStore(tmp_path / "store")
    fake_lock(store)
    fb = FakeBackend(_scripted)
    registry.register("fake", fb)
    yield store, tmp_path / "node", fb
    registry.unregister("fake")


def test_callbacks_get_each_chunk_in_order(env):
    from runtime_shim import Sandbox

    store, node, _ = env
    seen = []
    with Sandbox.create("env/fake", store=store, node_dir=node, backend="fake") as sb:
        r = sb.exec("x", on_stdout=lambda b: seen.append(("stdout", b)),
                    on_stderr=lambda b: seen.append(("stderr", b)))
    assert seen == SEEN
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"o1o2o3", b"e1e2")


def test_async_callbacks_in_order_and_async_with(env):
    store, node, fb = env

    async def main():
        seen = []
        async with await AsyncSandbox.create("env/fake", store=store, node_dir=node,
                                             backend="fake") as sb:
            r = await sb.exec("x", on_stdout=lambda b: seen.append(("stdout", b)),
                              on_stderr=lambda b: seen.append(("stderr", b)))
            await sb.write_file("/f", b"data")
            assert await sb.read_file("/f") == b"data"
        with pytest.raises(SandboxClosed):
            await sb.exec("x")
        return seen, r

    seen, r = asyncio.run(main())
    assert seen == SEEN and r.exit_code == 3
    assert fb.calls["close"] == 1


def test_fifty_sandboxes_under_one_loop_without_a_thread_per_exec(tmp_path):
    store = LocalStore(tmp_path / "store")
    fake_lock(store)
    delay = 0.3
    fb = FakeBackend(lambda req, stdin: FakeReply(chunks=[("stdout", req.argv[-1].encode())],
                                                  delay=delay))
    registry.register("fake", fb)
    node = tmp_path / "node"
    peak = 0

    async def main():
        nonlocal peak
        sbs = await asyncio.gather(*(AsyncSandbox.create("env/fake", store=store, node_dir=node,
                                                         backend="fake") for _ in range(50)))
        threads_before = threading.active_count()
        started = time.monotonic()
        tasks = [asyncio.ensure_future(sb.exec(["echo", str(i)])) for i, sb in enumerate(sbs)]
        await asyncio.sleep(delay / 3)  # every exec is in flight now
        peak = threading.active_count() - threads_before
        results = await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        await asyncio.gather(*(sb.close() for sb in sbs))
        return results, elapsed

    try:
        results, elapsed = asyncio.run(main())
    finally:
        registry.unregister("fake")
    assert [r.stdout for r in results] == [str(i).encode() for i in range(50)]
    assert elapsed < 50 * delay / 4  # concurrent, not one after another
    assert peak <= 1  # at most the fake's own scheduler thread, never one per exec
    assert fb.calls["exec"] == 0  # the async path drives the exchange itself (connect)
    assert fb.calls["connect"] == 50 and fb.calls["close"] == 50
    assert list((node / "sandboxes").iterdir()) == []


def test_cancelling_an_async_exec_hangs_up(env):
    store, node, _ = env
    fb = FakeBackend(lambda req, stdin: FakeReply(delay=30))
    registry.register("fake", fb)

    async def main():
        async with await AsyncSandbox.create("env/fake", store=store, node_dir=node,
                                             backend="fake") as sb:
            task = asyncio.ensure_future(sb.exec("sleep"))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(main(), 5))
