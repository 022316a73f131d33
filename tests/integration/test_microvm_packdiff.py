"""pack-diff from a microVM, and snapshots crossing backends (issue "MicroVM backend", item 5):
a VM's changes restore in a container and a container's in a VM, the VM runs on after
pack-diff, and no host mount or loop device outlives it, a failed one included.

Two VM boots in all (seconds each under TCG): one shared by the VM-side checks, one for the
container snapshot restored in a VM.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.isolation.stub import STUB_FILES
from runtime_shim.node.locks import resolve
from runtime_shim.node.packdiff import SnapshotPolicy, SnapshotRefused
from runtime_shim.sdk.sandbox import Limits, Sandbox
from tests.integration.conftest import build_busybox_env
from tests.integration.test_microvm import _require_vm_tools
from tests.integration.test_packdiff import CHANGES, LISTING

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENV = "busybox-shell"
VM_LIMITS = Limits(memory_bytes=384 << 20)
EMPTY_MD5 = "d41d8cd98f00b204e9800998ecf8427e"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    _require_vm_tools()
    return build_busybox_env(tmp_path_factory.mktemp("vm-packdiff"))


@pytest.fixture(scope="module")
def vm(built):
    store, node = built
    sb = Sandbox.create(ENV, store=store, node_dir=node, backend="microvm", limits=VM_LIMITS)
    yield sb
    sb.close()


def _listing(sb: Sandbox) -> str:
    """The tree as ``LISTING`` prints it, less what differs by backend and not by snapshot:
    directory sizes (4096 on ext4, the entries' bytes on EROFS) and link counts (overlayfs
    says 1 for a directory merged from several layers), and the container stub's empty
    placeholders for its bind mounts (``runtime_shim.isolation.stub``; a VM has no such binds)."""
    r = sb.exec(LISTING)
    assert r.exit_code == 0, r.stderr
    placeholders = {f"./{f} regular empty file 644 0:0 0 1  {EMPTY_MD5}" for f in STUB_FILES}
    lines = [re.sub(r"^(\S+ directory \d+ \d+:\d+) \d+ \d+ ", r"\1 - - ", line)
             for line in r.stdout.decode().splitlines() if line not in placeholders]
    return "\n".join(lines) + "\n"


def _loops(node) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if str(node) in line]


def _assert_nothing_left_on_the_host(node) -> None:
    assert mounted_targets_under(str(node)) == []
    assert _loops(node) == []
    with open("/proc/self/mountinfo") as f:
        assert "snapshot-rw" not in f.read()


def _writes_work(sb: Sandbox) -> bool:
    """A write to the upper dir completes: the guest's disk is thawed and the VM runs."""
    r = sb.exec("echo w > /workspace/.thawed && cat /workspace/.thawed && rm /workspace/.thawed",
                timeout=20)
    return r.exit_code == 0 and r.stdout == b"w\n"


def _expected(listing: str) -> str:
    return listing.replace("workspace/README.md regular file 4755",
                           "workspace/README.md regular file 755")  # setuid stripped by policy


def test_vm_snapshot_restores_in_a_container(built, vm):
    store, node = built
    assert vm.exec(CHANGES).exit_code == 0
    # Renaming a merged dir: with redirect_dir=off overlayfs answers EXDEV and mv copies, so
    # the upper dir holds no redirect xattr, which the layer writer would refuse.
    assert vm.exec("mv /workspace/bin /workspace/bin-renamed").ok
    before = _listing(vm)
    assert "./workspace/bin-renamed/kv/inner/f regular file" in before
    result = vm.pack_diff("snap/vm")
    print(f"\nmicroVM pack-diff: {result.seconds * 1000:.0f} ms, {result.size} bytes")
    assert result.ref == "snap/vm"
    assert {(d["path"], d["action"]) for d in result.report.decisions} == {
        ("workspace/README.md", "stripped")}
    assert vm.exec("echo still running").stdout == b"still running\n"
    assert _writes_work(vm)
    _assert_nothing_left_on_the_host(node)
    lock = resolve(store, "snap/vm")
    assert lock.layers[-1].role == "snapshot"
    assert lock.manifest["annotations"]["org.envbuild.parent.lock"] == resolve(store, ENV).digest
    with Sandbox.create("snap/vm", store=store, node_dir=node) as c:
        after = _listing(c)
    assert after == _expected(before)
    assert "./workspace/tests/test_basic.sh" not in after  # opaque dir: old entries gone
    assert "./workspace/lib regular file" in after and "./workspace/bin/" not in after
    assert "./workspace/hard.txt regular file 750 1000:1000 6 2" in after  # still a hardlink


def test_container_snapshot_restores_in_a_vm(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as c:
        assert c.exec(CHANGES).exit_code == 0
        before = _listing(c)
        c.pack_diff("snap/container")
    with Sandbox.create("snap/container", store=store, node_dir=node, backend="microvm",
                        limits=VM_LIMITS) as v:
        after = _listing(v)
        # and a snapshot of that VM (snapshot of a snapshot) restores in a container again
        assert v.exec("echo again > /workspace/again; rm /workspace/added.txt").ok
        expected_again = _listing(v)
        v.pack_diff("snap/container-vm")
    assert after == _expected(before)
    with Sandbox.create("snap/container-vm", store=store, node_dir=node) as c:
        assert _listing(c) == expected_again
    _assert_nothing_left_on_the_host(node)


def test_refused_snapshot_leaves_no_mount_or_loop_and_the_vm_runs_on(built, vm):
    store, node = built
    with pytest.raises(SnapshotRefused, match="more than 1 entries"):
        vm.pack_diff("snap/refused", policy=SnapshotPolicy(max_entries=1))
    _assert_nothing_left_on_the_host(node)
    assert _writes_work(vm)
    with pytest.raises(Exception):  # noqa: B017 - any error: the point is that no ref exists
        store.get_ref("snap/refused")
    started = time.monotonic()
    vm.exec("echo second > /workspace/second")
    assert vm.pack_diff("snap/vm-2").ref == "snap/vm-2"  # nothing stuck frozen or paused
    print(f"\nsecond microVM pack-diff: {(time.monotonic() - started) * 1000:.0f} ms")
    _assert_nothing_left_on_the_host(node)


def test_upper_swapped_for_a_symlink_is_refused(built, vm):
    """A guest root can reach its disk's ext4 root; an ``upper`` pointing at the host's /etc
    must not make the host pack its own files."""
    _, node = built
    assert vm.exec("cd /.envbuild/rw && mv upper real-upper && ln -s /etc upper").ok
    with pytest.raises(RuntimeShimError, match="not a directory"):
        vm.pack_diff("snap/tampered")
    _assert_nothing_left_on_the_host(node)
    assert vm.exec("echo alive").stdout == b"alive\n"
