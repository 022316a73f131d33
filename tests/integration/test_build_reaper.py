"""The reaper of dead builders' scratch dirs (``envbuild.build.reaper``) on its own, against a
real build: ``envbuild build`` SIGKILLed while its step runs in runc (overlay and ext4 loop
disk mounted, the step's cgroups and processes alive), then ``reap_stale_builds`` on that node
cache's ``builds/``: nothing is left (mounts, loop devices, cgroups, processes, the dir), and a
live build beside it is not touched."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envbuild.build.reaper import bundle_container_ids, cgroup_dirs, loops_backed_under, reap_stale_builds
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.isolation.runc import OciRuntime, list_containers
from tests.conftest import require_root, require_tool
from tests.leftovers import assert_nothing_left_under

pytestmark = pytest.mark.integration


def _defs(root: Path, name: str, marker: str) -> Path:
    defs = root / f"defs-{name}"
    (defs / "base").mkdir(parents=True)
    (defs / "base" / f"{name}.yaml").write_text(
        f"apiVersion: envbuild/v1\nkind: Base\nname: {name}\nabi: {name}-abi\n"
        "from: {busybox: {binary: /bin/busybox}}\n"
        f"steps:\n  - run: touch /tmp/{marker} && sleep 300\n    network: none\n")
    return defs


def _start(tmp: Path, node: Path, name: str) -> subprocess.Popen:
    """``envbuild build`` of one base whose step sleeps; its output goes to ``tmp/NAME.out``.
    Each build asks for a 2 GiB disk: with the 50 GiB default, the first build may take the
    whole of a small node's disk budget and the second waits for it (CI's machine had 59 GiB
    free), which is admission working, not what this test is about."""
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(node), "ENVBUILD_STORE": str(tmp / "store"),
           "ENVBUILD_DEFS": str(_defs(tmp, name, f"started-{name}")),
           "ENVBUILD_BUILD_DISK": "2G"}
    with open(tmp / f"{name}.out", "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "envbuild.cli", "build"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def _running_step(builds: Path, marker: str, builder: subprocess.Popen, output: Path,
                  timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and builder.poll() is None:
        for d in builds.glob("*"):
            if d.is_dir() and (d / "disk" / "tmp" / marker).exists():
                return d
        time.sleep(0.1)
    state = "still running" if builder.poll() is None else f"exited {builder.returncode}"
    tail = output.read_text(errors="replace")[-2000:]
    raise AssertionError(f"no step wrote {marker} under {builds} (builder {state}):\n{tail}")


def _pids_of(cids: list[str]) -> set[int]:
    pids: set[int] = set()
    for cid in cids:
        for d in cgroup_dirs(cid):
            pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
    return pids


def _cleanup(node: Path, procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    reap_stale_builds(node / "builds", OciRuntime("runc", state_root=str(node / "runc")))


@contextlib.contextmanager
def _two_running_builds(tmp: Path, node: Path):
    """Two builders on ``node`` ("victim" and "alive"), each with its step running: yields
    ``(victim, alive, victim's build dir, alive's build dir)``; kills both and reaps after."""
    victim = _start(tmp, node, "victim")
    alive = _start(tmp, node, "alive")
    try:
        yield (victim, alive,
               _running_step(node / "builds", "started-victim", victim, tmp / "victim.out"),
               _running_step(node / "builds", "started-alive", alive, tmp / "alive.out"))
    finally:
        _cleanup(node, [victim, alive])


@pytest.mark.parametrize("runc_state", ["kept", "lost"])
def test_a_killed_builders_mounts_loop_disk_cgroups_and_processes_are_reaped(tmp_path, runc_state):
    """``lost``: the runc state root is gone too (as when ``runc run`` was killed before it
    wrote its state): the reaper still finds the step's cgroups from the dir's bundle."""
    require_root()
    require_tool("runc")
    require_tool("busybox")
    node = tmp_path / "node"
    builds = node / "builds"
    runtime = OciRuntime("runc", state_root=str(node / "runc"))
    with _two_running_builds(tmp_path, node) as (victim, alive, dead_dir, live_dir):
        cids = bundle_container_ids(dead_dir)
        assert len(cids) == 1, cids
        step_pids = _pids_of(cids)
        assert step_pids, "the step's processes are in its cgroups"
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        # what a killed builder leaves: its mounts, loop disk, container, cgroups, processes
        assert len(mounted_targets_under(str(dead_dir))) == 2  # merged overlay + ext4 disk
        assert len(loops_backed_under(dead_dir)) == 1
        assert all(os.path.exists(f"/proc/{p}") for p in step_pids)
        if runc_state == "lost":
            # only this victim's container state: the live build's stays
            shutil.rmtree(node / "runc" / cids[0])

        reaped = reap_stale_builds(builds, runtime)

        assert [r.name for r in reaped] == [dead_dir.name]
        assert reaped[0].containers == tuple(cids)
        assert not dead_dir.exists() and not Path(f"{dead_dir}.owner").exists()
        assert mounted_targets_under(str(dead_dir)) == []
        assert loops_backed_under(dead_dir) == []
        assert [d for cid in cids for d in cgroup_dirs(cid)] == []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in step_pids):
            time.sleep(0.05)
        assert not [p for p in step_pids if os.path.exists(f"/proc/{p}")]
        assert cids[0] not in {c["id"] for c in list_containers(runtime, "eb-build-")}
        # the live build beside it: untouched, still running
        assert live_dir.is_dir() and len(mounted_targets_under(str(live_dir))) == 2
        assert alive.poll() is None
        assert reap_stale_builds(builds, runtime) == []  # nothing else is stale
    assert [p for p in builds.iterdir()] == []
    assert_nothing_left_under(tmp_path)


def test_a_ray_builder_starting_on_the_node_cache_reaps_a_killed_build(tmp_path):
    """What every Ray build task does first (``ray_executor.node_context``): the build dirs of
    dead builders in its node cache (``{node_id}`` expanded) are reaped, a live one is not."""
    require_root()
    require_tool("runc")
    require_tool("busybox")
    from envbuild.build.ray_executor import node_context
    from envbuild.settings import Settings

    node = tmp_path / "node-abc123"
    builds = node / "builds"
    with _two_running_builds(tmp_path, node) as (victim, alive, dead_dir, live_dir):
        cids = bundle_container_ids(dead_dir)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert mounted_targets_under(str(dead_dir))

        ctx = node_context(Settings(store_url=str(tmp_path / "store"),
                                    node_dir=tmp_path / "node-{node_id}"), "abc123")

        assert ctx.scratch_root == builds
        assert not dead_dir.exists() and mounted_targets_under(str(dead_dir)) == []
        assert loops_backed_under(dead_dir) == []
        assert [d for cid in cids for d in cgroup_dirs(cid)] == []
        assert live_dir.is_dir() and alive.poll() is None
    assert_nothing_left_under(tmp_path)
