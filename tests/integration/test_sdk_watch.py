"""``Sandbox.watch`` / ``AsyncSandbox.watch`` (issue 37 item 2: file watching as a
runtime_shim feature): changes made by the sandbox's commands, in its overlay and in its /tmp
bind mount, are reported from the host; a symlink the sandbox plants is never followed; the
watch of another backend is refused. Real runc sandboxes of the busybox env."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime_shim import AsyncSandbox, Sandbox
from runtime_shim.isolation.watch import WatchEvent
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.integration
ENV = "busybox-shell"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("sdkwatch"))


def _collect(w, want: set[WatchEvent], seconds: float = 10.0) -> list[WatchEvent]:
    got: list[WatchEvent] = []
    deadline = time.monotonic() + seconds
    while not want <= set(got) and time.monotonic() < deadline:
        got += w.wait(0.2)
    return got


def test_commands_changes_are_reported_and_symlinks_not_followed(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        sb.exec("mkdir -p /workspace/w/sub && ln -s / /workspace/w/root && "
                "ln -s /etc /workspace/w/etc")
        w = sb.watch("/workspace/w", recursive=True)
        t = sb.watch("/tmp")
        try:
            sb.exec("echo 1 > /workspace/w/a && mv /workspace/w/a /workspace/w/b && "
                    "echo 2 > /workspace/w/sub/c && rm /workspace/w/b && "
                    "touch /etc/through-the-link && echo 3 > /tmp/t")
            want = {WatchEvent("create", "a"), WatchEvent("rename", "a"),
                    WatchEvent("create", "b"), WatchEvent("remove", "b"),
                    WatchEvent("create", "sub/c")}
            got = _collect(w, want)
            assert want <= set(got), got
            assert not any("through-the-link" in e.name for e in got + w.wait(0.3))
            assert WatchEvent("create", "t") in _collect(t, {WatchEvent("create", "t")})
        finally:
            w.close()
            t.close()
        with pytest.raises(FileNotFoundError):
            sb.watch("/no/such/dir")


def test_async_watch(built):
    store, node = built

    async def main():
        sb = await AsyncSandbox.create(ENV, store=store, node_dir=node)
        try:
            w = await sb.watch("/workspace")
            try:
                await sb.exec("touch /workspace/async-made")
                events = await asyncio.wait_for(w.next_events(), 10)
                assert WatchEvent("create", "async-made") in events
            finally:
                w.close()
        finally:
            await sb.close()

    asyncio.run(main())
