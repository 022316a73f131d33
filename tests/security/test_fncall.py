"""Issue 19 item 4: nothing of FnCall call N is visible to call N+1.

Each test runs real runc sandboxes of the busybox env on the ``fncall`` backend
(``runtime_shim.backends.fncall``): call N plants something (files in the writable layer, a changed
directory, a deleted image file, ``/dev/shm``, ``/dev``, background processes, env, a call past
its timeout) and call N+1 looks for it, with the host checking the same from outside (the
sandbox's cgroup, its layer dirs). Every test checks nothing outlives the sandbox.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime_shim.isolation import cgroupfs
from runtime_shim.node.model import Limits
from runtime_shim.sdk.sandbox import Sandbox

LOCK = "env/busybox-shell"


def _mounts_under(prefix: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if f" {prefix}/" in line]


@pytest.fixture
def fn(busybox_store):
    store, node = busybox_store
    sb = Sandbox.create(LOCK, store=store, node_dir=node, backend="fncall",
                        limits=Limits(disk_bytes=64 << 20, inodes=4096, pids=64))
    root = sb.paths.root
    try:
        yield sb
    finally:
        sb.close()
        assert not _mounts_under(root), _mounts_under(root)
        assert not root.exists()


def test_files_written_anywhere_are_gone_next_call(fn):
    planted = fn.call("echo a > /tmp/a && echo b > /root/b && echo c > /etc/c && "
                      "mkdir -p /var/x/y && echo d > /var/x/y/d && echo e > /dev/shm/e && "
                      "rm /etc/passwd && chmod 0700 /tmp && ls /tmp /etc/c /dev/shm/e")
    assert planted.ok, planted
    assert b"/etc/c" in planted.stdout and b"a" in planted.stdout
    after = fn.call("ls -A /tmp /root /dev/shm; ls /etc/c /var/x; stat -c %a /tmp; "
                    "test -f /etc/passwd && echo passwd-back")
    assert b"passwd-back" in after.stdout, after
    for leftover in (b"/etc/c", b"\na\n", b"\nb\n", b"\ne\n"):
        assert leftover not in after.stdout, after
    assert b"1777" in after.stdout  # /tmp's own mode, changed by call N, is the image's again
    assert b"No such file" in after.stderr  # /etc/c and /var/x


def test_the_upper_dir_of_call_n_is_deleted_and_the_next_is_empty(fn):
    handle = fn.handle
    tmp_slot = next(s for s in handle._slots if s.dest == "/tmp")
    assert fn.call("echo secret > /tmp/s").ok
    used = tmp_slot.upper
    assert (used / "s").read_text() == "secret\n"  # it was the layer the call wrote
    assert fn.call("true").ok  # call N+1 starts from a fresh layer
    assert not used.exists()
    assert tmp_slot.upper != used and list(tmp_slot.upper.iterdir()) == []


def test_background_processes_of_call_n_are_killed(fn):
    started = fn.call("setsid sh -c 'sleep 300' </dev/null >/dev/null 2>&1 & "
                      "nohup sleep 301 </dev/null >/dev/null 2>&1 & echo started")
    assert started.ok and b"started" in started.stdout
    handle = fn.handle
    # killed as soon as the call returned, not only when the next one starts
    assert cgroupfs.procs(fn.id) == [handle.init_pid]
    seen = fn.call("for p in /proc/[0-9]*; do cat $p/cmdline | tr '\\0' ' '; echo; done")
    assert b"sleep" not in seen.stdout, seen


def test_env_and_cwd_of_call_n_do_not_carry_over(fn):
    first = fn.call("cd /root && export LEAK=1 && echo $SECRET", env={"SECRET": "s3cret"})
    assert first.stdout == b"s3cret\n"
    second = fn.call("env; pwd")
    assert b"s3cret" not in second.stdout and b"LEAK" not in second.stdout
    assert second.stdout.endswith(b"\n/workspace\n")  # the lock's workdir, not call N's cd


def test_a_call_past_its_timeout_is_killed_and_its_sandbox_not_reused_dirty(fn):
    slow = fn.call("echo partial > /tmp/partial; (setsid sleep 300 &); "
                   "while true; do echo x >> /tmp/grow; done", timeout=0.5)
    assert slow.timed_out
    handle = fn.handle
    assert cgroupfs.procs(fn.id) == [handle.init_pid]
    after = fn.call("ls -A /tmp; for p in /proc/[0-9]*; do cat $p/cmdline; echo; done")
    assert after.ok
    assert b"partial" not in after.stdout and b"grow" not in after.stdout
    assert b"sleep" not in after.stdout


def test_a_change_to_dev_retires_the_container(fn):
    handle = fn.handle
    before = handle.init_pid
    assert fn.call("echo x > /dev/planted && chmod 0666 /dev/null 2>/dev/null; true").ok
    after = fn.call("ls /dev")
    assert b"planted" not in after.stdout, after
    assert handle.init_pid != before and handle.restarts == 1  # /dev is not a slot


def test_dev_flooded_or_chmod_is_retired_too(fn):
    handle = fn.handle
    assert fn.call("chmod 0777 /dev").ok
    assert fn.call("stat -c %a /dev").stdout == b"755\n"
    assert handle.restarts == 1
    assert fn.call("i=0; while [ $i -lt 400 ]; do : > /dev/f$i; i=$((i+1)); done").ok
    assert fn.call("ls /dev | grep -c '^f[0-9]'").stdout == b"0\n"
    assert handle.restarts == 2


def test_a_slot_unmounted_in_the_sandbox_namespace_is_repaired(fn):
    """Slots live only in the sandbox's own mount namespace (nothing of them is mounted on
    the host, so no namespace cloned elsewhere holds a peer). Should a layer still go missing
    (simulated: detached with nsenter), the sandbox sees the read-only image dir beneath,
    and the next call restarts the container."""
    import subprocess

    handle = fn.handle
    host_mounts = _mounts_under(fn.paths.root)
    assert not any("/fn/" in m or " overlay " in m and "/base " not in m
                   for m in host_mounts), host_mounts
    subprocess.run(["nsenter", "-t", str(handle.init_pid), "-m", "--", "umount", "-l", "/tmp"],
                   check=True)
    from runtime_shim.backends.container import ContainerSandbox

    raw = ContainerSandbox.exec(handle, fn._request("echo x > /tmp/escape; ls -A /tmp",
                                                    timeout=10, env=None, cwd=None, user=None,
                                                    stdin=None))
    assert b"Read-only" in raw.stderr and raw.stdout == b"", raw
    restarts = handle.restarts
    repaired = fn.call("echo ok > /tmp/ok && cat /tmp/ok && ls /etc/passwd")
    assert repaired.stdout == b"ok\n/etc/passwd\n", repaired
    assert handle.restarts == restarts + 1


def test_files_argument_lands_in_the_fresh_layer_only(fn):
    got = fn.call(["cat", "/tmp/in.txt"], files={"/tmp/in.txt": "input-1"})
    assert got.stdout == b"input-1"
    again = fn.call(["ls", "-A", "/tmp"])
    assert again.stdout == b""


def test_same_isolation_as_a_container_sandbox(fn, busybox_store):
    store, node = busybox_store
    probe = ("grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; "
             "cat /proc/net/dev | tail -n +3 | cut -d: -f1")
    got = fn.call(probe)
    with Sandbox.create(LOCK, store=store, node_dir=node) as plain:
        want = plain.exec(probe)
    assert got.stdout == want.stdout, (got, want)
    assert b"NoNewPrivs:\t1" in got.stdout and b"Seccomp:\t2" in got.stdout
    assert got.stdout.split(b"\n")[-2].strip() == b"lo"  # no interface but loopback
    # the root itself is read-only: only the slots are writable
    denied = fn.call("mkdir /newdir")
    assert denied.exit_code != 0 and b"Read-only" in denied.stderr
    # the pids limit holds
    assert cgroupfs.controller_dir("pids", fn.id) is not None
    pids_dir = cgroupfs.controller_dir("pids", fn.id)
    assert pids_dir is not None
    assert (pids_dir[0] / "pids.max").read_text().strip() == "64"


def test_disk_limit_holds_and_is_given_back_between_calls(fn):
    full = fn.call("dd if=/dev/zero of=/tmp/big bs=1M count=200 2>&1; echo rc=$?")
    assert b"No space left" in full.stdout, full
    # the next call has the whole disk again
    again = fn.call("dd if=/dev/zero of=/tmp/big bs=1M count=32 2>&1; echo rc=$?")
    assert b"rc=0" in again.stdout, again
    st = os.statvfs(fn.handle.paths.disk)
    assert st.f_bavail * st.f_frsize > 16 << 20
