"""Issue 19 item 3: CPU classes over real runc. A best-effort sandbox's every process runs
``SCHED_IDLE`` in a cgroup of minimum CPU weight, and cannot leave that class; a latency one
runs as before; build steps (``runc run`` in the foreground) are best-effort by default.
The latency effect itself is measured by ``benchmarks/density.py``."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from envbuild.build.executor import BuildLimits
from runtime_shim.isolation import cgroupfs, cpuclass
from runtime_shim.isolation.runc import OciRuntime, run_container, write_bundle
from runtime_shim.isolation.spec import RuntimeSpecRequest, runtime_spec
from runtime_shim.node.model import Limits
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root, require_tool
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.integration
ENV = "env/busybox-shell"
SCHED_IDLE = 5  # field 41 of /proc/PID/stat


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("cpuclass"))


def _policy(stat_line: bytes) -> int:
    return int(stat_line.rsplit(b")", 1)[1].split()[38])  # fields after comm start at 3


def _shares(sandbox_id: str) -> int:
    found = cgroupfs.controller_dir("cpu", sandbox_id)
    assert found is not None, "no cpu cgroup for the sandbox"
    path, version = found
    return int((path / ("cpu.shares" if version == 1 else "cpu.weight")).read_text())


@pytest.mark.parametrize("backend", ["container", "fncall"])
def test_best_effort_sandbox_runs_sched_idle_with_minimum_weight(built, backend):
    store, node = built
    limits = Limits(cpu_class="best-effort")
    with Sandbox.create(ENV, store=store, node_dir=node, backend=backend, limits=limits) as sb:
        handle = sb.handle
        assert cpuclass.policy_of(handle.init_pid) == cpuclass.BEST_EFFORT
        # a grandchild of the agent, after a fork in the shell
        got = sb.exec("sh -c 'cat /proc/self/stat'")
        assert _policy(got.stdout) == SCHED_IDLE, got
        assert _shares(sb.id) == cpuclass.BEST_EFFORT_SHARES
        # no way back to the normal class: raising priority needs CAP_SYS_NICE
        escape = sb.exec("renice -n -5 $$; echo rc=$?")
        assert b"rc=0" not in escape.stdout, escape
        assert _policy(sb.exec("cat /proc/self/stat").stdout) == SCHED_IDLE


def test_latency_sandbox_is_unchanged(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        assert sb.handle.limits.cpu_class == "latency"
        assert _policy(sb.exec("cat /proc/self/stat").stdout) == 0  # SCHED_OTHER
        assert _shares(sb.id) == 1024


def test_unknown_cpu_class_is_refused_before_anything_starts(built):
    store, node = built
    with pytest.raises(Exception, match="unknown cpu_class"):
        Sandbox.create(ENV, store=store, node_dir=node, limits=Limits(cpu_class="fast"))
    assert not any((node / "sandboxes").iterdir())


def test_build_steps_are_best_effort_by_default(tmp_path):
    require_root()
    runc = require_tool("runc")
    busybox = require_tool("busybox")
    assert BuildLimits().cpu_class == cpuclass.BEST_EFFORT
    rootfs = tmp_path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    for d in ("proc", "dev", "sys", "tmp"):
        (rootfs / d).mkdir()
    shutil.copy(busybox, rootfs / "bin" / "busybox")
    cid = f"eb-test-cpuclass-{os.getpid()}"
    request = RuntimeSpecRequest(rootfs=str(rootfs), args=("/bin/busybox", "cat", "/proc/self/stat"),
                                 cgroups_path=f"/envbuild/{cid}", tmpfs=(),
                                 cpu_shares=cpuclass.cpu_shares(BuildLimits().cpu_class))
    write_bundle(tmp_path / "bundle", runtime_spec(request))
    out = tmp_path / "out"
    runtime = OciRuntime(runc, state_root=str(tmp_path / "state"))
    with open(out, "wb") as f:
        result = run_container(runtime, cid, tmp_path / "bundle", stdout=f,
                               cpu_class=BuildLimits().cpu_class)
    assert result.exit_code == 0, out.read_bytes()
    assert _policy(out.read_bytes()) == SCHED_IDLE
    subprocess.run([runc, "--root", str(tmp_path / "state"), "delete", "--force", cid],
                   capture_output=True, check=False)


@pytest.mark.parametrize("backend", ["container", "fncall"])
def test_a_sandbox_cpuset_is_cloned_from_a_cloning_parent(built, backend):
    """Issue 39: runc writes ``cpuset.cpus`` into an empty cpuset, and that write rebuilds the
    scheduler domains by walking every cpuset on the host (a create got slower with each live
    sandbox). A create makes ``/envbuild`` a cloning parent first, so the kernel gives the new
    cpuset its parent's cpus and mems and runc writes none."""
    v1, _ = cgroupfs._mounts()
    if "cpuset" not in v1:
        pytest.fail("no cgroup v1 cpuset hierarchy on this host: this test checks the v1 path")
    parent = os.path.join(v1["cpuset"], cgroupfs.PARENT)
    flag = os.path.join(parent, "cgroup.clone_children")
    if os.path.exists(flag):  # as on a fresh host: a parent that does not clone
        with open(flag, "w") as f:
            f.write("0")
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node, backend=backend) as sb:
        with open(flag) as f:
            assert f.read().strip() == "1"
        found = cgroupfs.controller_dir("cpuset", sb.id)
        assert found is not None
        for name in ("cpuset.cpus", "cpuset.mems"):
            with open(os.path.join(parent, name)) as f:
                want = f.read()
            assert (found[0] / name).read_text() == want and want.strip()
