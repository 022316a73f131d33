"""The sandbox SDK: ``Sandbox.create(lock) → exec / read_file / write_file → close``.

One class for every backend; ``backend=`` is the single switch (``"container"`` today, the
microVM backend plugs in behind the same ``Backend`` protocol). A sandbox is:

- the lock's layers, unpacked once per host in the node cache and shared read-only;
- a private upper + work dir and an overlay mount (``<node>/sandboxes/<id>/merged``), the
  upper and work dirs, ``/tmp`` and the agent's run dir on the sandbox's own capped ext4
  (``<id>/disk``, ``runtime_shim.scratchfs``; ``Limits.disk_bytes`` / ``inodes``);
- a detached OCI container (runc by default) whose PID 1 is the exec agent
  (``runtime_shim.agent``: a static C program built once per host, bind-mounted read-only at
  ``/.envbuild/agent``). It accepts on ``<sandbox dir>/agent.sock``, a socket the host binds
  outside every mount of the sandbox and hands to runc as fd 3 (no process in the sandbox can
  reach, delete or replace it; ``runtime_shim/agent/README.md``, trust model), and runs each
  ``exec`` in its own process group on a connection from the host: about 1 ms a command
  instead of ~25 ms for ``runc exec``. Every exec has a deadline (``Limits.exec_timeout``).
  The agent runs as root so it can switch to the requested user; the lock's user is the
  default user of every exec. Commands inherit the agent's namespaces, cgroup, capability
  bounding set, ``noNewPrivileges`` and rlimits, i.e. what ``runc exec`` gave them; a non-root
  command has no effective capabilities, as with ``runc exec --user``.

Security by default (see ``runtime_shim.spec``): an empty network namespace unless
``network=True``, dropped capabilities, ``noNewPrivileges``, masked ``/proc`` paths, pids,
memory and CPU limits, an rlimit on open files, an output cap per exec so a command that prints
forever is stopped instead of filling memory, and a seccomp filter (``runtime_shim.seccomp``:
Docker's default, plus no new namespaces, mounts, keyrings, bpf, io_uring or filesystem-swapping
ioctls; ``seccomp=`` overrides it per sandbox). A microVM's boundary is its own guest kernel
instead: ``seccomp=`` does not apply to it.

Everything a sandbox owns is under its directory and its runtime state under the node's runc
root, both named by the sandbox id (``eb-…``), so ``gc_sandboxes`` can find and remove the
leftovers of a crashed process: mounts, runc containers, directories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import resource
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from envbuild.errors import RuntimeShimError
from envbuild.safefs import remove_tree
from envbuild.store import Store, put_file
from runtime_shim import agent, fsaccess, scratchfs
from runtime_shim import netns  # a networked sandbox's own namespace
from runtime_shim import seccomp as seccomp_profiles
from runtime_shim.locks import ResolvedLock, resolve
from runtime_shim.mount import OverlaySpec, mount_overlay, mounted_targets_under, unmount
from runtime_shim.nodecache import NodeCache
from runtime_shim.runc import OciRuntime, destroy, kill_and_delete, write_bundle
from runtime_shim.spec import BindMount, Rlimit, RuntimeSpecRequest, env_list, parse_user, runtime_spec
from runtime_shim.stub import AGENT_LISTEN_FD, AGENT_PATH, ensure_stub

SANDBOX_META_VERSION = 1
#: Snapshot layers a lock may end in before pack-diff squashes them into one.
DEFAULT_MAX_CHAIN = 8
DEFAULT_OUTPUT_CAP = 16 << 20
#: How long ``create`` waits for the agent's socket after ``runc run --detach`` returns.
AGENT_READY_TIMEOUT = 10.0


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. ``None`` leaves a limit off.

    ``cpus``: CPU bandwidth in cores (the cgroup's CFS quota per 100 ms period; 0.5 = half a
    core), 2.0 by default so one busy sandbox cannot take a bigger host's every core; not
    applied to microVMs, whose CPUs are their vCPUs.

    ``disk_bytes`` / ``inodes`` cap everything the sandbox writes to host disk (its writable
    layer, ``/tmp`` and the agent's log): one ext4 per sandbox on a loop device
    (``runtime_shim.scratchfs``); past them writes fail with ``ENOSPC``. The image is sparse:
    it costs the host what the sandbox wrote, never more than ``disk_bytes``. With
    ``disk_bytes=None`` those dirs are plain dirs under the node dir, uncapped. The microVM
    backend sizes its writable disk from the same two fields."""

    pids: int | None = 512
    memory_bytes: int | None = 2 << 30
    nofile: int = 4096
    cpus: float | None = 2.0
    output_bytes: int = DEFAULT_OUTPUT_CAP  # per exec and stream
    exec_timeout: float = agent.DEFAULT_EXEC_TIMEOUT  # seconds, for an exec with timeout=None
    disk_bytes: int | None = 10 << 30
    inodes: int | None = 1_000_000


@dataclasses.dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration: float
    timed_out: bool = False
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclasses.dataclass(frozen=True)
class SandboxPaths:
    root: Path

    @property
    def disk(self) -> Path:
        """The sandbox's capped filesystem (``scratchfs``): every dir the sandbox writes."""
        return self.root / scratchfs.MOUNT_NAME

    @property
    def upper(self) -> Path:
        return self.disk / "upper"

    @property
    def work(self) -> Path:
        return self.disk / "work"

    @property
    def tmp(self) -> Path:
        """``/tmp`` in the sandbox: on its disk, outside the upper dir (not in snapshots)."""
        return self.disk / "tmp"

    @property
    def merged(self) -> Path:
        return self.root / "merged"

    @property
    def bundle(self) -> Path:
        return self.root / "bundle"

    @property
    def meta(self) -> Path:
        return self.root / "sandbox.json"

    @property
    def agent_socket(self) -> Path:
        """The agent's listening socket: on the host only, no mount of the sandbox has it."""
        return self.root / "agent.sock"


class Backend(Protocol):
    """What a backend implements; ``Sandbox`` adds the shared behaviour on top."""

    def exec(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str, user: str,
             timeout: float | None, stdin: bytes | None) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes, mode: int) -> None: ...

    def close(self) -> None: ...


def compose(layer_dirs: Sequence[str], stub: str, paths: SandboxPaths) -> OverlaySpec:
    """The overlay of a sandbox (pure): layers given bottom to top become lower dirs topmost
    first, the stub at the very bottom, and the sandbox's own upper and work dirs."""
    return OverlaySpec(str(paths.merged), (*reversed(layer_dirs), stub), str(paths.upper),
                       str(paths.work))


def _clamped_nofile(wanted: int) -> Rlimit:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    value = min(wanted, hard) if hard != resource.RLIM_INFINITY else wanted
    return Rlimit("RLIMIT_NOFILE", value, value)


class ContainerBackend:
    """A detached runc (or crun) container over the sandbox's overlay."""

    def __init__(self, sandbox_id: str, paths: SandboxPaths, lock: ResolvedLock,
                 runtime: OciRuntime, *, network: netns.NetworkPolicy | None, limits: Limits,
                 agent_path: Path, keep: bool = False,
                 seccomp: str | Mapping | None = None) -> None:
        self.id = sandbox_id
        self.paths = paths
        self.lock = lock
        self.runtime = runtime
        self.limits = limits
        binds = [BindMount(str(agent_path), AGENT_PATH),
                 BindMount(str(paths.tmp), "/tmp", readonly=False)]
        env = dict(lock.env)
        # Own namespace + slirp + firewall (runtime_shim.netns); on a failure below,
        # Sandbox.create's cleanup (remove_sandbox_dir → netns.teardown) removes it.
        self.net = netns.create(paths.root, network, outlive_creator=keep) \
            if network is not None else None
        if self.net is not None:
            binds += [BindMount(self.net.resolv_conf, "/etc/resolv.conf")]
            ca_binds, ca_env = netns.host_ca()
            binds += ca_binds
            env = {**ca_env, **env}
        request = RuntimeSpecRequest(
            rootfs=str(paths.merged),
            args=(AGENT_PATH, "--listen-fd", str(AGENT_LISTEN_FD)),
            env=env_list(env), cwd=lock.workdir, uid=0, gid=0,
            hostname=lock.hostname or "sandbox", network=network is not None,
            network_ns=self.net.path if self.net else None,
            rlimits=(_clamped_nofile(limits.nofile),), pids_limit=limits.pids,
            memory_limit=limits.memory_bytes, cgroups_path=f"/envbuild/{sandbox_id}",
            binds=tuple(binds), tmpfs=(), cpus=limits.cpus, seccomp=seccomp)
        write_bundle(paths.bundle, runtime_spec(request))
        Path(runtime.state_root).mkdir(parents=True, exist_ok=True)
        # A detached container inherits runc's stdio: a pipe would never reach EOF while the
        # sandbox lives, so runc's (and the agent's) messages go to a file.
        # On the sandbox's disk: it is the agent's stderr, which sandbox root can reach
        # (/proc/1/fd/2) and would otherwise fill the host with.
        start_log = paths.disk / "start.log"
        pid_file = paths.root / "init.pid"
        # Held for the sandbox's life: the socket is bound and reached through it.
        self._dir_fd = os.open(paths.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        # The agent's socket lives in the sandbox dir, which no mount of the sandbox shows; the
        # agent gets the listening fd from runc and the host keeps no copy, so a dead agent
        # means ECONNREFUSED rather than a connection nobody accepts.
        try:
            with agent.listen_socket(self._dir_fd) as listener, open(start_log, "wb") as log:
                returncode = _spawn_with_fd(
                    runtime.command("run", "--detach", "--preserve-fds", "1", "--pid-file",
                                    str(pid_file), "--bundle", str(paths.bundle), sandbox_id),
                    log.fileno(), listener.fileno())
        except BaseException:
            os.close(self._dir_fd)
            raise
        if returncode != 0:
            destroy(runtime, sandbox_id)
            os.close(self._dir_fd)
            raise RuntimeShimError(f"start sandbox {sandbox_id}: {runtime.name} exited "
                                   f"{returncode}",
                                   context=start_log.read_text(errors="replace").strip()[-2000:])
        try:
            self.init_pid = _init_pid(runtime, sandbox_id, pid_file)
        except BaseException:
            os.close(self._dir_fd)
            raise
        try:
            self._wait_for_agent(start_log)
        except BaseException:
            self.close()
            raise

    def _connect(self) -> socket.socket:
        return agent.connect_agent(f"/proc/self/fd/{self._dir_fd}/agent.sock")

    def _wait_for_agent(self, start_log: Path) -> None:
        """The socket accepts connections from the start (the kernel queues them); the agent
        is ready once it answers a HELLO, which also checks its protocol version."""
        try:
            agent.hello(self._connect, AGENT_READY_TIMEOUT)
        except RuntimeShimError as e:
            why = "exited" if not os.path.exists(f"/proc/{self.init_pid}") else e.message
            raise RuntimeShimError(
                f"start sandbox {self.id}: the exec agent {why}",
                context=start_log.read_text(errors="replace").strip()[-2000:] or None,
                hint="see start.log in the sandbox directory") from None

    def exec(self, argv, *, env, cwd, user, timeout, stdin) -> ExecResult:
        started = time.monotonic()
        uid, gid = parse_user(user)  # numeric only: the agent reads no /etc/passwd for names
        req = agent.ExecRequest(argv=tuple(argv), env=env, cwd=cwd, user=f"{uid}:{gid}",
                                timeout=timeout, stdin=stdin)
        done = agent.run(self._connect, req, self.limits.output_bytes,
                         deadline=self.limits.exec_timeout)
        return ExecResult(exit_code=done.exit_code, stdout=done.stdout, stderr=done.stderr,
                          duration=time.monotonic() - started, timed_out=done.timed_out,
                          output_truncated=done.output_truncated)

    # Files are reached through the init process's root, i.e. in the sandbox's own mount
    # namespace: its /tmp and bind mounts included, exactly what commands see.
    def read_file(self, path: str) -> bytes:
        return fsaccess.read_file(f"/proc/{self.init_pid}/root", path)

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        uid, gid = parse_user(self.lock.user)
        fsaccess.write_file(f"/proc/{self.init_pid}/root", path, data, mode=mode, uid=uid,
                            gid=gid)

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        try:
            kill_and_delete(self.runtime, self.id, self.init_pid)
        finally:
            if getattr(self, "net", None) is not None:  # attach() has none: teardown removes it
                self.net.close()
                self.net = None

    @classmethod
    def attach(cls, sandbox_id: str, paths: SandboxPaths, lock: ResolvedLock,
               runtime: OciRuntime, limits: Limits) -> ContainerBackend:
        """The backend of a running sandbox another process created (``envbuild run
        --keep``), for ``envbuild pack-diff ID``."""
        self = cls.__new__(cls)
        self.id, self.paths, self.lock, self.runtime, self.limits = (
            sandbox_id, paths, lock, runtime, limits)
        self.init_pid = _init_pid(runtime, sandbox_id, paths.root / "init.pid")
        if not os.path.exists(f"/proc/{self.init_pid}"):
            raise RuntimeShimError(f"sandbox {sandbox_id} is not running",
                                   hint="envbuild sandbox ls shows its state")
        self._dir_fd = os.open(paths.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return self

    def upper_dir(self) -> Path:
        return self.paths.upper

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
    except OSError as e:
        raise RuntimeShimError(f"start sandbox: {argv[0]}: {e.strerror}") from e
    finally:
        os.close(high)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _init_pid(runtime: OciRuntime, container_id: str, pid_file: Path) -> int:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        destroy(runtime, container_id)
        raise RuntimeShimError(f"sandbox {container_id} did not start: no init pid",
                               hint="see start.log in the sandbox directory") from None


BACKENDS = ("container", "microvm")  # microvm: runtime_shim.vm (QEMU microVMs)


class Sandbox:
    """A running, isolated, disposable instance of a lock. Use as a context manager."""

    def __init__(self, sandbox_id: str, lock: ResolvedLock, paths: SandboxPaths,
                 backend: Backend, node_root: Path, store: Store | None = None) -> None:
        self.id = sandbox_id
        self.lock = lock
        self.paths = paths
        self._backend = backend
        self._node_root = node_root
        self._store = store
        self._closed = False

    @classmethod
    def attach(cls, sandbox_id: str, *, store: Store, node_dir: str | os.PathLike[str],
               runtime: str = "runc") -> Sandbox:
        """A running container sandbox created by another process (e.g. ``envbuild run
        --keep``). Closing it removes it, as for one this process created."""
        node_root = Path(node_dir)
        paths = SandboxPaths(node_root / "sandboxes" / sandbox_id)
        try:
            meta = json.loads(paths.meta.read_text())
        except (OSError, ValueError):
            raise RuntimeShimError(f"no sandbox {sandbox_id} on this host",
                                   hint="envbuild sandbox ls lists them") from None
        if meta.get("backend", "container") != "container":
            raise RuntimeShimError(f"sandbox {sandbox_id} is a {meta['backend']} sandbox; "
                                   "only container sandboxes can be attached to")
        lock = resolve(store, meta["lock"])
        impl = ContainerBackend.attach(sandbox_id, paths, lock,
                                       OciRuntime(runtime, state_root=str(node_root / "runc")),
                                       Limits())
        return cls(sandbox_id, lock, paths, impl, node_root, store)

    def pack_diff(self, publish: str | None = None, *, policy=None,
                  max_chain: int | None = DEFAULT_MAX_CHAIN, source_date_epoch: int = 0):
        """Snapshot this sandbox: its changes become a layer (hostile-content policy applied,
        ``runtime_shim.packdiff``), stored with a derived lock = this lock + that layer,
        published under ``publish`` (e.g. ``snap/NAME``) if given. Processes are paused while
        the upper dir is read. When the lock would end in more than ``max_chain`` snapshot
        layers, they are squashed into one. Returns a ``SnapshotResult``."""
        from runtime_shim import packdiff

        self._check_open()
        if self._store is None:
            raise RuntimeShimError("pack_diff needs the store the sandbox was created from")
        quiesce = getattr(self._backend, "quiesce", None)
        if quiesce is None:
            raise RuntimeShimError("pack-diff is not supported by this sandbox's backend yet")
        started = time.monotonic()
        name = publish or self.id
        blob = self.paths.root / "snapshot.tar.zst"
        try:
            with quiesce(), open(blob, "wb") as out:
                info, report = packdiff.pack_upper(
                    self._backend.upper_dir(), out,
                    policy or packdiff.SnapshotPolicy.for_limits(self._backend.limits),
                    name=name, source_date_epoch=source_date_epoch)
            stored = put_file(self._store, blob)
        finally:
            blob.unlink(missing_ok=True)
        if stored.digest != info.digest:
            raise RuntimeShimError(f"snapshot stored as {stored.digest}, packed {info.digest}")
        layer = {"digest": info.digest, "size": info.size, "diff_id": info.diff_id,
                 "toc_digest": info.toc_digest, "name": name}
        manifest, config = packdiff.derive_lock(self.lock, [layer], keep=len(self.lock.layers))
        squash = max_chain is not None and packdiff.snapshot_chain(self.lock) + 1 > max_chain
        digest = packdiff.publish_lock(self._store, manifest, config,
                                       None if squash else publish)
        if squash:
            digest = packdiff.squash_snapshots(self._store, resolve(self._store, digest),
                                               scratch=self.paths.root, ref=publish,
                                               name=name) or digest
        return packdiff.SnapshotResult(layer=info.digest, lock=digest, ref=publish,
                                       size=info.size, report=report, squashed=squash,
                                       seconds=time.monotonic() - started)

    @classmethod
    def create(
        cls,
        lock: str,
        *,
        store: Store,
        node_dir: str | os.PathLike[str],
        backend: str = "container",
        network: bool | Sequence[str] = False,
        limits: Limits | None = None,
        runtime: str = "runc",
        keep: bool = False,
        lazy: bool = False,
        seccomp: str | Mapping | None = None,
    ) -> Sandbox:
        """Fetch what is missing, compose and start a sandbox of ``lock`` (digest or ref).

        ``lazy``: instead of unpacking the layers, mount each one read-only with FUSE, served
        from ``store`` file by file on first read (``runtime_shim.lazyfs``); ``store`` must be
        one another process can open (a directory or S3).

        ``seccomp``: None for the default syscall filter (``runtime_shim.seccomp``),
        ``"unconfined"`` for none, or a full OCI ``linux.seccomp`` object (checked here). A
        microVM is bounded by its guest kernel, not a filter: it takes None or "unconfined".

        ``network``: False for none; True for egress through the sandbox's own namespace and
        user-mode NAT, the host itself unreachable; a list of ``CIDR[:PORT]`` for egress to
        those only (``runtime_shim.netns``)."""
        policy = netns.parse_network(network)  # bad entries fail before anything is made
        if backend not in BACKENDS:
            raise RuntimeShimError(f"unknown sandbox backend {backend!r}",
                                   hint=f"choose one of: {', '.join(BACKENDS)}")
        seccomp_profiles.check_setting(seccomp)
        if backend == "microvm" and isinstance(seccomp, Mapping):
            raise RuntimeShimError("a seccomp profile applies to container sandboxes only",
                                   hint="a microVM's boundary is its own guest kernel; "
                                        "pass seccomp=None for it")
        node_root = Path(node_dir)
        node = NodeCache(node_root / "node")
        resolved = resolve(store, lock)
        if lazy:  # lazy mode: FUSE mounts instead of unpacked layers
            from runtime_shim.lazyfs import lazy_layer_dirs

            layer_dirs = lazy_layer_dirs(node, store, resolved.layers)
        else:
            layer_dirs = [str(node.ensure(store, layer.digest, layer.toc_digest))
                          for layer in resolved.layers]
        sandbox_id = f"eb-{uuid.uuid4().hex[:12]}"
        paths = SandboxPaths(node_root / "sandboxes" / sandbox_id)
        limits = limits or Limits()
        paths.root.mkdir(parents=True)
        try:
            if backend == "container" and limits.disk_bytes is not None:
                scratchfs.create(paths.root, limits.disk_bytes, limits.inodes,
                                 template_root=node.root / "scratchfs")
            for p in (paths.upper, paths.work, paths.merged, paths.tmp):
                p.mkdir(parents=True)
            os.chmod(paths.tmp, 0o1777)
        except BaseException:
            remove_sandbox_dir(paths)
            raise
        _write_meta(paths, {"version": SANDBOX_META_VERSION, "id": sandbox_id,
                            "lock": resolved.digest, "backend": backend, "pid": os.getpid(),
                            "kept": keep, "created": time.time(),
                            "layers": [layer.digest for layer in resolved.layers]})
        if backend == "microvm":  # --- microVM backend switch: the guest composes the layers
            from runtime_shim.vm.backend import MicroVmBackend

            try:
                impl = MicroVmBackend(sandbox_id, paths.root, resolved, node, layer_dirs,
                                      network=policy, limits=limits)
            except BaseException:
                remove_sandbox_dir(paths)
                raise
            return cls(sandbox_id, resolved, paths, impl, node_root, store)  # --- end microVM switch
        oci = OciRuntime(runtime, state_root=str(node_root / "runc"))
        mounted = False
        try:
            agent_path = agent.agent_binary(node.root)
            mount_overlay(compose(layer_dirs, str(ensure_stub(node.root)), paths))
            mounted = True
            impl = ContainerBackend(sandbox_id, paths, resolved, oci, network=policy,
                                    limits=limits, agent_path=agent_path,
                                    keep=keep, seccomp=seccomp)
        except BaseException:
            if mounted:
                unmount(str(paths.merged))
            netns.teardown(paths.root)
            scratchfs.destroy(paths.root)
            with contextlib.suppress(OSError):  # the error that got us here matters more
                remove_tree(paths.root)
            raise
        return cls(sandbox_id, resolved, paths, impl, node_root, store)

    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             user: str | None = None, stdin: bytes | None = None) -> ExecResult:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``) and wait for it."""
        self._check_open()
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise RuntimeShimError("exec needs a command")
        return self._backend.exec(argv, env=dict(env or {}), cwd=cwd or self.lock.workdir,
                                  user=user or self.lock.user, timeout=timeout, stdin=stdin)

    def read_file(self, path: str) -> bytes:
        self._check_open()
        return self._backend.read_file(path)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._check_open()
        self._backend.write_file(path, data.encode() if isinstance(data, str) else data, mode)

    def close(self) -> None:
        """Stop every process, unmount and remove the sandbox's files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._backend.close()
        finally:
            remove_sandbox_dir(self.paths)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeShimError(f"sandbox {self.id} is closed")

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} lock={self.lock.digest[:19]}>"


def _write_meta(paths: SandboxPaths, meta: dict) -> None:
    tmp = paths.root / "sandbox.json.tmp"
    tmp.write_text(json.dumps(meta))
    tmp.replace(paths.meta)


def remove_sandbox_dir(paths: SandboxPaths) -> None:
    """Unmount everything below a sandbox's dir, then delete it: iteratively and fd-based
    (``safefs.remove_tree``: any depth, symlinks never followed, no mount crossed), so a tree
    the sandbox made 4,096 levels deep goes like a flat one. What cannot be removed raises
    ``RuntimeShimError`` naming the cause (the dir stays for ``envbuild sandbox gc``)."""
    netns.teardown(paths.root)  # slirp4netns and the namespace file of a networked sandbox
    for target in mounted_targets_under(str(paths.root)):
        unmount(target)
    scratchfs.destroy(paths.root)  # the disk is unmounted above; this releases its loop device
    try:
        remove_tree(paths.root)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        raise RuntimeShimError(f"remove sandbox dir {paths.root}: {e.strerror}{where}",
                               hint="fix the cause (e.g. `lsattr`, `findmnt -R`), then run "
                               "`envbuild sandbox gc`") from None


@dataclasses.dataclass(frozen=True)
class SandboxInfo:
    id: str
    lock: str
    pid: int
    alive: bool  # the creating process still runs
    kept: bool  # made with keep=True (envbuild run --keep): gc leaves it alone
    created: float
    layers: tuple[str, ...]
    path: Path


def list_sandboxes(node_dir: str | os.PathLike[str]) -> list[SandboxInfo]:
    root = Path(node_dir) / "sandboxes"
    found = []
    if not root.is_dir():
        return found
    for d in sorted(root.iterdir()):
        try:
            meta = json.loads((d / "sandbox.json").read_text())
        except (OSError, ValueError):
            meta = {}
        pid = int(meta.get("pid", 0))
        found.append(SandboxInfo(id=d.name, lock=meta.get("lock", "?"), pid=pid,
                                 alive=_pid_alive(pid), kept=bool(meta.get("kept")),
                                 created=meta.get("created", 0.0),
                                 layers=tuple(meta.get("layers", ())), path=d))
    return found


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_sandbox(node_dir: str | os.PathLike[str], sandbox_id: str,
                   runtime: str = "runc") -> None:
    """Kill, unmount and delete one sandbox, whoever created it."""
    node_root = Path(node_dir)
    destroy(OciRuntime(runtime, state_root=str(node_root / "runc")), sandbox_id)
    remove_sandbox_dir(SandboxPaths(node_root / "sandboxes" / sandbox_id))


def layers_in_use(node_dir: str | os.PathLike[str]) -> set[str]:
    """Layer digests of the sandboxes on this host that are alive or kept: never evict those."""
    in_use: set[str] = set()
    for info in list_sandboxes(node_dir):
        if info.alive or info.kept:
            in_use.update(info.layers)
    return in_use


@dataclasses.dataclass(frozen=True)
class SandboxRemoval:
    """What ``sweep_sandboxes`` did with one orphaned sandbox: removed, or ``error`` (one line:
    the cause, then the hint)."""

    id: str
    error: str | None = None

    @property
    def removed(self) -> bool:
        return self.error is None


def sweep_sandboxes(node_dir: str | os.PathLike[str],
                    runtime: str = "runc") -> list[SandboxRemoval]:
    """Try to remove every sandbox whose creating process is gone (a crash or kill -9), except
    kept ones; one that fails never stops the others. One ``SandboxRemoval`` per sandbox."""
    done = []
    for info in list_sandboxes(node_dir):
        if info.alive or info.kept:
            continue
        try:
            remove_sandbox(node_dir, info.id, runtime)
        except RuntimeShimError as e:
            done.append(SandboxRemoval(info.id, e.message + (f" — {e.hint}" if e.hint else "")))
        except OSError as e:
            done.append(SandboxRemoval(info.id, f"{e.strerror} ({e.filename or info.path})"))
        else:
            done.append(SandboxRemoval(info.id))
    return done


def gc_sandboxes(node_dir: str | os.PathLike[str], runtime: str = "runc") -> list[str]:
    """Remove sandboxes whose creating process is gone, except kept ones: the ids removed.
    Every orphan is tried; if any could not be removed, ``RuntimeShimError`` afterwards names
    each with its cause (``sweep_sandboxes`` gives the per-sandbox outcomes instead)."""
    done = sweep_sandboxes(node_dir, runtime)
    failed = [r for r in done if not r.removed]
    if failed:
        raise RuntimeShimError(f"{len(failed)} orphaned sandbox(es) could not be removed "
                               f"({len(done) - len(failed)} removed)",
                               context="\n".join(f"{r.id}: {r.error}" for r in failed))
    return [r.id for r in done]
