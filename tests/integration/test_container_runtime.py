"""Real runc + overlayfs: the pieces every build step and sandbox stands on."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from runtime_shim.isolation.mount import OverlaySpec, mount_overlay, mounted_targets_under, unmount
from runtime_shim.isolation.runc import (
    OciRuntime,
    destroy,
    list_containers,
    run_container,
    runtime_error_line,
    write_bundle,
)
from runtime_shim.isolation.spec import RuntimeSpecRequest, runtime_spec
from tests.conftest import require_root, require_tool


def make_busybox_root(root: Path) -> Path:
    busybox = require_tool("busybox")
    (root / "bin").mkdir(parents=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    for applet in ("sh", "echo", "cat", "touch", "rm", "ls", "ip", "id", "hostname", "mount"):
        os.symlink("busybox", root / "bin" / applet)
    for d in ("proc", "sys", "dev", "tmp", "etc"):
        (root / d).mkdir()
    return root


@pytest.fixture
def overlay_root(tmp_path):
    require_root()
    require_tool("runc")
    lower = make_busybox_root(tmp_path / "lower")
    upper, work, merged = tmp_path / "upper", tmp_path / "work", tmp_path / "merged"
    for d in (upper, work, merged):
        d.mkdir()
    spec = OverlaySpec(str(merged), (str(lower),), str(upper), str(work))
    mount_overlay(spec)
    yield spec
    unmount(str(merged))


def run(tmp_path, rootfs, args, **kw):
    runtime = OciRuntime(state_root=str(tmp_path / "state"))
    bundle = tmp_path / "bundle"
    write_bundle(bundle, runtime_spec(RuntimeSpecRequest(rootfs=rootfs, args=args, **kw)))
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        result = run_container(runtime, f"eb-test-{uuid.uuid4().hex[:8]}", bundle, stdout=out,
                               timeout=30)
    return result, log.read_text()


def test_runc_runs_in_overlay_and_writes_land_in_upper(tmp_path, overlay_root):
    result, out = run(tmp_path, overlay_root.target,
                      ("/bin/sh", "-c", "echo hello; touch /new; rm /bin/ls; ip link"))
    assert result.exit_code == 0, out
    assert "hello" in out
    assert "eth" not in out  # empty network namespace: only lo
    upper = Path(overlay_root.upperdir)
    assert (upper / "new").exists()
    st = os.lstat(upper / "bin" / "ls")  # overlay whiteout: a 0/0 character device
    assert os.major(st.st_rdev) == 0 and os.minor(st.st_rdev) == 0
    assert (Path(overlay_root.lowerdirs[0]) / "bin" / "ls").is_symlink()  # lower untouched


def test_exit_code_and_mount_denied(tmp_path, overlay_root):
    result, out = run(tmp_path, overlay_root.target,
                      ("/bin/sh", "-c", "mount -t tmpfs x /tmp; exit 7"))
    assert result.exit_code == 7
    assert "denied" in out.lower() or "not permitted" in out.lower()


def test_timeout_kills_and_cleans_state(tmp_path, overlay_root):
    runtime = OciRuntime(state_root=str(tmp_path / "state"))
    bundle = tmp_path / "bundle"
    write_bundle(bundle, runtime_spec(RuntimeSpecRequest(rootfs=overlay_root.target,
                                                         args=("/bin/sh", "-c", "sleep 60"))))
    result = run_container(runtime, "eb-test-timeout", bundle, stdout=subprocess.DEVNULL,
                           timeout=1)
    assert result.timed_out and result.exit_code == 124
    assert list_containers(runtime) == []
    destroy(runtime, "eb-test-timeout")  # idempotent


def test_many_lower_dirs_use_the_new_mount_api(tmp_path):
    require_root()
    base = make_busybox_root(tmp_path / "base")
    lowers = []
    for i in range(150):  # ~150 * 60 bytes of paths: beyond mount(2)'s one-page limit
        d = tmp_path / f"layer-with-a-rather-long-directory-name-{i:04d}"
        d.mkdir()
        (d / f"f{i}").write_text(str(i))
        lowers.append(str(d))
    lowers.append(str(base))
    merged = tmp_path / "merged"
    merged.mkdir()
    spec = OverlaySpec(str(merged), tuple(lowers))
    assert len(spec.options()) > 4096
    mount_overlay(spec)
    try:
        assert (merged / "f0").read_text() == "0"
        assert (merged / "f149").read_text() == "149"
        assert str(merged) in mounted_targets_under(str(tmp_path))
    finally:
        unmount(str(merged))
    assert mounted_targets_under(str(tmp_path)) == []


def test_a_failed_runc_start_names_its_cause_in_one_line(tmp_path, overlay_root):
    """What a start error's message carries (``runtime_error_line``), from runc's real output:
    its logrus ``level=error`` line, unquoted, not the whole log."""
    runtime = OciRuntime(state_root=str(tmp_path / "state"))
    bundle = tmp_path / "bundle"
    write_bundle(bundle, runtime_spec(RuntimeSpecRequest(rootfs=overlay_root.target,
                                                         args=("/bin/no-such-program",))))
    cid = f"eb-test-{uuid.uuid4().hex[:8]}"
    try:
        done = subprocess.run(runtime.command("run", "--bundle", str(bundle), cid),
                              capture_output=True, text=True, timeout=60, check=False)
    finally:
        destroy(runtime, cid)
    assert done.returncode != 0
    cause = runtime_error_line(done.stderr)
    assert cause is not None and "no-such-program" in cause, done.stderr
    assert "level=" not in cause and 'time="' not in cause and "\n" not in cause



def test_a_start_logs_tail_is_bounded_and_never_a_fifo_or_a_link(tmp_path):
    from runtime_shim.backends.container import START_LOG_TAIL, _log_tail

    log = tmp_path / "start.log"
    log.write_bytes(b"x" * (START_LOG_TAIL + 100_000) + b"\nlast line\n")
    tail = _log_tail(log)
    assert len(tail) == START_LOG_TAIL and tail.endswith("last line\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert _log_tail(fifo) == ""   # returns at once: no writer would ever come
    link = tmp_path / "link"
    link.symlink_to(log)
    assert _log_tail(link) == ""
    assert _log_tail(tmp_path / "missing") == ""


def test_destroy_removes_the_cgroups_of_a_runtime_killed_mid_create(tmp_path):
    """runc SIGKILLed while it creates a container has made the container's cgroup dirs (and
    maybe moved a process in) but saved no state, so ``runc delete`` knows no container and
    left the dirs: the soak found them after its ``kill-runc`` faults. ``destroy`` removes them,
    killing what runs there."""
    require_root()
    require_tool("runc")
    from runtime_shim.isolation import cgroupfs

    sandbox_id = f"eb-{uuid.uuid4().hex[:12]}"
    made = []
    for hierarchy in sorted(Path("/sys/fs/cgroup").iterdir()):
        parent = hierarchy / cgroupfs.PARENT
        if hierarchy.is_dir() and (parent.is_dir() or (hierarchy / "cgroup.procs").exists()):
            parent.mkdir(exist_ok=True)
            (parent / sandbox_id).mkdir()
            made.append(parent / sandbox_id)
    assert made, "no cgroup hierarchy on this host"
    orphan = subprocess.Popen(["sleep", "600"])
    try:
        (made[0] / "cgroup.procs").write_text(str(orphan.pid))
        destroy(OciRuntime("runc", state_root=str(tmp_path / "state")), sandbox_id)
        assert [d for d in made if d.exists()] == []
        assert orphan.wait(5) == -9
    finally:
        orphan.kill()
        orphan.wait()
        for d in made:
            if d.exists():
                d.rmdir()
