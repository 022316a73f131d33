"""A lock pushed to a registry runs with other runtimes straight from there (issue 16, the
"runs anywhere" half of item 2; ``envbuild export``: test_export.py): ``podman run`` (runc,
vfs storage, its own root, lowered ulimits as MACHINE-NOTES says) and containerd 1.6
(started by the test with its own root, state dir and socket; ``ctr image pull --plain-http``
+ ``ctr run``). Each must leave no process and no mount behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from envbuild.store.registry import RegistryStore
from envbuild.store.sync import sync
from tests.conftest import require_root, require_tool
from tests.integration.test_registry import built, registry  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def pushed(built, registry):  # noqa: F811
    src, lock = built
    sync(src, RegistryStore(registry.url("team/runtimes")), refs=["env/busybox-shell"])
    return f"{registry.host}/team/runtimes:busybox-shell", lock


def _leftovers(root: Path) -> list[str]:
    """Processes whose command line names ``root``, and mounts under it."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(root) in cmdline:
            found.append(f"process {pid}: {cmdline[:120]}")
    with open("/proc/self/mounts") as f:
        found += [f"mount {line.split()[1]}" for line in f if str(root) in line.split()[1]]
    return found


def test_podman_runs_the_pushed_lock(pushed, tmp_path):
    require_root()
    podman = require_tool("podman")
    require_tool("runc")
    ref, _ = pushed
    conf = tmp_path / "containers.conf"
    conf.write_text('[containers]\ndefault_ulimits=["nofile=1024:1024","nproc=4096:4096"]\n'
                    f'[engine]\nruntime="runc"\ncgroup_manager="cgroupfs"\n'
                    f'events_logger="file"\ntmp_dir="{tmp_path / "tmp"}"\n')
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    runroot = Path(tempfile.mkdtemp(prefix="eb-podman-", dir="/tmp"))  # podman: <= 50 chars
    shm_lock = Path("/dev/shm/libpod_lock")  # podman's lock segment, wherever its root is
    shm_existed = shm_lock.exists()
    base = [podman, "--root", str(tmp_path / "root"), "--runroot", str(runroot),
            "--storage-driver", "vfs"]
    try:
        proc = subprocess.run(base + ["run", "--rm", "--network", "none", "--tls-verify=false",
                                      ref, "sh", "-c", "echo from-podman; ls /opt/toolkits"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["from-podman", "shtest"]
    finally:
        subprocess.run(base + ["rm", "-af"], env=env, capture_output=True, timeout=60)
        leftovers = _leftovers(tmp_path) + _leftovers(runroot)
        shutil.rmtree(runroot, ignore_errors=True)
        if not shm_existed:
            shm_lock.unlink(missing_ok=True)
    assert leftovers == []


def test_containerd_pulls_and_runs_the_pushed_lock(pushed, tmp_path):
    require_root()
    containerd = require_tool("containerd")
    ctr = require_tool("ctr")
    ref, lock = pushed
    sock = tmp_path / "containerd.sock"
    config = tmp_path / "config.toml"
    config.write_text(
        f'version = 2\nroot = "{tmp_path / "root"}"\nstate = "{tmp_path / "state"}"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{sock}.ttrpc"\n'
        f'[debug]\n  address = "{sock}.debug"\n[metrics]\n  address = ""\n')
    # containerd 1.6 keeps shim sockets, ctr's FIFOs and runc's state under /run/containerd
    # whatever the config says; remove (empty) what this test made there
    run_dir = Path("/run/containerd")
    made = [d for d in (run_dir, run_dir / "fifo", run_dir / "s", run_dir / "runc",
                        run_dir / "runc" / "envbuild-test") if not d.exists()]
    log = open(tmp_path / "containerd.log", "wb")  # noqa: SIM115
    daemon = subprocess.Popen([containerd, "--config", str(config)], stdout=log,
                              stderr=subprocess.STDOUT)
    base = [ctr, "--address", str(sock), "--namespace", "envbuild-test"]
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert daemon.poll() is None, (tmp_path / "containerd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "containerd did not start"
            time.sleep(0.1)
        proc = subprocess.run(base + ["image", "pull", "--plain-http", ref],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        proc = subprocess.run(base + ["image", "ls"], capture_output=True, text=True, timeout=60)
        assert lock in proc.stdout  # the very lock, by digest
        proc = subprocess.run(base + ["run", "--rm", ref, "t1", "sh", "-c", "echo from-ctr"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "from-ctr"
    finally:
        daemon.terminate()
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(10)
        log.close()
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass  # not empty: reported below
    assert _leftovers(tmp_path) == []
    assert not (run_dir / "runc" / "envbuild-test").exists()
