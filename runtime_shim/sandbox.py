"""The sandbox SDK: ``Sandbox.create(lock) → exec / read_file / write_file → close``.

One class for every backend; ``backend=`` is the single switch (``"container"`` today, the
microVM backend plugs in behind the same ``Backend`` protocol). A sandbox is:

- the lock's layers, unpacked once per host in the node cache and shared read-only;
- a private upper + work dir and an overlay mount (``<node>/sandboxes/<id>/merged``);
- a detached OCI container (runc by default) whose PID 1 is the exec agent
  (``runtime_shim.agent``: a static C program built once per host, bind-mounted read-only at
  ``/.envbuild/agent``). It listens on ``/.envbuild/run/agent.sock``, the sandbox's own
  ``run/`` directory bind-mounted read-write, and runs each ``exec`` in its own process group
  on a connection from the host: about 1 ms a command instead of ~25 ms for ``runc exec``.
  The agent runs as root so it can switch to the requested user; the lock's user is the
  default user of every exec. Commands inherit the agent's namespaces, cgroup, capability
  bounding set, ``noNewPrivileges`` and rlimits, i.e. what ``runc exec`` gave them; a non-root
  command has no effective capabilities, as with ``runc exec --user``.

Security by default (see ``runtime_shim.spec``): an empty network namespace unless
``network=True``, dropped capabilities, ``noNewPrivileges``, masked ``/proc`` paths, pids and
memory limits, an rlimit on open files, and an output cap per exec so a command that prints
forever is stopped instead of filling memory.

Everything a sandbox owns is under its directory and its runtime state under the node's runc
root, both named by the sandbox id (``eb-…``), so ``gc_sandboxes`` can find and remove the
leftovers of a crashed process: mounts, runc containers, directories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from envbuild.errors import RuntimeShimError
from envbuild.safefs import remove_tree
from envbuild.store import Store, put_file
from runtime_shim import agent, fsaccess
from runtime_shim.locks import ResolvedLock, resolve
from runtime_shim.mount import OverlaySpec, mount_overlay, mounted_targets_under, unmount
from runtime_shim.nodecache import NodeCache
from runtime_shim.runc import OciRuntime, destroy, kill_and_delete, write_bundle
from runtime_shim.spec import BindMount, Rlimit, RuntimeSpecRequest, env_list, parse_user, runtime_spec
from runtime_shim.stub import AGENT_PATH, AGENT_RUN_DIR, ensure_stub

SANDBOX_META_VERSION = 1
#: Snapshot layers a lock may end in before pack-diff squashes them into one.
DEFAULT_MAX_CHAIN = 8
DEFAULT_OUTPUT_CAP = 16 << 20
#: How long ``create`` waits for the agent's socket after ``runc run --detach`` returns.
AGENT_READY_TIMEOUT = 10.0


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. ``None`` leaves a limit off."""

    pids: int | None = 512
    memory_bytes: int | None = 2 << 30
    nofile: int = 4096
    output_bytes: int = DEFAULT_OUTPUT_CAP  # per exec and stream


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
    def upper(self) -> Path:
        return self.root / "upper"

    @property
    def work(self) -> Path:
        return self.root / "work"

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
    def run(self) -> Path:
        """The agent's socket directory, ``/.envbuild/run`` in the sandbox."""
        return self.root / "run"


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
                 runtime: OciRuntime, *, network: bool, limits: Limits, agent_path: Path) -> None:
        self.id = sandbox_id
        self.paths = paths
        self.lock = lock
        self.runtime = runtime
        self.limits = limits
        # Root-only: a non-root command in the sandbox must not reach the agent (which would
        # run anything as root); the agent also refuses peers from inside the sandbox.
        paths.run.mkdir(mode=0o700)
        binds = [BindMount(str(agent_path), AGENT_PATH),
                 BindMount(str(paths.run), AGENT_RUN_DIR, readonly=False)]
        if network:
            binds += [BindMount("/etc/resolv.conf", "/etc/resolv.conf")]
        request = RuntimeSpecRequest(
            rootfs=str(paths.merged),
            args=(AGENT_PATH, "--listen", f"{AGENT_RUN_DIR}/agent.sock"),
            env=env_list(lock.env), cwd=lock.workdir, uid=0, gid=0,
            hostname=lock.hostname or "sandbox", network=network,
            rlimits=(_clamped_nofile(limits.nofile),), pids_limit=limits.pids,
            memory_limit=limits.memory_bytes, cgroups_path=f"/envbuild/{sandbox_id}",
            binds=tuple(binds))
        write_bundle(paths.bundle, runtime_spec(request))
        Path(runtime.state_root).mkdir(parents=True, exist_ok=True)
        # A detached container inherits runc's stdio: a pipe would never reach EOF while the
        # sandbox lives, so runc's (and the agent's) messages go to a file.
        start_log = paths.root / "start.log"
        pid_file = paths.root / "init.pid"
        with open(start_log, "wb") as log:
            proc = subprocess.run(runtime.command("run", "--detach", "--pid-file", str(pid_file),
                                                  "--bundle", str(paths.bundle), sandbox_id),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=log, check=False)
        if proc.returncode != 0:
            destroy(runtime, sandbox_id)
            raise RuntimeShimError(f"start sandbox {sandbox_id}: {runtime.name} exited "
                                   f"{proc.returncode}",
                                   context=start_log.read_text(errors="replace").strip()[-2000:])
        self.init_pid = _init_pid(runtime, sandbox_id, pid_file)
        # Held for the sandbox's life: connections resolve the socket relative to it.
        self._run_fd = os.open(paths.run, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._wait_for_agent(start_log)
        except BaseException:
            self.close()
            raise

    def _wait_for_agent(self, start_log: Path) -> None:
        """The agent binds its socket under a temporary name and renames it into place, so
        the name appearing means it accepts connections."""
        deadline = time.monotonic() + AGENT_READY_TIMEOUT
        delay = 0.0002
        while True:
            try:
                os.stat("agent.sock", dir_fd=self._run_fd, follow_symlinks=False)
                return
            except FileNotFoundError:
                pass
            if not os.path.exists(f"/proc/{self.init_pid}") or time.monotonic() > deadline:
                why = "exited" if not os.path.exists(f"/proc/{self.init_pid}") else \
                    f"did not listen within {AGENT_READY_TIMEOUT:.0f} s"
                raise RuntimeShimError(
                    f"start sandbox {self.id}: the exec agent {why}",
                    context=start_log.read_text(errors="replace").strip()[-2000:] or None,
                    hint="see start.log in the sandbox directory")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def exec(self, argv, *, env, cwd, user, timeout, stdin) -> ExecResult:
        started = time.monotonic()
        uid, gid = parse_user(user)  # numeric only: the agent reads no /etc/passwd for names
        req = agent.ExecRequest(argv=tuple(argv), env=env, cwd=cwd, user=f"{uid}:{gid}",
                                timeout=timeout, stdin=stdin)
        done = agent.run(lambda: agent.connect_agent(self._run_fd), req,
                         self.limits.output_bytes)
        return ExecResult(exit_code=done.exit_code, stdout=done.stdout, stderr=done.stderr,
                          duration=time.monotonic() - started, timed_out=done.timed_out,
                          output_truncated=done.output_truncated)

    # Files are reached through the init process's root, i.e. in the sandbox's own mount
    # namespace: its tmpfs /tmp and bind mounts included, exactly what commands see.
    def read_file(self, path: str) -> bytes:
        return fsaccess.read_file(f"/proc/{self.init_pid}/root", path)

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        uid, gid = parse_user(self.lock.user)
        fsaccess.write_file(f"/proc/{self.init_pid}/root", path, data, mode=mode, uid=uid,
                            gid=gid)

    def close(self) -> None:
        if self._run_fd >= 0:
            os.close(self._run_fd)
            self._run_fd = -1
        kill_and_delete(self.runtime, self.id, self.init_pid)

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
        self._run_fd = os.open(paths.run, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
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
                    self._backend.upper_dir(), out, policy or packdiff.SnapshotPolicy(),
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
        network: bool = False,
        limits: Limits | None = None,
        runtime: str = "runc",
        keep: bool = False,
        lazy: bool = False,
    ) -> Sandbox:
        """Fetch what is missing, compose and start a sandbox of ``lock`` (digest or ref).

        ``lazy``: instead of unpacking the layers, mount each one read-only with FUSE, served
        from ``store`` file by file on first read (``runtime_shim.lazyfs``); ``store`` must be
        one another process can open (a directory or S3)."""
        if backend not in BACKENDS:
            raise RuntimeShimError(f"unknown sandbox backend {backend!r}",
                                   hint=f"choose one of: {', '.join(BACKENDS)}")
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
        for p in (paths.upper, paths.work, paths.merged):
            p.mkdir(parents=True)
        _write_meta(paths, {"version": SANDBOX_META_VERSION, "id": sandbox_id,
                            "lock": resolved.digest, "backend": backend, "pid": os.getpid(),
                            "kept": keep, "created": time.time(),
                            "layers": [layer.digest for layer in resolved.layers]})
        if backend == "microvm":  # --- microVM backend switch: the guest composes the layers
            from runtime_shim.vm.backend import MicroVmBackend

            try:
                impl = MicroVmBackend(sandbox_id, paths.root, resolved, node, layer_dirs,
                                      network=network, limits=limits or Limits())
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
            impl = ContainerBackend(sandbox_id, paths, resolved, oci, network=network,
                                    limits=limits or Limits(), agent_path=agent_path)
        except BaseException:
            if mounted:
                unmount(str(paths.merged))
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
    for target in mounted_targets_under(str(paths.root)):
        unmount(target)
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
