"""The container backend: a sandbox as a detached OCI container (runc by default).

A sandbox is the lock's layers, unpacked once per host in the node cache and shared read-only;
a private upper + work dir and an overlay at ``<node>/sandboxes/<id>/merged`` mounted only in
the container's own mount namespace (``runtime_shim.isolation.mountns``), the upper
and work dirs, ``/tmp`` and the agent's run dir on the sandbox's own capped disk (``<id>/disk``:
a quota-capped subvolume of the node's disk pool, or a loop-mounted ext4 with
``ENVBUILD_SANDBOX_DISK=loop``; ``runtime_shim.node.diskpool``, ``Limits.disk_bytes``); and a
detached OCI container
whose PID 1 is the exec agent (``runtime_shim.isolation.agent``: a static C program built once per host,
bind-mounted read-only at ``/.envbuild/agent``). It accepts on ``<sandbox dir>/agent.sock``, a
socket the host binds outside every mount of the sandbox and hands to runc as fd 3 (no process
in the sandbox can reach, delete or replace it; ``runtime_shim/isolation/agent/README.md``, trust model),
and runs each ``exec`` in its own process group on a connection from the host: about 1 ms a
command instead of ~25 ms for ``runc exec``. The agent runs as root so it can switch to the
requested user; the lock's user is the default user of every exec. Commands inherit the agent's
namespaces, cgroup, capability bounding set, ``noNewPrivileges`` and rlimits, i.e. what ``runc
exec`` gave them; a non-root command has no effective capabilities, as with ``runc exec --user``.

Security by default (see ``runtime_shim.isolation.spec``): an empty network namespace unless
``network=True``, dropped capabilities, ``noNewPrivileges``, masked ``/proc`` paths, pids,
memory and CPU limits, an rlimit on open files, an output cap per exec, and a seccomp filter
(``runtime_shim.isolation.seccomp``; ``seccomp=`` overrides it per sandbox).

The runtime state of every container is under the node's runc root (``NodeLayout.runc``),
named by the sandbox id, so ``remove`` can find and stop the leftovers of a crashed process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import socket
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from envbuild.errors import (
    BackendUnavailable,
    CheckpointRefused,
    RuntimeShimError,
    SandboxNotFound,
    SandboxStartError,
)
from envbuild.safefs import read_tail
from runtime_shim.backends import criu
from runtime_shim.backends.base import CheckpointImage, CreateRequest
from runtime_shim.isolation import agent, cgroupfs, cpuclass, fsaccess, mountns, netns
from runtime_shim.isolation.mount import OverlaySpec, mount_overlay
from runtime_shim.isolation.runc import (
    OciRuntime,
    destroy,
    kill_and_delete,
    runtime_error_line,
    write_bundle,
)
from runtime_shim.isolation.spec import (
    BindMount,
    Rlimit,
    RuntimeSpecRequest,
    env_list,
    parse_user,
    runtime_spec,
)
from runtime_shim.isolation.stub import AGENT_LISTEN_FD, AGENT_PATH, ensure_stub
from runtime_shim.isolation.watch import DirWatch
from runtime_shim.node import diskpool
from runtime_shim.node.layout import NodeLayout, SandboxPaths
from runtime_shim.node.locks import ResolvedLock
from runtime_shim.node.model import Limits, MemoryInfo, SandboxUsage

#: The CRIU options file of a checkpoint, in the sandbox dir (written by ``runtime_shim.backends.criu``).
CRIU_CONFIG = "criu.conf"
#: How long ``create`` waits for the agent's socket after ``runc run --detach`` returns.
AGENT_READY_TIMEOUT = 10.0


def compose(layer_dirs: Sequence[str], stub: str, paths: SandboxPaths) -> OverlaySpec:
    """The overlay of a sandbox (pure): layers given bottom to top become lower dirs topmost
    first, the stub at the very bottom, and the sandbox's own upper and work dirs."""
    return OverlaySpec(str(paths.merged), (*reversed(layer_dirs), stub), str(paths.upper),
                       str(paths.work))


def _clamped_nofile(wanted: int) -> Rlimit:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    value = min(wanted, hard) if hard != resource.RLIM_INFINITY else wanted
    return Rlimit("RLIMIT_NOFILE", value, value)


class ContainerSandbox:
    """A detached runc (or crun) container over the sandbox's overlay (a ``SandboxHandle``,
    ``Snapshottable``)."""

    def __init__(self, sandbox_id: str, paths: SandboxPaths, lock: ResolvedLock,
                 runtime: OciRuntime, *, network: netns.NetworkPolicy | None, limits: Limits,
                 agent_path: Path, keep: bool = False,
                 seccomp: str | Mapping | None = None,
                 spec_hook: Callable[[RuntimeSpecRequest], RuntimeSpecRequest] | None = None,
                 restore: CheckpointImage | None = None, checkpointable: bool = False,
                 overlay: OverlaySpec | None = None) -> None:
        """Start the sandbox in named steps: its binds, environment and network
        (``_bind_network``), its runtime spec (``_write_spec``), the container
        (``_run_container``: a fresh agent, or with ``restore`` a checkpoint's processes), then
        the agent's first answer. ``overlay``: the root, mounted in a mount namespace of the
        container's own (``runtime_shim.isolation.mountns``), never in the host's; without
        it the caller has mounted the root."""
        self.id = sandbox_id
        self.paths = paths
        self.lock = lock
        self.runtime = runtime
        self.limits = limits
        binds, env = self._bind_network(agent_path, network, keep)
        # checkpointable: the agent's socket is made inside the sandbox's network namespace
        # (without network= too: one made here), since CRIU finds a socket only in the
        # namespace of the process it dumps; the price is that the sandbox sees the socket in
        # /proc/net/unix (it still cannot reach it: no mount shows its path).
        self.checkpointable = checkpointable or restore is not None
        own_ns = criu.own_netns(paths.root) if self.net is None and self.checkpointable \
            else None
        self._write_spec(binds, env, network is not None, own_ns, seccomp, spec_hook)
        cgroupfs.cloning_cpuset_parent()  # runc then writes no cpuset.cpus (a host-wide walk)
        # A detached container inherits runc's stdio: a pipe would never reach EOF while the
        # sandbox lives, so runc's (and the agent's) messages go to a file.
        # On the sandbox's disk: it is the agent's stderr, which sandbox root can reach
        # (/proc/1/fd/2) and would otherwise fill the host with.
        start_log = paths.start_log
        # Held for the sandbox's life: the socket is bound and reached through it.
        self._dir_fd = os.open(paths.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        returncode = self._run_container(own_ns, restore, start_log, overlay)
        if returncode != 0:
            self._refuse_start(returncode, restore, start_log)
        try:
            self.init_pid = _init_pid(runtime, sandbox_id, paths.init_pid)
        except BaseException:
            os.close(self._dir_fd)
            raise
        try:
            cpuclass.apply(self.init_pid, limits.cpu_class)  # before the agent runs anything
            self._wait_for_agent(start_log)
        except BaseException:
            self.close()
            raise

    def _bind_network(self, agent_path: Path, network: netns.NetworkPolicy | None, keep: bool
                      ) -> tuple[list[BindMount], dict[str, str]]:
        """The sandbox's binds (the agent, its /tmp) and environment (the lock's); with
        ``network``, its own namespace (``self.net``), its resolv.conf and the host's CAs."""
        binds = [BindMount(str(agent_path), AGENT_PATH),
                 BindMount(str(self.paths.tmp), "/tmp", readonly=False)]
        env = dict(self.lock.env)
        # Own namespace + slirp + firewall (runtime_shim.isolation.netns); on a failure below,
        # Sandbox.create's cleanup (remove_sandbox_dir → netns.teardown) removes it.
        self.net = netns.create(self.paths.root, network, outlive_creator=keep) \
            if network is not None else None
        if self.net is not None:
            binds += [BindMount(self.net.resolv_conf, "/etc/resolv.conf")]
            ca_binds, ca_env = netns.host_ca()
            binds += ca_binds
            env = {**ca_env, **env}
        return binds, env

    def _write_spec(self, binds: Sequence[BindMount], env: Mapping[str, str], networked: bool,
                    own_ns: str | None, seccomp: str | Mapping | None,
                    spec_hook: Callable[[RuntimeSpecRequest], RuntimeSpecRequest] | None
                    ) -> None:
        """The OCI bundle of the container: its runtime spec, from the lock and the limits."""
        lock, limits = self.lock, self.limits
        request = RuntimeSpecRequest(
            rootfs=str(self.paths.merged),
            args=(AGENT_PATH, "--listen-fd", str(AGENT_LISTEN_FD)),
            env=env_list(env), cwd=lock.workdir, uid=0, gid=0,
            hostname=lock.hostname or "sandbox", network=networked or bool(own_ns),
            network_ns=self.net.path if self.net else own_ns,
            rlimits=(_clamped_nofile(limits.nofile),), pids_limit=limits.pids,
            memory_limit=limits.memory_bytes, cgroups_path=f"/envbuild/{self.id}",
            binds=tuple(binds), tmpfs=(), cpus=limits.cpus, seccomp=seccomp,
            inotify=limits.inotify,
            cpu_shares=cpuclass.cpu_shares(limits.cpu_class))
        if spec_hook is not None:  # a backend built on this one (runtime_shim.backends.fncall)
            request = spec_hook(request)
        config = runtime_spec(request)
        # CRIU reads its options for this container from here (``runtime_shim.backends.criu``)
        config["annotations"] = {"org.criu.config": str(self.paths.root / CRIU_CONFIG)}
        write_bundle(self.paths.bundle, config)
        Path(self.runtime.state_root).mkdir(parents=True, exist_ok=True)

    def _run_container(self, own_ns: str | None, restore: CheckpointImage | None,
                       start_log: Path, overlay: OverlaySpec | None) -> int:
        """``runc run --detach`` (or a CRIU restore) with the agent's listening socket as fd
        3: the runtime's exit code. With ``overlay``, the runtime starts in a mount namespace
        of its own where the overlay is mounted: the container's namespace, a copy of it, is
        then the only one that holds it. The dir fd is closed if this raises."""
        # The agent's socket lives in the sandbox dir, which no mount of the sandbox shows; the
        # agent gets the listening fd from runc and the host keeps no copy, so a dead agent
        # means ECONNREFUSED rather than a connection nobody accepts.
        try:
            netns_path = (self.net.path if self.net else own_ns) if self.checkpointable \
                else None
            with criu.in_netns(netns_path, lambda: agent.listen_socket(self._dir_fd)) \
                    as listener, open(start_log, "wb") as log:
                def spawn() -> int:
                    if overlay is not None:
                        mount_overlay(overlay)
                    if restore is None:
                        return _spawn_with_fd(
                            self.runtime.command("run", "--detach", "--preserve-fds", "1",
                                                 "--pid-file", str(self.paths.init_pid),
                                                 "--bundle", str(self.paths.bundle), self.id),
                            log.fileno(), listener.fileno())
                    # the processes of a checkpoint instead of a fresh agent
                    return criu.spawn_restore(self.runtime, self.id, self.paths, restore,
                                              log.fileno(), listener.fileno())

                return spawn() if overlay is None else mountns.in_own_mount_ns(spawn)
        except BaseException:
            os.close(self._dir_fd)
            raise

    def _refuse_start(self, returncode: int, restore: CheckpointImage | None,
                      start_log: Path) -> NoReturn:
        """Remove what the failed start left and raise why it failed."""
        destroy(self.runtime, self.id)
        os.close(self._dir_fd)
        if restore is not None:
            raise criu.restore_refusal(self.id, self.paths, restore, returncode)
        said = _log_tail(start_log)
        cause = runtime_error_line(said)
        raise SandboxStartError(f"start sandbox {self.id}: {self.runtime.name} exited "
                                f"{returncode}" + (f": {cause}" if cause else ""),
                                context=said.strip()[-2000:] or None,
                                hint="see start.log in the sandbox directory")

    def _connect(self) -> socket.socket:
        return agent.connect_agent(f"/proc/self/fd/{self._dir_fd}/agent.sock")

    def _wait_for_agent(self, start_log: Path) -> None:
        """The socket accepts connections from the start (the kernel queues them); the agent
        is ready once it answers a HELLO, which also checks its protocol version."""
        try:
            agent.hello(self._connect, AGENT_READY_TIMEOUT)
        except RuntimeShimError as e:
            why = "exited" if not os.path.exists(f"/proc/{self.init_pid}") else e.message
            raise SandboxStartError(
                f"start sandbox {self.id}: the exec agent {why}",
                context=_log_tail(start_log).strip()[-2000:] or None,
                hint="see start.log in the sandbox directory") from None

    connect = _connect

    def exec(self, req: agent.ExecRequest, *, on_stdout: agent.OutputCallback | None = None,
             on_stderr: agent.OutputCallback | None = None) -> agent.ExecOutcome:
        return agent.run(self._connect, req, self.limits.output_bytes,
                         deadline=self.limits.exec_timeout, on_stdout=on_stdout,
                         on_stderr=on_stderr)

    # Files are reached through the init process's root, i.e. in the sandbox's own mount
    # namespace: its /tmp and bind mounts included, exactly what commands see.
    def read_file(self, path: str) -> bytes:
        return fsaccess.read_file(f"/proc/{self.init_pid}/root", path)

    def watch(self, path: str, *, recursive: bool) -> DirWatch:
        return DirWatch.open(f"/proc/{self.init_pid}/root", path, recursive=recursive)

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        uid, gid = parse_user(self.lock.user)
        fsaccess.write_file(f"/proc/{self.init_pid}/root", path, data, mode=mode, uid=uid,
                            gid=gid)

    def open_read(self, path: str) -> int:
        return fsaccess.open_read(f"/proc/{self.init_pid}/root", path)

    def open_write(self, path: str, mode: int, uid: int, gid: int, hold: int = 0
                   ) -> fsaccess.FileWriter:
        return fsaccess.FileWriter(f"/proc/{self.init_pid}/root", path, mode=mode, uid=uid,
                                   gid=gid, hold=hold)

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        try:
            kill_and_delete(self.runtime, self.id, self.init_pid)
        finally:
            net = getattr(self, "net", None)  # attach() has none: teardown removes it
            if net is not None:
                net.close()
                self.net = None

    @classmethod
    def attach(cls, sandbox_id: str, paths: SandboxPaths, lock: ResolvedLock,
               runtime: OciRuntime, limits: Limits) -> ContainerSandbox:
        """The backend of a running sandbox another process created (``envbuild run
        --keep``), for ``envbuild pack-diff ID``."""
        self = cls.__new__(cls)
        self.id, self.paths, self.lock, self.runtime, self.limits = (
            sandbox_id, paths, lock, runtime, limits)
        self.init_pid = _init_pid(runtime, sandbox_id, paths.init_pid)
        self.checkpointable = (paths.root / criu.OWN_NETNS).exists()
        if not os.path.exists(f"/proc/{self.init_pid}"):
            raise SandboxNotFound(f"sandbox {sandbox_id} is not running",
                                   hint="envbuild sandbox ls shows its state")
        self._dir_fd = os.open(paths.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return self

    def upper_dir(self) -> Path:
        return self.paths.upper

    @property
    def host_pid(self) -> int | None:
        """``backends.base.HostProcess``: the container's init."""
        return self.init_pid

    def memory(self) -> MemoryInfo | None:
        """What its memory cgroup holds (``runtime_shim.node.reclaim``)."""
        from runtime_shim.node import reclaim

        return reclaim.memory_info(self.paths)

    def usage(self) -> SandboxUsage | None:
        """``backends.base.Metered``: its cgroups and disk (``runtime_shim.node.usage``)."""
        from runtime_shim.node.usage import read_usage

        return read_usage(self.paths, self.limits.cpus)

    def checkpoint(self, dest_dir: Path, *, leave_running: bool) -> CheckpointImage:
        """``runtime_shim.backends.criu.checkpoint`` (``backend.Checkpointable``); a sandbox created
        without ``checkpointable=True`` is refused (its agent socket is outside its
        namespace, where CRIU cannot dump it)."""
        if not self.checkpointable:
            raise CheckpointRefused(f"checkpoint {self.id}: the sandbox was not created "
                                    "checkpointable",
                                    hint="Sandbox.create(..., checkpointable=True)")
        return criu.checkpoint(self, dest_dir, leave_running=leave_running)

    @contextlib.contextmanager
    def quiesce(self) -> Iterator[None]:
        """Freeze every process of the sandbox (``runc pause``: the cgroup freezer) while its
        upper dir is read, so a snapshot is one consistent moment; resume afterwards."""
        done = subprocess.run(self.runtime.command("pause", self.id), capture_output=True,
                              check=False)
        if done.returncode != 0:
            raise RuntimeShimError(f"pause sandbox {self.id}: "
                                   f"{done.stderr.decode(errors='replace').strip()}",
                                   hint="the cgroup freezer is needed to snapshot a live sandbox")
        try:
            yield
        finally:
            subprocess.run(self.runtime.command("resume", self.id), capture_output=True,
                           check=False)


#: How much of a start log a failure reads: its end (the sandbox's stderr shares the file, so
#: it can be as large as the sandbox's disk).
START_LOG_TAIL = 64 << 10


def _log_tail(path: Path) -> str:
    """The end of a start log ('' when it cannot be read, or is no regular file)."""
    try:
        return read_tail(path, START_LOG_TAIL)
    except OSError:
        return ""


def _spawn_with_fd(argv: list[str], stderr_fd: int, pass_fd: int) -> int:
    """Run ``argv`` to completion with stdin/stdout on /dev/null, ``stderr_fd`` as stderr and
    ``pass_fd`` as fd ``AGENT_LISTEN_FD`` (3: what ``runc --preserve-fds 1`` passes on).
    ``subprocess`` cannot place an fd at a given number; ``posix_spawn``'s dup2 can."""
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
               (os.POSIX_SPAWN_DUP2, stderr_fd, 2),
               (os.POSIX_SPAWN_DUP2, pass_fd, AGENT_LISTEN_FD)]
    # above 0-3, so neither dup2 overwrites the other's source (nor is a no-op that keeps
    # the close-on-exec flag)
    high = fcntl.fcntl(pass_fd, fcntl.F_DUPFD_CLOEXEC, 10)
    actions[3] = (os.POSIX_SPAWN_DUP2, high, AGENT_LISTEN_FD)
    try:
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
    except FileNotFoundError as e:
        raise BackendUnavailable(f"start sandbox: {argv[0]} is not installed",
                                 hint="install runc (scripts/setup.sh) or pass runtime=") from e
    except OSError as e:
        raise SandboxStartError(f"start sandbox: {argv[0]}: {e.strerror}") from e
    finally:
        os.close(high)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _init_pid(runtime: OciRuntime, container_id: str, pid_file: Path) -> int:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        destroy(runtime, container_id)
        raise SandboxStartError(f"sandbox {container_id} did not start: no init pid",
                               hint="see start.log in the sandbox directory") from None


class ContainerBackend:
    """The ``container`` backend (``runtime_shim.backends.base.Backend``)."""

    name = "container"

    def check(self, *, keep: bool, seccomp: str | Mapping | None, lazy: bool) -> None:
        pass  # every option applies to containers

    def create(self, req: CreateRequest) -> ContainerSandbox:
        return self._start(req, None)

    def restored_limits(self, image: CheckpointImage) -> Limits | None:
        return None  # a container's limits are not part of its image: the defaults

    def restore(self, req: CreateRequest, image: CheckpointImage) -> ContainerSandbox:
        """A sandbox of ``req`` whose processes come from ``image`` (``backend.Restorable``;
        ``runtime_shim.backends.criu``): checked against its record before anything starts."""
        criu.check_image(image, req)
        sb = self._start(req, image)
        try:
            criu.check_restored(sb.init_pid, image)
        except BaseException:
            sb.close()
            raise
        return sb

    def _start(self, req: CreateRequest, image: CheckpointImage | None) -> ContainerSandbox:
        paths, limits = req.paths, req.limits
        diskpool.create_disk(req.layout, paths, limits, template_root=req.node.root / "scratchfs",
                             backend=self.name)
        for p in (paths.upper, paths.work, paths.merged, paths.tmp):
            p.mkdir(parents=True)
        os.chmod(paths.tmp, 0o1777)
        oci = OciRuntime(req.runtime, state_root=str(req.layout.runc))
        agent_path = agent.agent_binary(req.node.root)
        # mounted where only the container sees it (runtime_shim.isolation.mountns): gone
        # with the container, and no sandbox's overlay in the host's mount table
        overlay = compose(req.layer_dirs, str(ensure_stub(req.node.root)), paths)
        return ContainerSandbox(req.id, paths, req.lock, oci, network=req.network,
                                limits=limits, agent_path=agent_path, keep=req.keep,
                                seccomp=req.seccomp, restore=image,
                                checkpointable=req.checkpointable, overlay=overlay)

    def attach(self, paths: SandboxPaths, layout: NodeLayout, lock: ResolvedLock,
               runtime: str) -> ContainerSandbox:
        # the limits it was made with are not recorded: the defaults bound what we read back
        return ContainerSandbox.attach(paths.id, paths, lock,
                                       OciRuntime(runtime, state_root=str(layout.runc)), Limits())

    def remove(self, layout: NodeLayout, sandbox_id: str, runtime: str) -> None:
        destroy(OciRuntime(runtime, state_root=str(layout.runc)), sandbox_id)
