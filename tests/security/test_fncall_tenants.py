"""Issue 34 item 2: FnCall tenants share nothing, over real runc and the busybox env.

Call N (one tenant) plants state in every channel found so far — a POSIX message queue made
with ``open("/dev/mqueue/NAME", O_CREAT)``, a ``chmod``/``chown`` of ``/dev/pts`` and
``/dev/pts/ptmx``, forks that advance the pid counter, PID 1's rlimits, nice value, scheduling
policy, CPU affinity, I/O priority, ``oom_score_adj`` and ``coredump_filter`` changed from
outside (commands inherit them from the agent) — and call N+1 (the next tenant of an
``FnPool``) must see exactly what a call on a fresh sandbox sees. The scan compares a
fingerprint of everything a call can read about what came before it (``/dev/shm``, ``/tmp``,
``/run``, abstract unix sockets, SysV IPC, keyrings, cgroup files, ``ulimit``s, environment,
cwd, umask, hostname, the network namespace's counters) before and after such an attack.
The static C probe (``fncall_tenant_probe.c``) covers what busybox cannot reach.
"""

from __future__ import annotations

import difflib
import subprocess
from pathlib import Path

import pytest

from runtime_shim.node.model import Limits
from runtime_shim.sdk.fnpool import FnPool
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_tool

LOCK = "env/busybox-shell"
PROBE_SOURCE = Path(__file__).with_name("fncall_tenant_probe.c")
LIMITS = Limits(disk_bytes=64 << 20, inodes=4096, pids=64)

#: Everything a call can read about the calls before it (one ``sh`` script; every line is
#: compared, so nothing in it may depend on the time or on the host's other work).
FINGERPRINT = r"""
echo pid=$$; sh -c 'echo child=$$'
echo umask=$(umask) cwd=$(pwd) hostname=$(hostname) domain=$(cat /proc/sys/kernel/domainname)
env | sort
ulimit -a
cat /proc/self/limits
echo stat: $(cut -d' ' -f18,19,40,41 /proc/self/stat)
grep -E '^(Cpus_allowed_list|Mems_allowed_list|NoNewPrivs|Seccomp|Cap[A-Za-z]+):' /proc/self/status
echo oom=$(cat /proc/self/oom_score_adj) coredump=$(cat /proc/self/coredump_filter)
echo slack=$(cat /proc/self/timerslack_ns)
ionice -p $$
cat /proc/self/cgroup
ls -A /sys/fs/cgroup 2>&1
cat /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg
cat /proc/keys /proc/self/attr/current 2>&1 | head -5
cat /proc/net/unix /proc/net/snmp /proc/net/netstat
ls -A /dev/mqueue
stat -c '%n %a %u %g %F' /dev /dev/pts /dev/pts/* /dev/shm /dev/mqueue /tmp /run /var/tmp \
    /workspace /root
find /dev /tmp /run /var/tmp /root /workspace /home /etc | sort
stat -f -c 'tmp-free-blocks=%a tmp-free-inodes=%d' /tmp
"""

#: Call N: every channel at once (a refused attempt is fine: only call N+1's view counts).
PLANT = r"""
chmod 0755 /tmp/probe; /tmp/probe
: > /dev/mqueue/leak
chmod 0777 /dev/pts; chown 1000:1000 /dev/pts/ptmx; chmod 0600 /dev/pts/ptmx
i=0; while [ $i -lt 40 ]; do true & i=$((i+1)); done; wait
renice -n 7 -p 1; taskset -p 1 1; ionice -c 3 -p 1
echo 900 > /proc/1/oom_score_adj; echo 0x3f > /proc/1/coredump_filter
echo 12345 > /proc/1/timerslack_ns
umask 077; cd /tmp; export LEAK=1; hostname leak
mkdir -p /run/leak /var/tmp/leak; : > /tmp/leak; : > /dev/shm/leak; : > /root/leak
echo 1 > /sys/fs/cgroup/pids/pids.max
echo x | nc -w1 127.0.0.1 9
dd if=/dev/zero of=/tmp/fill bs=1M count=8 2>/dev/null
setsid sleep 300 </dev/null >/dev/null 2>&1 &
echo planted
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> bytes:
    gcc = require_tool("gcc")
    out = tmp_path_factory.mktemp("tenant-probe") / "probe"
    subprocess.run([gcc, "-static", "-O1", "-o", str(out), str(PROBE_SOURCE)], check=True,
                   capture_output=True)
    return out.read_bytes()


@pytest.fixture
def pool(busybox_store):
    """One warm sandbox serving every tenant in turn (the case a leak is about)."""
    store, node = busybox_store
    with FnPool(LOCK, size=1, store=store, node_dir=node, limits=LIMITS) as pool:
        yield pool


@pytest.fixture
def fn(busybox_store):
    store, node = busybox_store
    with Sandbox.create(LOCK, store=store, node_dir=node, backend="fncall",
                        limits=LIMITS) as sb:
        yield sb


def _fingerprint(call) -> list[str]:
    got = call(FINGERPRINT)
    assert got.exit_code == 0 and got.stdout, got
    return got.stdout.decode().splitlines()


def _plant(call, probe: bytes) -> None:
    planted = call(PLANT, files={"/tmp/probe": probe})
    assert planted.stdout.endswith(b"planted\n"), planted
    # the probe reached the kernel where it should have: the attack is real
    assert b"abstract_socket 0 0" in planted.stdout, planted
    assert b"prlimit_pid1_nofile 0 0" in planted.stdout, planted


def _diff(before: list[str], after: list[str]) -> str:
    return "\n".join(difflib.unified_diff(before, after, "first tenant", "after call N",
                                          lineterm="", n=0))


def test_nothing_call_n_leaves_is_seen_by_the_next_tenant(pool, probe):
    """The scan: call N+1 sees exactly what the first call on the sandbox saw."""
    def call(script, files=None):
        return pool.call(["sh", "-c", script], files=files, timeout=60)

    first = _fingerprint(call)
    assert first[0] == "pid=" + first[0].split("=")[1]
    _plant(call, probe)
    after = _fingerprint(call)
    assert after == first, _diff(first, after)


def test_a_posix_message_queue_made_through_dev_mqueue_is_gone(fn):
    assert fn.call(": > /dev/mqueue/leak && ls /dev/mqueue").stdout == b"leak\n"
    seen = fn.call("ls -A /dev/mqueue; cat /dev/mqueue/leak 2>&1")
    assert b"leak" not in seen.stdout.replace(b"/dev/mqueue/leak", b""), seen
    assert seen.stdout.startswith(b"cat: "), seen


def test_dev_pts_modes_and_owners_do_not_persist(fn):
    look = "stat -c '%n %a %u %g' /dev/pts /dev/pts/ptmx"
    before = fn.call(look).stdout
    changed = fn.call("chmod 0777 /dev/pts && chown 1000:1000 /dev/pts/ptmx && "
                      f"chmod 0600 /dev/pts/ptmx && {look}")
    assert changed.ok and changed.stdout != before, changed
    assert fn.call(look).stdout == before


def test_the_pid_counter_starts_over_for_every_call(fn):
    first = fn.call("echo $$").stdout
    assert fn.call("i=0; while [ $i -lt 50 ]; do true & i=$((i+1)); done; wait").ok
    assert fn.call("echo $$").stdout == first
    assert fn.call("echo $$").stdout == first


def test_pid_1_cannot_be_tuned_for_the_next_call(fn, probe):
    """Commands inherit rlimits, nice, policy, affinity, I/O priority, oom_score_adj and
    coredump_filter from the process that starts them: no call may change that process."""
    look = ("ulimit -n; ulimit -c; cut -d' ' -f19,41 /proc/self/stat; "
            "grep Cpus_allowed_list /proc/self/status; ionice -p $$; "
            "cat /proc/self/oom_score_adj /proc/self/coredump_filter")
    before = fn.call(look).stdout
    fn.call("chmod 0755 /tmp/probe; /tmp/probe; renice -n 7 -p 1; taskset -p 1 1; ionice -c 3 -p 1; "
            "echo 900 > /proc/1/oom_score_adj; echo 0x3f > /proc/1/coredump_filter",
            files={"/tmp/probe": probe})
    after = fn.call(look).stdout
    assert after == before, _diff(before.decode().splitlines(), after.decode().splitlines())


def test_the_call_gets_the_very_seccomp_filter_of_the_container(fn, busybox_store):
    """Each call's PID 1 is started by the host, not by runc: it must end up with the filter
    runc installed (read back from the container's PID 1). The kernel-surface probe of
    ``test_syscalls.py`` gets the same answer from every syscall in both."""
    gcc = require_tool("gcc")
    out = Path(fn.paths.root) / "syscall-probe"
    subprocess.run([gcc, "-static", "-O1", "-o", str(out),
                    str(PROBE_SOURCE.with_name("syscall_probe.c"))], check=True,
                   capture_output=True)
    probe = out.read_bytes()

    def answers(stdout: bytes) -> list[tuple[str, bool, str]]:  # pids differ, not outcomes
        return [(name, int(rc) < 0, err) for name, rc, err in
                (line.split() for line in stdout.decode().splitlines())]

    called = fn.call("chmod 0755 /tmp/p && /tmp/p", files={"/tmp/p": probe}, timeout=60)
    store, node = busybox_store
    with Sandbox.create(LOCK, store=store, node_dir=node, backend="fncall",
                        seccomp="unconfined") as loose:
        unconfined = loose.call("chmod 0755 /tmp/p && /tmp/p", files={"/tmp/p": probe},
                                timeout=60)
    with Sandbox.create(LOCK, store=store, node_dir=node) as plain:
        plain.write_file("/tmp/p", probe, mode=0o755)
        direct = plain.exec(["/tmp/p"], timeout=60)
    assert called.exit_code == direct.exit_code == unconfined.exit_code == 0
    assert answers(called.stdout) == answers(direct.stdout)
    assert answers(called.stdout) != answers(unconfined.stdout)  # the probe tells them apart
