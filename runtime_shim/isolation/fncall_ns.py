"""Fresh namespaces for every FnCall call (side effects; needs root): issue 34 item 2.

A warm FnCall sandbox is one runc container; its PID 1 (the *anchor*, an exec agent no call
talks to) holds the container's mount namespace with the slots, its cgroup and its network
namespace. Every call gets an agent of its own (``spawn``): a new process that joins the
container's cgroup and mount and UTS namespaces, then gets **new** PID, IPC, UTS, network and
mount namespaces, and becomes PID 1 of that PID namespace. In its mount namespace (a private
copy of the container's: the same slots and read-only root) it mounts a fresh ``/proc`` and a
read-only ``/sys`` (runc's masked and read-only paths, ``runtime_shim.isolation.spec``, applied again),
a new ``devpts`` instance on ``/dev/pts`` and the new IPC namespace's ``mqueue`` on
``/dev/mqueue``; it brings up the loopback of its new network namespace. Then it takes on
exactly the confinement runc gave the anchor (``Confinement``, read back from it once when the
container starts): its capability sets, ``no_new_privs``, seccomp filter (the very BPF program,
read with ``PTRACE_SECCOMP_GET_FILTER`` as CRIU does), rlimits, scheduling policy, nice value,
CPU affinity, ``oom_score_adj``, umask and environment, joins a new empty session keyring (as
runc does for a container), and executes the agent binary on a listening socket the host made
for that one call.

So a call cannot see or change anything of another call's processes or namespaces: not the pid
counter (the call's processes are numbered from 1 in each call), not a message queue or SysV
object (a new IPC namespace, freed with its last process), not ``/dev/pts`` (a new instance),
not the network namespace's counters or sockets, and not the process that starts its commands
(the anchor is outside its PID namespace: a call cannot name it to ``prlimit``, ``renice``,
``taskset``, ``ionice`` or ``/proc/1/oom_score_adj`` it). When the call ends the host kills its
PID 1, which ends every process of the call's PID namespace. What calls still share is what the
host resets and checks between them (``runtime_shim.backends.fncall``: the slots, ``/dev``).

Cost (``benchmarks/fncall_call_cost.py``, 3 runs of 100 sequential calls on this 2-core host
under other load): ``fn.call("true")`` went from 2.4-3.2 ms wall / 2.1-2.3 ms CPU to
10.5-16 ms wall / 6.8-7.4 ms CPU; a call that writes ``/tmp`` from 8-14 / 4.0-4.8 ms to 22-29 /
10 ms. About 5 ms of CPU a call: the helper (``agent/fncall_spawn.c``: joining ten cgroup
hierarchies ~1.4 ms, new namespaces and the fork into them ~1.2 ms, mounts ~0.9 ms, the
confinement with its seccomp program ~1.1 ms) and a fresh agent. A fresh container per call
(the other design that gives the same guarantee) measured 52-100 ms a call.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import os
import resource
import signal
from pathlib import Path

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import agent, cgroupfs
from runtime_shim.isolation.mount import raw_syscall
from runtime_shim.isolation.spec import MASKED_PATHS, READONLY_PATHS

__all__ = ["CallAgent", "Confinement", "read_confinement", "spawn", "spawn_argv", "spawner_binary"]

SPAWN_SOURCE = Path(__file__).with_name("agent") / "fncall_spawn.c"
SPAWN_BINARY = "envbuild-fncall-spawn"

_SYS_PTRACE = 101
_PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT = 17, 0x4206, 0x4207
_PTRACE_SECCOMP_GET_FILTER = 0x420C
_WALL = 0x40000000
_RLIMITS = tuple(getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_"))



@dataclasses.dataclass(frozen=True)
class Confinement:
    """What runc gave a container's PID 1, read back from it (``read_confinement``): every
    call's agent gets exactly this."""

    argv: tuple[bytes, ...]
    env: tuple[bytes, ...]
    seccomp: bytes  # the BPF program: ``struct sock_filter`` entries, 8 bytes each
    caps: tuple[int, int, int, int]  # bounding, effective, permitted, inheritable
    rlimits: tuple[tuple[int, int, int], ...]  # (resource, soft, hard)
    policy: int
    nice: int
    affinity: frozenset[int]
    oom_score_adj: int
    umask: int
    cgroups: tuple[str, ...]  # the cgroup.procs file of each hierarchy it is in


def read_confinement(pid: int, *, seccomp: bool = True) -> Confinement:
    """The confinement of ``pid`` (a container's PID 1 that has run nothing yet). Refused
    unless it has ``no_new_privs``, no ambient capabilities and exactly one seccomp filter
    (none when ``seccomp`` is False: a sandbox created ``seccomp="unconfined"``)."""
    status = dict(line.split(":\t", 1) for line in
                  _read(f"/proc/{pid}/status").decode().splitlines() if ":\t" in line)
    filters = "1" if seccomp else "0"
    if status.get("NoNewPrivs", "").strip() != "1" or \
            status.get("Seccomp_filters", "").strip() != filters or \
            int(status.get("CapAmb", "1"), 16) != 0:
        raise RuntimeShimError(f"fncall: sandbox process {pid} is not confined as expected "
                               f"(no_new_privs, {filters} seccomp filter, no ambient "
                               "capabilities)")
    caps = tuple(int(status[k], 16) for k in ("CapBnd", "CapEff", "CapPrm", "CapInh"))
    return Confinement(
        argv=tuple(_read(f"/proc/{pid}/cmdline").split(b"\0")[:-1]),
        env=tuple(_read(f"/proc/{pid}/environ").split(b"\0")[:-1]),
        seccomp=_seccomp_filter(pid) if seccomp else b"", caps=caps,  # type: ignore[arg-type]
        rlimits=tuple((r, *resource.prlimit(pid, r)) for r in _RLIMITS),
        policy=os.sched_getscheduler(pid), nice=os.getpriority(os.PRIO_PROCESS, pid),
        affinity=frozenset(os.sched_getaffinity(pid)),
        oom_score_adj=int(_read(f"/proc/{pid}/oom_score_adj")),
        umask=int(status["Umask"], 8), cgroups=_cgroup_files(pid))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _cgroup_files(pid: int) -> tuple[str, ...]:
    v1, v2 = cgroupfs._mounts()
    files = []
    for line in _read(f"/proc/{pid}/cgroup").decode().splitlines():
        _, controllers, path = line.split(":", 2)
        point = v2 if not controllers else v1.get(controllers.split(",")[0])
        if point is None:
            raise RuntimeShimError(f"fncall: no mount of the cgroup hierarchy {line!r}")
        files.append(f"{point}{path}/cgroup.procs")
    return tuple(files)


def _seccomp_filter(pid: int) -> bytes:
    """The seccomp program runc installed in ``pid`` (``PTRACE_SECCOMP_GET_FILTER``: seize,
    stop, read, detach; the process carries on as before)."""
    sc = raw_syscall
    if sc(_SYS_PTRACE, _PTRACE_SEIZE, pid, 0, 0) < 0:
        raise _error(f"ptrace sandbox process {pid}")
    try:
        if sc(_SYS_PTRACE, _PTRACE_INTERRUPT, pid, 0, 0) < 0:
            raise _error(f"stop sandbox process {pid}")
        os.waitpid(pid, _WALL)
        count = sc(_SYS_PTRACE, _PTRACE_SECCOMP_GET_FILTER, pid, 0, None)
        if count <= 0:
            raise _error(f"read the seccomp filter of sandbox process {pid}")
        buf = ctypes.create_string_buffer(count * 8)
        if sc(_SYS_PTRACE, _PTRACE_SECCOMP_GET_FILTER, pid, 0, buf) != count:
            raise _error(f"read the seccomp filter of sandbox process {pid}")
        return buf.raw
    finally:
        sc(_SYS_PTRACE, _PTRACE_DETACH, pid, 0, 0)


def _error(what: str) -> RuntimeShimError:
    err = ctypes.get_errno()
    return RuntimeShimError(f"{what}: {os.strerror(err)}",
                            hint="FnCall needs root with CAP_SYS_ADMIN and CAP_SYS_PTRACE")


def spawner_binary(cache_dir: str | os.PathLike[str]) -> Path:
    """The helper that starts a call's agent (``agent/fncall_spawn.c``), compiled on first
    use next to the agent binary."""
    return agent.static_binary(cache_dir, SPAWN_SOURCE, SPAWN_BINARY, agent._key(SPAWN_SOURCE),
                               "the fncall spawner")


def spawn_argv(binary: Path, conf: Confinement) -> list[str]:
    """The helper's command line for ``conf`` (see ``agent/fncall_spawn.c``)."""
    argv = [str(binary)]
    for path in conf.cgroups:
        argv += ["-c", path]
    for path in MASKED_PATHS:
        argv += ["-m", path]
    for path in READONLY_PATHS:
        argv += ["-r", path]
    for kind, soft, hard in conf.rlimits:
        argv += ["-l", f"{kind}:{soft}:{hard}"]  # RLIM_INFINITY is -1 here and there
    argv += ["-C", ":".join(f"{c:x}" for c in conf.caps), "-s", f"{conf.policy}:{conf.nice}",
             "-a", ",".join(str(c) for c in sorted(conf.affinity)),
             "-o", str(conf.oom_score_adj), "-u", f"{conf.umask:o}",
             *(() if conf.seccomp else ("-S",)), "--"]
    return argv + [os.fsdecode(a) for a in conf.argv]


@dataclasses.dataclass(frozen=True)
class CallAgent:
    """A running call's agent: ``pid`` (host pid of the call's PID 1) and ``helper`` (the
    helper that started it, its parent until it dies)."""

    pid: int
    helper: int

    def stop(self) -> None:
        """Kill the call's PID 1 (the kernel then kills every process of its PID namespace)
        and reap the helper, which reaps it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.helper, 0)


def spawn(anchor: int, anchor_fd: int, argv: list[str], conf: Confinement, listener: int,
          stderr: int) -> CallAgent:
    """Start a call's agent (see the module docstring) on the listening socket ``listener``
    (its fd 3), with ``stderr`` as its stderr; returns once it is about to execute the agent
    binary, or raises ``RuntimeShimError`` with the step that failed. ``anchor_fd`` is a
    pidfd of ``anchor``, opened when the container started: the namespaces joined are its,
    never those of a process that got its pid after it died."""
    opened: list[int] = []
    try:
        for name in ("mnt", "uts"):
            opened.append(os.open(f"/proc/{anchor}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC))
        try:  # still alive after the opens: the pid was not reused
            signal.pidfd_send_signal(anchor_fd, 0)
        except ProcessLookupError:
            raise RuntimeShimError(f"fncall: sandbox process {anchor} is gone") from None
        program = os.memfd_create("envbuild-fncall-seccomp", os.MFD_CLOEXEC)
        opened.append(program)
        os.write(program, conf.seccomp)
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        opened += [report_r, report_w]
        # above 0-8, so no dup2 below overwrites another's source
        sources = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
                   for fd in (listener, stderr, report_w, opened[0], opened[1], program)]
        opened += sources
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                   (os.POSIX_SPAWN_DUP2, sources[1], 2),
                   *((os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(sources))]
        env = dict(e.split(b"=", 1) for e in conf.env if b"=" in e)
        pid = os.posix_spawn(argv[0], argv, env, file_actions=actions)
        for fd in (report_w, *sources):  # the helper's are its only copies of report_w now
            os.close(fd)
            opened.remove(fd)
        said = b""
        while chunk := os.read(report_r, 4096):  # EOF: the agent is executed (or all failed)
            said += chunk
    finally:
        for fd in opened:
            os.close(fd)
    pid_text, _, failure = said.partition(b"\n")
    if failure or not pid_text:
        if pid_text:
            CallAgent(int(pid_text), pid).stop()
        _, status = os.waitpid(pid, 0)
        raise RuntimeShimError("start the agent of an fncall call: "
                               + (failure.decode(errors="replace").strip() or
                                  f"exit {os.waitstatus_to_exitcode(status)}"),
                               hint="see start.log in the sandbox directory")
    return CallAgent(int(pid_text), pid)
