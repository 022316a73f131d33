"""MicroVM checkpoint and restore (issue 18, item 2) with real QEMU migration (TCG here).

A VM runs a background shell loop holding a counter in its memory; it is checkpointed with
``leave_running=True``, and a new VM restored from the checkpoint (no kernel boot) must answer
exec with the same process still counting from where it was, the files of that moment and
none written after; the original runs on, independent. Then the restored VM is checkpointed
without ``leave_running`` (it is closed) and restored again. A restore whose devices differ
from the record is refused before QEMU starts (tampered files: tests/security).
"""

from __future__ import annotations

import time

import pytest

from envbuild.errors import CheckpointRefused
from runtime_shim.backends.vm.checkpoint import RECORD_FILE, VmCheckpoint
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.sdk.sandbox import Limits, Sandbox
from tests.integration.conftest import build_busybox_env
from tests.integration.test_microvm import _gone, _qemu_pids, _require_vm_tools

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# a 2 GiB disk, not the default 10: a test here runs three VMs at once (original, restored,
# fork) and admission reserves each disk whole; CI's node (~40 GiB free) refused the third
LIMITS = Limits(memory_bytes=256 << 20, disk_bytes=2 << 30)
# written to a temporary name, then renamed over the counter: ``echo > file`` truncates first,
# so a ``cat`` between the truncation and the write read nothing (a CI run failed on b'')
COUNTER = ("i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; "
           "mv /tmp/counter.new /tmp/counter; sleep 0.1; done >/dev/null 2>&1 & echo $!")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    _require_vm_tools()
    return build_busybox_env(tmp_path_factory.mktemp("vm-ckpt"))


def _restore(image, *, store, node_dir, **kwargs):
    """A sandbox continuing the unpacked ``image``: restore is a field of create."""
    lock = VmCheckpoint.from_record(image.record).lock
    return Sandbox.create(lock, store=store, node_dir=node_dir, backend="microvm",
                          restore=image, **kwargs)


def _counter(sb: Sandbox) -> int:
    r = sb.exec("cat /tmp/counter")
    assert r.ok, r.stderr
    return int(r.stdout)


def _wait_counter(sb: Sandbox, above: int, within: float = 30) -> int:
    deadline = time.monotonic() + within
    while (n := _counter(sb)) <= above:
        assert time.monotonic() < deadline, f"the counter stayed at {n}"
        time.sleep(0.1)
    return n


def test_restore_continues_the_processes_memory_and_files(built, tmp_path):
    store, node = built
    sb = Sandbox.create("busybox-shell", store=store, node_dir=node, backend="microvm",
                        limits=LIMITS)
    restored = again = None
    try:
        loop_pid = int(sb.exec(COUNTER).stdout)
        sb.write_file("/workspace/before.txt", "before\n")
        at_checkpoint = _wait_counter(sb, 3)
        image = sb.handle.checkpoint(tmp_path / "ck1", leave_running=True)
        record = VmCheckpoint.from_record(image.record)
        assert image.kind == "qemu" and image.dir == tmp_path / "ck1"
        assert 0 < record.memory_bytes < LIMITS.memory_bytes
        assert record.lock == sb.lock.digest and image.seconds > 0
        assert image.bytes == sum((image.dir / n).stat().st_size for n in record.files)
        assert image.bytes < record.memory_bytes + (64 << 20)  # the 2 GiB disk is packed
        # the original runs on: its loop keeps counting, it takes writes
        _wait_counter(sb, at_checkpoint + 2)
        sb.write_file("/workspace/after.txt", "after\n")

        qemu_before = _qemu_pids()
        restored = _restore(image, store=store, node_dir=node)
        assert restored.host_pid not in qemu_before
        assert b"envbuild-init: ready" not in restored.handle._console()  # no boot
        first = _counter(restored)
        assert first >= at_checkpoint  # the same process, from where it was
        assert restored.exec(f"cat /proc/{loop_pid}/cmdline").ok
        _wait_counter(restored, first + 2)  # and still counting
        assert restored.read_file("/workspace/before.txt") == b"before\n"
        assert not restored.exec("test -e /workspace/after.txt").ok
        restored.write_file("/workspace/restored.txt", "r\n")
        assert not sb.exec("test -e /workspace/restored.txt").ok  # independent
        info = restored.info()
        assert info.backend == "microvm" and info.layer_transport == sb.info().layer_transport

        # checkpoint of the restored VM as the SDK takes it (inside quiesce, where its
        # changes are readable for pack-diff), without leave_running: it is gone after
        pid = restored.host_pid
        (tmp_path / "ck2").mkdir()
        with restored.handle.quiesce():
            second = restored.handle.checkpoint(tmp_path / "ck2", leave_running=False)
            assert (restored.handle.upper_dir() / "workspace" / "restored.txt").read_text() \
                == "r\n"
        assert _gone(pid, 10)
        restored.close()
        assert VmCheckpoint.from_json((tmp_path / "ck2" / RECORD_FILE).read_text()) == \
            VmCheckpoint.from_record(second.record)
        again = _restore(second, store=store, node_dir=node)
        assert again.read_file("/workspace/restored.txt") == b"r\n"
        _wait_counter(again, _counter(again))
    finally:
        for box in (sb, restored, again):
            if box is not None:
                box.close()
    assert not (_qemu_pids() & {sb.host_pid or 0})
    assert mounted_targets_under(str(node)) == []
    assert [p.name for p in (node / "sandboxes").iterdir()] == []


def test_restore_with_other_devices_is_refused_before_qemu_starts(built, tmp_path):
    store, node = built
    with Sandbox.create("busybox-shell", store=store, node_dir=node, backend="microvm",
                        limits=LIMITS) as sb:
        image = sb.handle.checkpoint(tmp_path / "ck", leave_running=True)
        assert sb.exec("true").ok
    qemu_before = _qemu_pids()
    with pytest.raises(CheckpointRefused, match="devices differ") as e:
        _restore(image, store=store, node_dir=node,
                        limits=Limits(memory_bytes=512 << 20))
    assert "memory_mib" in (e.value.context or "")
    assert _qemu_pids() <= qemu_before
    assert list((node / "sandboxes").iterdir()) == []


def test_the_sdk_calls_checkpoint_restore_and_fork_work_on_a_microvm(built):
    """The issue's "same call on a microVM": ``Sandbox.checkpoint(publish=)`` stores the VM's
    memory image and files as one checkpoint lock, ``Sandbox.restore(ref)`` brings the VM back
    (same process, still counting; no boot) and ``fork`` gives independent children."""
    store, node = built
    sb = Sandbox.create("busybox-shell", store=store, node_dir=node, backend="microvm",
                        limits=LIMITS)
    made: list[Sandbox] = []
    try:
        loop_pid = int(sb.exec(COUNTER).stdout)
        sb.write_file("/workspace/state.txt", "checkpointed\n")
        at = _wait_counter(sb, 3)
        result = sb.checkpoint("ckpt/vm-sdk", leave_running=True)
        assert result.ref == "ckpt/vm-sdk" and result.image_bytes > 0
        restored = Sandbox.restore("ckpt/vm-sdk", store=store, node_dir=node, limits=LIMITS)
        made.append(restored)
        assert restored.backend == "microvm"
        assert b"envbuild-init: ready" not in restored.handle._console()  # no kernel boot
        assert _counter(restored) >= at
        assert restored.exec(f"cat /proc/{loop_pid}/cmdline").ok
        assert restored.read_file("/workspace/state.txt") == b"checkpointed\n"
        children = restored.fork(2, limits=LIMITS)
        made.extend(children)
        for i, child in enumerate(children):
            child.write_file("/workspace/child.txt", f"{i}\n")
        assert [c.read_file("/workspace/child.txt") for c in children] == [b"0\n", b"1\n"]
        assert not restored.exec("test -e /workspace/child.txt").ok
        for child in children:
            _wait_counter(child, _counter(child))
        pids = [s.host_pid for s in (sb, *made)]
    finally:
        for s in made:
            s.close()
        sb.close()
    assert all(_gone(pid, 10) for pid in pids), "a QEMU outlived its sandbox"
