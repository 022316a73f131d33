"""Issue 11 item 5 and ``Limits.cpus``: the kernel attack surface a sandbox and a build step
can reach, against the real runc and the busybox env.

Attack: inside a sandbox, ``unshare -Urm`` then tmpfs/overlay mounts, new net/pid namespaces,
keyrings, io_uring, filesystem-swapping ioctls all worked (no seccomp profile at all). A static
C probe (``syscall_probe.c``, built here with ``gcc -static`` and written into the sandbox)
calls each of them and prints ``NAME RC ERRNO``; the default profile must answer EPERM (or
ENOSYS for ``clone3``) while ordinary syscalls still work, and ``seccomp="unconfined"`` must
let the namespace calls through (so the test can fail).
"""

from __future__ import annotations

import errno
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from runtime_shim.sdk.sandbox import Limits, Sandbox
from tests.conftest import require_tool

PROBE_SOURCE = Path(__file__).with_name("syscall_probe.c")
ENV = "env/busybox-shell"

REFUSED = ("keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
           "io_uring_setup", "unshare_newuser_newns", "unshare_newnet", "clone_newuser",
           "clone_newpid", "mount", "umount2", "pivot_root", "fsopen", "open_tree", "move_mount",
           "setns", "kexec_load", "init_module", "finit_module", "ioctl_xfs_swapext",
           "ioctl_ext4_move_ext", "ioctl_ext4_swap_boot", "ioctl_tiocsti", "ioctl_tiocsti_high",
           "ioctl_tioclinux", "socket_vsock", "i386_keyctl", "i386_unshare_newuser")
WORKS = ("ioctl_fionread", "pipe", "fork_exec", "clone_plain", "unshare_files",
         "socket_loopback", "i386_getpid")


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> bytes:
    gcc = require_tool("gcc")
    out = tmp_path_factory.mktemp("probe") / "probe"
    subprocess.run([gcc, "-static", "-O1", "-o", str(out), str(PROBE_SOURCE)], check=True,
                   capture_output=True)
    return out.read_bytes()


def _run_probe(sb: Sandbox, probe: bytes) -> dict[str, tuple[int, int]]:
    sb.write_file("/tmp/probe", probe, mode=0o755)
    result = sb.exec(["/tmp/probe"], timeout=60)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.decode().split("\n")
    calls = {}
    for line in filter(None, lines):
        name, rc, err = line.split()
        calls[name] = (int(rc), int(err))
    assert set(REFUSED) | set(WORKS) <= set(calls), result.stdout
    return calls


@pytest.fixture(scope="module")
def confined(busybox_store):
    store, node = busybox_store
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        yield sb


def test_default_profile_refuses_the_kernel_attack_surface(confined, probe):
    calls = _run_probe(confined, probe)
    wrong = {name: calls[name] for name in REFUSED
             if calls[name][0] >= 0 or calls[name][1] not in (errno.EPERM, errno.ENOSYS)}
    assert not wrong, f"reached the kernel (rc, errno): {wrong}"
    assert calls["clone3"] == (-1, errno.ENOSYS)  # so libc falls back to clone
    broken = {name: calls[name] for name in WORKS if calls[name][0] < 0}
    assert not broken, f"ordinary syscalls refused: {broken}"


def test_unshare_urm_is_refused_and_ordinary_commands_work(confined):
    done = confined.exec("unshare -Urm sh -c 'mount -t tmpfs none /tmp && echo mounted'")
    assert done.exit_code != 0
    assert b"mounted" not in done.stdout
    assert b"Operation not permitted" in done.stderr
    done = confined.exec("ls / >/dev/null && echo a | cat && sh -c 'exit 3'; echo $?")
    assert done.stdout == b"a\n3\n", done.stderr


def test_unconfined_lets_the_same_calls_through(busybox_store, probe):
    """The control: without the filter the probe's namespace and ioctl calls reach the
    kernel, so the refusals above come from the profile, not from missing privileges."""
    store, node = busybox_store
    with Sandbox.create(ENV, store=store, node_dir=node, seccomp="unconfined") as sb:
        calls = _run_probe(sb, probe)
        done = sb.exec("unshare -Urm sh -c 'mount -t tmpfs none /tmp && echo mounted'")
    assert calls["unshare_newuser_newns"][0] == 0, calls["unshare_newuser_newns"]
    assert calls["i386_unshare_newuser"][0] == 0, calls["i386_unshare_newuser"]
    assert calls["clone_newuser"][0] > 0, calls["clone_newuser"]
    # The ioctls reach the filesystem / tty driver, which answers with its own errno
    for name in ("ioctl_xfs_swapext", "ioctl_tiocsti"):
        assert calls[name][1] not in (errno.EPERM, 0), (name, calls[name])
    assert done.stdout == b"mounted\n", done.stderr


def test_custom_profile_is_applied(busybox_store, probe):
    """A caller's own profile replaces the default: here one that allows everything but
    ``mkdir``, refused with a distinctive errno."""
    store, node = busybox_store
    profile = {"defaultAction": "SCMP_ACT_ALLOW",
               "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO",
                             "errnoRet": errno.EROFS}]}
    with Sandbox.create(ENV, store=store, node_dir=node, seccomp=profile) as sb:
        done = sb.exec("mkdir /tmp/x")
    assert done.exit_code != 0 and b"Read-only file system" in done.stderr


def test_bad_profile_is_refused_before_anything_starts(busybox_store):
    from envbuild.errors import RuntimeShimError

    store, node = busybox_store
    before = set((Path(node) / "sandboxes").iterdir())
    with pytest.raises(RuntimeShimError, match="seccomp profile: defaultAction"):
        Sandbox.create(ENV, store=store, node_dir=node, seccomp={"defaultAction": "allow"})
    with pytest.raises(RuntimeShimError, match="unknown seccomp setting"):
        Sandbox.create(ENV, store=store, node_dir=node, seccomp="off")
    # A microVM's boundary is its guest kernel: a profile would silently not apply, so no.
    with pytest.raises(RuntimeShimError, match="container sandboxes only"):
        Sandbox.create(ENV, store=store, node_dir=node, backend="microvm",
                       seccomp={"defaultAction": "SCMP_ACT_ALLOW"})
    assert set((Path(node) / "sandboxes").iterdir()) == before


def test_build_step_runs_under_the_filter(envbuild_cli):
    toolkit = envbuild_cli.defs / "toolkits" / "nsy.yaml"
    toolkit.write_text(textwrap.dedent("""\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: nsy
        build_on: busybox-tiny
        prefix: /opt/toolkits/nsy
        steps:
          - run: mkdir -p /opt/toolkits/nsy && echo ordinary step ok
            network: none
          - run: unshare -U true || { echo "unshare refused"; exit 7; }
            network: none
        """))
    result = envbuild_cli("build", "nsy", "--json")
    assert result.code == 1
    error = {lay["name"]: lay for lay in result.json()["layers"]}["nsy"]["error"]
    assert "step 2/2 exited 7" in error
    assert "unshare refused" in result.err and "Operation not permitted" in result.err
    assert "Traceback" not in result.err


def _cgroup_dir(pid: int, controller: str) -> Path:
    """The cgroup directory of ``pid`` for a v1 ``controller`` (or the v2 one)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return Path("/sys/fs/cgroup") / controllers / path.lstrip("/")
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup/unified") / line[3:].lstrip("/")
    raise AssertionError(f"no {controller} cgroup for {pid}")


def _usage_seconds(pid: int) -> float:
    acct = _cgroup_dir(pid, "cpuacct")
    if (acct / "cpuacct.usage").exists():
        return int((acct / "cpuacct.usage").read_text()) / 1e9
    stat = dict(line.split() for line in (acct / "cpu.stat").read_text().splitlines())
    return int(stat["usage_usec"]) / 1e6


def test_cpu_limit_gives_about_half_a_core(busybox_store):
    store, node = busybox_store
    with Sandbox.create(ENV, store=store, node_dir=node, limits=Limits(cpus=0.5)) as sb:
        pid = sb.host_pid
        cpu = _cgroup_dir(pid, "cpu")
        if (cpu / "cpu.cfs_quota_us").exists():
            assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "50000"
        # Two busy loops: unlimited they would take both of this host's cores.
        runner = threading.Thread(target=sb.exec, args=(
            "for i in 1 2; do timeout 2 sh -c 'while :; do :; done' & done; wait",),
            kwargs={"timeout": 30})
        runner.start()
        try:
            time.sleep(0.4)  # past the loops' start and the first, unthrottled period
            u0, t0 = _usage_seconds(pid), time.monotonic()
            time.sleep(1.0)
            u1, t1 = _usage_seconds(pid), time.monotonic()
        finally:
            runner.join()
        stat = dict(line.split() for line in (cpu / "cpu.stat").read_text().splitlines())
    share = (u1 - u0) / (t1 - t0)
    # The upper bound is the cap. The loops need not get their whole half core on a busy host
    # (seven engineers share two cores here), so the lower bound only shows they ran, and the
    # throttle count shows the quota, not contention, is what stopped them.
    assert 0.15 < share < 0.65, f"{share:.2f} cores with cpus=0.5"
    # On a host so loaded that the loops never reach their half core, nothing is throttled:
    # the quota file above is then what shows the cap; otherwise the throttling must show it.
    assert int(stat["nr_throttled"]) > 0 or share < 0.4, (share, stat)


def test_build_step_has_its_own_limited_cgroup(envbuild_cli):
    """A run step is as bounded as a sandbox: its own cgroup under /envbuild with
    ``BuildLimits``' pids, memory and CPU caps (watched from the host while it sleeps)."""
    from envbuild.build.executor import BuildLimits

    pids_root = Path("/sys/fs/cgroup/pids/envbuild")
    if not Path("/sys/fs/cgroup/pids").is_dir():
        pytest.fail("this test reads cgroup v1 (pids, memory, cpu): not mounted here")
    before = set(pids_root.glob("eb-build-*")) if pids_root.is_dir() else set()
    (envbuild_cli.defs / "toolkits" / "slow.yaml").write_text(textwrap.dedent("""\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: slow
        build_on: busybox-tiny
        prefix: /opt/toolkits/slow
        steps:
          - run: mkdir -p /opt/toolkits/slow && sleep 2
            network: none
        """))
    seen: dict[str, str] = {}
    stop = threading.Event()

    def watch():  # the last complete reading: runc creates the cgroup, then sets limits
        while not stop.is_set():
            for d in set(pids_root.glob("eb-build-*")) - before if pids_root.is_dir() else ():
                try:
                    now = {"pids": (d / "pids.max").read_text().strip(),
                           "memory": (Path("/sys/fs/cgroup/memory/envbuild") / d.name
                                      / "memory.limit_in_bytes").read_text().strip(),
                           "cpu": (Path("/sys/fs/cgroup/cpu/envbuild") / d.name
                                   / "cpu.cfs_quota_us").read_text().strip()}
                except OSError:
                    continue  # being set up or already gone
                seen.update(now)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = envbuild_cli("build", "slow", "--json")
    finally:
        stop.set()
        watcher.join()
    assert result.code == 0, result.err
    limits = BuildLimits()
    assert seen == {"pids": str(limits.pids), "memory": str(limits.memory_bytes),
                    "cpu": str(round(limits.cpus * 100_000))}
