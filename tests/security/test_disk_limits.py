"""Issue 11 item 4: a sandbox (or a build step) must not be able to fill the host's disk.

Each sandbox writes to its own capped disk (``runtime_shim.node.diskpool``): a subvolume of the
node's btrfs pool capped by a quota group (the default), or a loop-mounted ext4
(``ENVBUILD_SANDBOX_DISK=loop``); the sandbox tests run in both modes. Its writable layer,
``/tmp`` and agent run dir are on it. The attacks run against real runc sandboxes of the busybox env and
a real ``envbuild build``; every test checks the write really happened up to the limit and
that nothing of the disk (mount, loop device, image) outlives the sandbox.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runtime_shim.isolation import scratchfs
from runtime_shim.node import diskpool
from runtime_shim.node.layout import NodeLayout
from runtime_shim.sdk.sandbox import Limits, Sandbox, gc_sandboxes, list_sandboxes
from tests.conftest import REPO, require_tool

MiB = 1 << 20
SMALL = Limits(disk_bytes=64 * MiB, inodes=2048)
#: What a write past the cap gets: ENOSPC from a full loop disk, EDQUOT from a quota group.
FULL = ("No space left on device", "Disk quota exceeded")


@pytest.fixture(params=["pool", "loop"])
def disk_mode(request, monkeypatch):
    monkeypatch.setenv("ENVBUILD_SANDBOX_DISK", request.param)
    return request.param


def _full(out: str) -> bool:
    return any(e in out for e in FULL)


def _host_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _loops_under(prefix: Path) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if str(prefix) in line]


def _mounts_under(prefix: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if f" {prefix}/" in line or f" {prefix} " in line]


def _assert_nothing_left(root: Path) -> None:
    scratchfs.settle(10)  # close() leaves the loop device's last close to a thread
    assert not _loops_under(root), _loops_under(root)
    assert not _mounts_under(root), _mounts_under(root)
    assert not root.exists()


def _assert_node_clean(node: Path) -> None:
    """Once the pool's grace is cut short (``diskpool.unmount_idle``, as its process's exit and
    ``sandbox gc`` past the grace do), no mount nor loop device under ``node`` (a pool's loop
    device detaches a moment after its unmount on a loaded host: autoclear)."""
    diskpool.unmount_idle(NodeLayout(node))
    assert not _mounts_under(node), _mounts_under(node)
    deadline = time.monotonic() + 10
    while _loops_under(node) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _loops_under(node), _loops_under(node)


@pytest.fixture
def small_sandbox(busybox_store, disk_mode):
    store, node = busybox_store
    sb = Sandbox.create("env/busybox-shell", store=store, node_dir=node, limits=SMALL)
    try:
        yield sb
    finally:
        sb.close()


def test_fallocate_40g_gets_enospc_and_host_disk_does_not_grow(small_sandbox, busybox_store):
    _, node = busybox_store
    before = _host_free(node)
    r = small_sandbox.exec("fallocate -l 40G /big; echo rc=$?; rm -f /big; "
                           "dd if=/dev/zero of=/fill bs=1M count=200 2>&1; echo rc=$?")
    out = r.stdout.decode() + r.stderr.decode()
    assert _full(r.stderr.decode()) and _full(r.stdout.decode()), out  # fallocate's, dd's
    assert "rc=0" not in out, out
    # The real writes went up to the limit (the disk really filled), and no further.
    filled = int(small_sandbox.exec("stat -c %s /fill").stdout)
    assert 32 * MiB < filled <= SMALL.disk_bytes, filled
    if small_sandbox.paths.disk.is_symlink():  # pool: the sandbox's disk is its subvolume
        assert small_sandbox.paths.disk.resolve().parent.name == "mnt"
    else:
        st = os.statvfs(small_sandbox.paths.disk)
        assert st.f_blocks * st.f_frsize <= SMALL.disk_bytes
    # Other engineers' work shares the host disk: allow noise, far below the 40 GB attack.
    assert before - _host_free(node) < SMALL.disk_bytes + (1 << 30)


def test_inode_bomb_gets_enospc_on_a_loop_disk(busybox_store, monkeypatch):
    """A loop disk caps inodes; the pool caps files by their metadata's bytes instead
    (``test_disk_pool.py::test_file_bomb_stops_at_the_cap``)."""
    monkeypatch.setenv("ENVBUILD_SANDBOX_DISK", "loop")
    store, node = busybox_store
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node, limits=SMALL) as sb:
        r = sb.exec("mkdir /bomb && cd /bomb && seq 1 5000 | xargs touch; echo rc=$?; "
                    "ls /bomb | wc -l")
    out = r.stdout.decode() + r.stderr.decode()
    assert "No space left on device" in out, out
    made = int(r.stdout.decode().split()[-1])
    assert 1000 < made < SMALL.inodes, made


# "/" is the writable layer; the agent's socket is on the host, no longer in the sandbox.
@pytest.mark.parametrize("where", ["/tmp", "/dev/shm", "/"])
def test_every_writable_place_is_capped(small_sandbox, where):
    r = small_sandbox.exec(f"dd if=/dev/zero of={where}/fill bs=1M count=200 2>&1; echo rc=$?")
    out = r.stdout.decode()
    assert _full(out) and "rc=0" not in out, out


def test_tmp_is_on_the_sandbox_disk_not_in_snapshots(small_sandbox):
    small_sandbox.exec("dd if=/dev/zero of=/tmp/t bs=1M count=8")
    assert (small_sandbox.paths.disk / "tmp" / "t").stat().st_size == 8 * MiB
    assert not (small_sandbox.paths.upper / "tmp" / "t").exists()


def test_close_leaves_no_loop_device_mount_or_image(busybox_store, disk_mode, tmp_path):
    store, node = busybox_store[0], tmp_path / "node"  # its own: nothing else holds the pool
    sb = Sandbox.create("env/busybox-shell", store=store, node_dir=node, limits=SMALL)
    root = sb.paths.root
    # the disk really was there: a loop disk of its own, mounted on the host; or the pool's
    # (one for the node), a subvolume and no mount of the sandbox's own
    assert len(_loops_under(root if disk_mode == "loop" else node)) == 1
    assert bool(_mounts_under(root)) == (disk_mode == "loop"), _mounts_under(root)
    assert sb.exec("echo hi > /x && cat /x").stdout == b"hi\n"
    sb.close()
    _assert_nothing_left(root)
    _assert_node_clean(node)  # the pool goes once its last sandbox did


def test_gc_of_a_crashed_creator_leaves_no_loop_device_mount_or_image(busybox_store,
                                                                      disk_mode, tmp_path):
    store, node = busybox_store[0], tmp_path / "node"
    code = textwrap.dedent(f"""
        import os
        from envbuild.store import LocalStore
        from runtime_shim.sdk.sandbox import Limits, Sandbox
        sb = Sandbox.create("env/busybox-shell", store=LocalStore({str(store.root)!r}),
                            node_dir={str(node)!r}, limits=Limits(disk_bytes=64 << 20))
        from runtime_shim.sdk import exitwatch
        exitwatch.stop()  # a crash its watcher dies in too: gc removes what is left
        print(sb.id, flush=True)
        os._exit(9)  # a crash: nothing closed, nothing unmounted
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    sandbox_id = proc.stdout.strip()
    assert proc.returncode == 9 and sandbox_id.startswith("eb-"), proc.stderr
    root = node / "sandboxes" / sandbox_id
    # the crash really left the disk behind
    assert len(_loops_under(root if disk_mode == "loop" else node)) == 1
    assert sandbox_id in [i.id for i in list_sandboxes(node)]
    assert sandbox_id in gc_sandboxes(node)
    _assert_nothing_left(root)
    _assert_node_clean(node)


RUNAWAY = """\
apiVersion: envbuild/v1
kind: Toolkit
name: runaway
description: a step that writes past the layer's disk limit
build_on: busybox-tiny
requires: {abi: [busybox-amd64]}
prefix: /opt/toolkits/runaway
steps:
  - run: mkdir -p /opt/toolkits/runaway && dd if=/dev/zero of=/opt/toolkits/runaway/big bs=1M count=200
    network: none
"""


def test_build_step_past_its_disk_limit_fails_with_one_line(envbuild_cli):
    require_tool("mkfs.ext4")
    (envbuild_cli.defs / "toolkits" / "runaway.yaml").write_text(RUNAWAY)
    envbuild_cli.monkeypatch.setenv("ENVBUILD_BUILD_DISK", "64M")
    r = envbuild_cli("build", "runaway")
    assert r.code == 1, (r.out, r.err)
    assert "Traceback" not in r.err
    errors = [line for line in r.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "runaway: step 1/1" in errors[0] \
        and "out of space" in errors[0], r.err
    assert "No space left on device" in r.err  # dd's own message, in the output tail
    builds = envbuild_cli.node / "builds"
    assert not (builds.exists() and any(builds.iterdir()))
    scratchfs.settle(10)
    assert not _loops_under(envbuild_cli.node) and not _mounts_under(envbuild_cli.node)


@pytest.mark.slow
def test_microvm_disk_is_sized_from_limits(busybox_store, monkeypatch):
    """One TCG boot: the VM's writable disk has Limits.disk_bytes / inodes, not 4 GiB."""
    for tool in ("qemu-system-x86_64", "mkfs.erofs", "mkfs.ext4", "gcc"):
        require_tool(tool)
    from runtime_shim.backends.vm import qemu

    monkeypatch.delenv("ENVBUILD_VM_DISK", raising=False)
    monkeypatch.setattr(qemu, "CONSOLE_LOG_CAP", 256 << 10)
    store, node = busybox_store
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node, backend="microvm",
                        limits=Limits(memory_bytes=384 << 20, disk_bytes=64 * MiB,
                                      inodes=2048)) as vm:
        assert os.stat(vm.paths.root / "rw.ext4").st_size == 64 * MiB
        r = vm.exec("fallocate -l 40G /big; echo rc=$?; rm -f /big; "
                    "dd if=/dev/zero of=/fill bs=1M count=200 2>&1; echo rc=$?; "
                    "mkdir /bomb && cd /bomb && seq 1 5000 | xargs touch; echo rc=$?",
                    timeout=300)
        out = r.stdout.decode() + r.stderr.decode()
        assert out.count("No space left on device") >= 3 and "rc=0" not in out, out
        assert os.stat(vm.paths.root / "rw.ext4").st_blocks * 512 <= 64 * MiB
        # The console log (a host file) is capped too: guest root writes to its console.
        r = vm.exec("for d in /dev/ttyS0 /dev/console; do [ -c $d ] || continue; "
                    "head -c 400000 /dev/zero | tr '\\0' x > $d && echo wrote $d && break; done",
                    timeout=300)
        assert b"wrote" in r.stdout, r
        log = (vm.paths.root / "console.log").read_bytes()
        assert len(log) < (256 << 10) + 4096 and b"KiB dropped" in log


def test_agent_stderr_log_is_capped_too(small_sandbox):
    """The agent's stderr (runc's start log) is a host file: sandbox root must not fill the host
    through /proc/1/fd/2. The agent is non-dumpable, so opening it is refused; and were it not,
    the file lives on the capped disk."""
    r = small_sandbox.exec("dd if=/dev/zero of=/proc/1/fd/2 bs=1M count=200 2>&1; echo rc=$?")
    out = r.stdout.decode()
    log = small_sandbox.paths.disk / "start.log"
    assert log.is_file()
    assert "rc=0" not in out, out
    assert any(why in out for why in ("Permission denied", "No such file",
                                      "No space left on device")), out
    assert log.stat().st_size < SMALL.disk_bytes, log.stat().st_size


YES = """\
apiVersion: envbuild/v1
kind: Toolkit
name: chatty
description: a step that prints forever
build_on: busybox-tiny
requires: {abi: [busybox-amd64]}
prefix: /opt/toolkits/chatty
steps:
  - run: yes | head -c 200000000; exit 3
    network: none
"""


def test_build_step_output_to_the_log_is_capped(envbuild_cli, monkeypatch):
    """``yes`` in a step: the build log (a host file, outside the layer's disk) never holds
    more than the cap (its head and tail); the step's own exit code is still reported."""
    from envbuild.build import buildlog

    monkeypatch.setattr(buildlog, "BUILD_LOG_CAP", 4 * MiB)
    (envbuild_cli.defs / "toolkits" / "chatty.yaml").write_text(YES)
    r = envbuild_cli("build", "chatty")
    assert r.code == 1 and "exited 3" in r.err, r.err
    log = next((envbuild_cli.store / "logs").glob("chatty-*.log"))
    assert 2 * MiB <= log.stat().st_size <= 4 * MiB
    assert log.read_bytes().count(buildlog.TRIM_NOTE) == 1
