"""``Sandbox.usage()`` on real runc sandboxes: CPU time grows by what a busy loop burns, the
limits are the sandbox's ``Limits``, a written file shows in the disk figure (the disk pool's
quota group and a loop disk), processes are counted; a closed sandbox is refused."""

from __future__ import annotations

import asyncio

import pytest

from envbuild.errors import SandboxClosed
from runtime_shim import AsyncSandbox, Limits, Sandbox
from tests.integration.conftest import build_busybox_env

MiB = 1 << 20
LIMITS = Limits(memory_bytes=128 * MiB, disk_bytes=96 * MiB, pids=48, cpus=1.0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("usage"))


@pytest.mark.parametrize("disk_mode", ["pool", "loop"])
def test_usage_follows_what_the_sandbox_does(built, disk_mode, monkeypatch):
    monkeypatch.setenv("ENVBUILD_SANDBOX_DISK", disk_mode)
    store, node = built
    sb = Sandbox.create("env/busybox-shell", store=store, node_dir=node, limits=LIMITS)
    try:
        before = sb.usage()
        assert before.memory_limit == 128 * MiB and before.pids_limit == 48
        assert before.cpus == 1.0 and before.disk_limit is not None
        # the pool's quota group holds exactly the cap; a loop disk's ext4 a little less
        assert 90 * MiB <= before.disk_limit <= 96 * MiB
        assert 0 < before.memory_bytes < 128 * MiB and before.pids is not None
        assert before.disk_bytes is not None and before.disk_bytes < 16 * MiB
        sb.exec("end=$(( $(date +%s) + 2 )); while [ $(date +%s) -lt $end ]; do :; done; "
                "dd if=/dev/urandom of=/data bs=1M count=24 2>/dev/null; sync; "
                "sleep 30 & sleep 30 & true", timeout=30)
        after = sb.usage()
        assert after.cpu_seconds - before.cpu_seconds >= 0.5, (before, after)
        assert after.disk_bytes is not None and \
            after.disk_bytes - before.disk_bytes >= 20 * MiB, (before, after)
        assert after.pids is not None and after.pids >= before.pids + 2  # the two sleeps
        assert after.at > before.at
    finally:
        sb.close()
    with pytest.raises(SandboxClosed):
        sb.usage()


def test_async_usage(built):
    store, node = built

    async def main() -> float:
        async with await AsyncSandbox.create("env/busybox-shell", store=store, node_dir=node,
                                             limits=LIMITS) as sb:
            return (await sb.usage()).memory_bytes

    assert asyncio.run(main()) > 0
