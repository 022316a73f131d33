"""Issue 19 item 2 (containers): ``info().memory`` and host-side reclaim of idle sandboxes'
cold pages, over real runc and the host's memory cgroups (v1 here: ``memory.force_empty``)."""

from __future__ import annotations

import time

import pytest

from runtime_shim.node import reclaim
from runtime_shim.sdk.sandbox import Sandbox
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.integration
ENV = "env/busybox-shell"
MiB = 1 << 20
WRITE = ("dd if=/dev/zero of=/tmp/blob bs=1M count=64 2>/dev/null && sync && "
         "cat /tmp/blob >/dev/null && md5sum /tmp/blob")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("reclaim"))


def test_info_memory_and_reclaim_give_back_page_cache_and_keep_the_data(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        digest = sb.exec(WRITE).stdout
        held = sb.info().memory
        assert held is not None and held.cache >= 60 * MiB and held.usage >= held.cache
        assert held.reclaimed == 0
        result = reclaim.reclaim(sb.paths)
        assert result.freed >= 50 * MiB, result
        after = sb.info().memory
        assert after is not None and after.usage <= held.usage - 50 * MiB
        assert after.reclaimed == result.freed
        assert sb.exec("md5sum /tmp/blob").stdout == digest  # cold pages, not data, went


def test_the_scratch_disk_is_not_cached_twice(built):
    """The sandbox's disk is on a loop device in direct-I/O mode (the node's disk pool, or a
    loop disk of its own): what it writes is cached once, by the filesystem on it (charged to
    the sandbox, reclaimable), not a second time as the image file's pages on the host, which
    no sandbox is charged for."""
    import glob

    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        mine = [f for f in glob.glob("/sys/block/loop*/loop/backing_file")
                if f"/{sb.id}/" in open(f).read()
                or open(f).read().startswith(f"{node}/node/diskpool/")]
        assert len(mine) == 1, mine
        assert open(mine[0].replace("backing_file", "dio")).read().strip() == "1"


def test_policy_reclaims_idle_sandboxes_only(built):
    store, node = built
    policy = reclaim.ReclaimPolicy(idle_seconds=0.5, idle_cpu_fraction=0.05, min_bytes=16 * MiB)
    with Sandbox.create(ENV, store=store, node_dir=node) as idle, \
            Sandbox.create(ENV, store=store, node_dir=node) as busy:
        for sb in (idle, busy):
            assert sb.exec(WRITE).ok
        # keeps a CPU busy (its own session: the agent ends the exec's process group)
        busy.exec("setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &")
        assert reclaim.reclaim_idle(node, policy) == []  # the first pass only records
        time.sleep(0.8)
        done = reclaim.reclaim_idle(node, policy)
        assert [r.id for r in done] == [idle.id], done
        assert done[0].freed >= 50 * MiB
        idle_mem, busy_mem = idle.info().memory, busy.info().memory
        assert idle_mem is not None and busy_mem is not None
        assert idle_mem.reclaimed >= 50 * MiB and busy_mem.reclaimed == 0
        assert busy_mem.cache >= 60 * MiB


def test_reclaimer_thread_applies_the_policy(built):
    store, node = built
    policy = reclaim.ReclaimPolicy(idle_seconds=0.3, idle_cpu_fraction=0.05, min_bytes=16 * MiB)
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        assert sb.exec(WRITE).ok
        worker = reclaim.Reclaimer(node, policy, interval=0.2)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                mem = sb.info().memory
                if mem is not None and mem.reclaimed >= 50 * MiB:
                    break
                time.sleep(0.1)
        finally:
            worker.stop()
        assert mem is not None and mem.reclaimed >= 50 * MiB, (mem, worker.errors)
        assert worker.reclaimed >= 50 * MiB and worker.errors == []


def test_fncall_sandboxes_report_memory_too(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node, backend="fncall") as fn:
        assert fn.call(WRITE).ok
        mem = fn.info().memory
        assert mem is not None and mem.usage > 0


def test_node_policy_file(built, tmp_path):
    _, node = built
    from runtime_shim.node.layout import NodeLayout

    layout = NodeLayout(tmp_path)
    assert reclaim.ReclaimPolicy.for_node(layout) == reclaim.ReclaimPolicy()
    (tmp_path / reclaim.POLICY_FILE).write_text('{"version": 1, "idle_seconds": 5}')
    assert reclaim.ReclaimPolicy.for_node(layout).idle_seconds == 5.0
    (tmp_path / reclaim.POLICY_FILE).write_text('{"version": 9}')
    with pytest.raises(Exception, match="version 9"):
        reclaim.ReclaimPolicy.for_node(layout)
