"""Issue 34, items 3 and 7: a node admits sandboxes and build disks only within its budget.

Observed before: two default sandboxes (505 processes x 4,090 open files each, within their
limits) filled ``fs.file-max``, after which a third sandbox's exec failed and unprivileged
host processes could not start; and nothing compared the sum of sparse sandbox and build disks
with the node's free space. Now every sandbox reserves its worst case (``pids × nofile`` open
files, ``pids`` tasks, ``disk_bytes``) in the node's ledger and one past the budget is refused
with one line naming it (``runtime_shim.node.admission``).

Real runc sandboxes of the busybox env, each test on a node dir of its own (the budget and the
ledger are per node dir). Budgets are made small with ``ENVBUILD_NODE_BUDGET`` so nothing here
comes near the host's real tables, except ``test_the_observed_attack_is_refused_on_the_real_
file_table``, which only reserves (the sandboxes it admits open nothing).
"""

from __future__ import annotations

import dataclasses
import errno
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from envbuild.errors import AdmissionRefused, BackendUnavailable
from runtime_shim.isolation import scratchfs
from runtime_shim.node.admission import sandbox_key
from runtime_shim.node.ledger import Ledger
from runtime_shim.sdk.sandbox import Limits, Sandbox, gc_sandboxes
from tests.conftest import REPO, require_tool

ENV = "env/busybox-shell"
MiB = 1 << 20
#: 16 tasks, 16 x 64 = 1024 open files, no disk: small and quick
SMALL = Limits(pids=16, nofile=64, memory_bytes=64 * MiB, disk_bytes=None)


@pytest.fixture(autouse=True)
def strict_files(monkeypatch):
    """These tests check the strict worst case of open files (issue 34);
    ``test_admission_overcommit.py`` checks the overcommitted default (issue 39)."""
    monkeypatch.setenv("ENVBUILD_FILES_OVERCOMMIT", "1")


def _create(store, node: Path, limits: Limits = SMALL) -> Sandbox:
    return Sandbox.create(ENV, store=store, node_dir=node, limits=limits)


def _ledger(node: Path) -> dict:
    return Ledger(node / "node").reserved()


def _sandbox_dirs(node: Path) -> list[str]:
    root = node / "sandboxes"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.mark.parametrize("budget, limits, name, shown", [
    ("files=2500", SMALL, "open files", "files=2500"),
    ("tasks=40", SMALL, "tasks", "tasks=40"),
    ("disk=150M", dataclasses.replace(SMALL, disk_bytes=64 * MiB, inodes=2048), "disk",
     "disk=150 MiB"),
])
def test_the_sandbox_past_the_node_budget_is_refused_with_one_line(
        busybox_store, tmp_path, monkeypatch, budget, limits, name, shown):
    if limits.disk_bytes:
        require_tool("mkfs.ext4")
        # a loop disk reserves its whole cap; the pool's accounting: test_disk_pool.py
        monkeypatch.setenv("ENVBUILD_SANDBOX_DISK", "loop")
    store, _ = busybox_store
    node = tmp_path / "node"
    monkeypatch.setenv("ENVBUILD_NODE_BUDGET", budget)
    made = [_create(store, node, limits), _create(store, node, limits)]
    first, second = made
    try:
        for sb in made:  # the admitted ones work
            assert sb.exec("echo ok").stdout == b"ok\n"
        with pytest.raises(AdmissionRefused) as e:
            made.append(_create(store, node, limits))
        line = e.value.message
        assert line.startswith(f"node budget of {name} exceeded: sandbox eb-"), line
        assert "reserved by 2 other(s)" in line and f"ENVBUILD_NODE_BUDGET {shown}" in line
        assert "\n" not in line and "ENVBUILD_NODE_BUDGET" in e.value.hint
        # nothing of the refused one is left: no dir, no ledger entry
        assert _sandbox_dirs(node) == sorted([first.id, second.id])
        assert sorted(_ledger(node)) == sorted(sandbox_key(s.id) for s in (first, second))
        # closing one gives its share back
        first.close()
        made.append(_create(store, node, limits))
        assert made[-1].exec("echo ok").stdout == b"ok\n"
    finally:
        for sb in made:
            sb.close()
    assert _ledger(node) == {}
    scratchfs.settle(10)


def test_the_observed_attack_is_refused_on_the_real_file_table(busybox_store, tmp_path,
                                                               monkeypatch):
    """The old default (512 processes x 4096 files) against this host's real fs.file-max, less
    the host's quarter: sandboxes are admitted only while the sum of what they could open
    fits; the default one (256 x 1024) is admitted and reserves exactly its product."""
    monkeypatch.delenv("ENVBUILD_NODE_BUDGET", raising=False)
    monkeypatch.delenv("ENVBUILD_HOST_RESERVE", raising=False)
    store, _ = busybox_store
    node = tmp_path / "node"
    file_max = int(Path("/proc/sys/fs/file-max").read_text())
    old = Limits(pids=512, nofile=4096, disk_bytes=None)
    each = 512 * 4096
    fits = int(file_max * 0.75) // each
    assert fits <= 32, f"fs.file-max {file_max}: this host's table is too large for this test"
    admitted: list[Sandbox] = []
    try:
        with pytest.raises(AdmissionRefused) as e:
            for _ in range(fits + 1):
                admitted.append(_create(store, node, old))
        assert len(admitted) == fits
        assert "node budget of open files exceeded" in e.value.message
        assert f"of fs.file-max {file_max}" in e.value.message
        assert "fs.file-max" in e.value.hint and "Limits.nofile" in e.value.hint
        for sb in admitted:
            sb.close()
        admitted.clear()
        default = dataclasses.replace(Limits(), disk_bytes=None)
        with _create(store, node, default) as sb:
            assert _ledger(node)[sandbox_key(sb.id)].files == 256 * 1024
            assert sb.exec("ulimit -n").stdout == b"1024\n"
    finally:
        for sb in admitted:
            sb.close()


@pytest.mark.parametrize("field", ["pids", "memory_bytes"])
def test_a_sandbox_without_a_pids_or_memory_limit_is_refused(busybox_store, tmp_path, field):
    """``pids=None`` leaves the tasks and (with ``nofile``) the file table unbounded;
    ``memory_bytes=None`` the kernel memory its processes pin (dentries, inodes, open files:
    charged to its memory cgroup, so the memory limit is what bounds them). Refused before
    anything is made, with one line."""
    store, _ = busybox_store
    node = tmp_path / "node"
    made: list[Sandbox] = []
    try:
        with pytest.raises(AdmissionRefused, match=f"Limits.{field}=None") as e:
            made.append(_create(store, node, dataclasses.replace(SMALL, **{field: None})))
    finally:
        for sb in made:
            sb.close()
    assert e.value.hint and "\n" not in e.value.message
    assert _sandbox_dirs(node) == [] and _ledger(node) == {}


def test_concurrent_creates_never_overshoot_the_budget(busybox_store, tmp_path, monkeypatch):
    """Six creates at once on a node whose budget holds three: the ledger's lock admits three
    exactly, whatever the interleaving."""
    store, _ = busybox_store
    node = tmp_path / "node"
    _create(store, node).close()  # the layers fetched: the six race on admission alone
    monkeypatch.setenv("ENVBUILD_NODE_BUDGET", "tasks=48")
    made: list[Sandbox] = []
    refused: list[AdmissionRefused] = []
    lock = threading.Lock()

    def create() -> None:
        try:
            sb = _create(store, node)
        except AdmissionRefused as e:
            with lock:
                refused.append(e)
        else:
            with lock:
                made.append(sb)

    threads = [threading.Thread(target=create) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert (len(made), len(refused)) == (3, 3), (made, refused)
        assert sum(e.tasks for e in _ledger(node).values()) == 48
    finally:
        for sb in made:
            sb.close()


def test_a_killed_creators_reservation_is_given_back(busybox_store, tmp_path, monkeypatch):
    """A process that dies without closing its sandbox (kill -9) leaves its reservation; the
    next create sweeps the orphan and its reservation with it, and is admitted."""
    store, _ = busybox_store
    node = tmp_path / "node"
    script = textwrap.dedent(f"""
        import os, sys
        from runtime_shim.sdk.sandbox import Limits, Sandbox
        sb = Sandbox.create({ENV!r}, store={str(store.root)!r}, node_dir={str(node)!r},
                            limits=Limits(pids=16, nofile=64, memory_bytes=64 << 20,
                                          disk_bytes=None))
        print(sb.id, flush=True)
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    orphan = proc.stdout.strip()
    try:
        assert sandbox_key(orphan) in _ledger(node)  # the crash really left it reserved
        monkeypatch.setenv("ENVBUILD_NODE_BUDGET", "tasks=16")  # room for one sandbox
        with _create(store, node) as sb:
            assert sorted(_ledger(node)) == [sandbox_key(sb.id)]
            assert _sandbox_dirs(node) == [sb.id]
    finally:
        gc_sandboxes(node)


def test_an_entry_whose_owner_vanished_does_not_hold_the_budget(busybox_store, tmp_path,
                                                                monkeypatch):
    """A reservation whose dir is gone (a host rebooted, a node dir cleaned by hand) is
    dropped when it would cause a refusal, never counted forever."""
    store, _ = busybox_store
    node = tmp_path / "node"
    monkeypatch.setenv("ENVBUILD_NODE_BUDGET", "tasks=16")
    from runtime_shim.node.admission import BudgetSettings, Reservation

    Ledger(node / "node").admit("sandbox:eb-gone", Reservation(tasks=16),
                                tmp_path / "no-such-dir", what="sandbox eb-gone",
                                settings=BudgetSettings.from_env({}))
    with _create(store, node) as sb:
        assert sorted(_ledger(node)) == [sandbox_key(sb.id)]


BUILD = """\
apiVersion: envbuild/v1
kind: Toolkit
name: small
description: a layer that writes one file
build_on: busybox-tiny
requires: {abi: [busybox-amd64]}
prefix: /opt/toolkits/small
steps:
  - run: mkdir -p /opt/toolkits/small && echo hi > /opt/toolkits/small/hi
    network: none
"""


def test_a_build_disk_past_the_node_budget_is_refused_with_one_line(envbuild_cli):
    """A layer's scratch disk is reserved too: one that could never fit the node's disk budget
    fails the build with one line naming it, and leaves nothing."""
    require_tool("mkfs.ext4")
    (envbuild_cli.defs / "toolkits" / "small.yaml").write_text(BUILD)
    envbuild_cli.monkeypatch.setenv("ENVBUILD_BUILD_DISK", "64M")
    envbuild_cli.monkeypatch.setenv("ENVBUILD_NODE_BUDGET", "disk=32M")
    r = envbuild_cli("build", "small")
    assert r.code == 1, (r.out, r.err)
    assert "Traceback" not in r.err
    errors = [line for line in r.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.err
    assert "node budget of disk exceeded: the build of" in errors[0], r.err
    assert "ENVBUILD_NODE_BUDGET disk=32 MiB" in errors[0], r.err
    builds = envbuild_cli.node / "builds"
    assert not (builds.exists() and any(p.suffix != ".owner" and p.is_dir()
                                        for p in builds.iterdir())), list(builds.iterdir())
    assert _ledger(envbuild_cli.node) == {}
    # within the budget the same build passes, and gives its disk back
    envbuild_cli.monkeypatch.setenv("ENVBUILD_NODE_BUDGET", "disk=256M")
    r = envbuild_cli("build", "small")
    assert r.code == 0, r.err
    assert _ledger(envbuild_cli.node) == {}


def test_a_build_disk_waits_for_another_builds_or_gets_what_is_left(tmp_path):
    """The ledger's rules for build disks, on real files: a disk that fits only once another
    build gives its back waits for it; one that may be smaller gets what is left; one that
    could never fit is refused at once, whatever the wait."""
    from runtime_shim.node.admission import BudgetSettings, Reservation

    ledger = Ledger(tmp_path / "node")
    settings = BudgetSettings(caps={"disk_bytes": 100 * MiB})
    want = Reservation(disk_bytes=64 * MiB)
    assert ledger.admit("build:a", want, tmp_path, what="the build of a", settings=settings,
                        min_disk=64 * MiB) == want
    timer = threading.Timer(1.0, ledger.release, args=("build:a",))
    timer.start()
    started = time.monotonic()
    told: list[str] = []
    got = ledger.admit("build:b", want, tmp_path, what="the build of b", settings=settings,
                       wait=30, min_disk=64 * MiB, on_wait=told.append)
    assert got == want and 0.9 < time.monotonic() - started < 10
    # the waiter is told why, once, however many times it looked again
    assert len(told) == 1 and "the build of b" in told[0] and "disk" in told[0], told
    assert ledger.admit("build:c", want, tmp_path, what="the build of c", settings=settings,
                        min_disk=16 * MiB) == Reservation(disk_bytes=36 * MiB)
    started = time.monotonic()
    with pytest.raises(AdmissionRefused, match="node budget of disk exceeded: the build of d"):
        ledger.admit("build:d", Reservation(disk_bytes=200 * MiB), tmp_path,
                     what="the build of d", settings=settings, wait=30, min_disk=128 * MiB)
    assert time.monotonic() - started < 1
    assert sorted(ledger.reserved()) == ["build:b", "build:c"]


SMALL2 = BUILD.replace("small", "small2")


def test_parallel_builds_share_the_disk_budget(envbuild_cli):
    """Two layers built at once on a node whose disk budget holds one of their disks: the
    second waits for the first's, and both build."""
    require_tool("mkfs.ext4")
    (envbuild_cli.defs / "toolkits" / "small.yaml").write_text(BUILD)
    (envbuild_cli.defs / "toolkits" / "small2.yaml").write_text(SMALL2)
    envbuild_cli.monkeypatch.setenv("ENVBUILD_BUILD_DISK", "64M")
    envbuild_cli.monkeypatch.setenv("ENVBUILD_NODE_BUDGET", "disk=100M")
    r = envbuild_cli("build", "small", "small2")
    assert r.code == 0, r.err
    assert "waiting: for disk: node budget of disk exceeded" in r.err + r.out, r.err
    assert _ledger(envbuild_cli.node) == {}


INOTIFY_PROBE = r"""
#include <errno.h>
#include <stdio.h>
#include <sys/inotify.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    long rc = inotify_init1(0);
    printf("inotify_init1 %ld %d\n", rc, rc < 0 ? errno : 0);
#ifdef SYS_inotify_init
    rc = syscall(SYS_inotify_init);
    printf("inotify_init %ld %d\n", rc, rc < 0 ? errno : 0);
#endif
    return 0;
}
"""


@pytest.fixture(scope="module")
def inotify_probe(tmp_path_factory) -> bytes:
    gcc = require_tool("gcc")
    src = tmp_path_factory.mktemp("inotify") / "probe.c"
    src.write_text(INOTIFY_PROBE)
    subprocess.run([gcc, "-static", "-O1", "-o", str(src.with_suffix("")), str(src)],
                   check=True, capture_output=True)
    return src.with_suffix("").read_bytes()


def _inotify_calls(sb: Sandbox, probe: bytes) -> dict[str, tuple[int, int]]:
    sb.write_file("/tmp/probe", probe, mode=0o755)
    r = sb.exec(["/tmp/probe"])
    assert r.exit_code == 0, r.stderr
    return {name: (int(rc), int(err)) for name, rc, err in
            (line.split() for line in r.stdout.decode().splitlines())}


def test_inotify_is_refused_unless_the_sandbox_is_allowed_it(busybox_store, tmp_path,
                                                             inotify_probe):
    """inotify instances and watches are counted per uid, and a sandbox's root is the host's
    uid 0: a sandbox could take the host root's 128 instances (no cgroup bounds them). So its
    syscalls answer ENOSYS (as on a kernel without inotify) unless ``Limits.inotify``."""
    store, _ = busybox_store
    node = tmp_path / "node"
    with _create(store, node) as sb:
        calls = _inotify_calls(sb, inotify_probe)
        assert calls and all(v == (-1, errno.ENOSYS) for v in calls.values()), calls
        assert sb.exec("tail -f /dev/null & sleep 0.2; kill $!; echo ok").stdout == b"ok\n"
    with _create(store, node, dataclasses.replace(SMALL, inotify=True)) as sb:
        calls = _inotify_calls(sb, inotify_probe)
        assert calls and all(rc >= 0 for rc, _ in calls.values()), calls
    with pytest.raises(BackendUnavailable, match="no inotify"):
        Sandbox.create(ENV, store=store, node_dir=node, backend="fncall",
                       limits=dataclasses.replace(SMALL, inotify=True, disk_bytes=64 * MiB))
    assert _sandbox_dirs(node) == [] and _ledger(node) == {}
