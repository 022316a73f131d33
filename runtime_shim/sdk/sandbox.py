"""The sandbox SDK: ``Sandbox.create(lock) → exec / read_file / write_file → close``.

One class for every backend; ``backend=`` names one in the registry
(``runtime_shim.backends.base``: ``"container"``, ``runtime_shim.backends.container``, the
default; ``"microvm"``, ``runtime_shim.backends.vm``; ``"fncall"``).
What every backend shares lives here: opening the store (a ``Store``, a directory or an
``s3://`` URL), the node dir (``runtime_shim.node.layout``; by default the CLI's), resolving the lock
before anything is made on disk, fetching its layers into the node cache, the sandbox's id, dir
and record (``sandbox.json``), TTLs and their reaper, argument handling of ``exec`` and pack-diff.

Lifecycle: ``create(ttl=seconds)`` records an expiry; a sandbox past it is removed by the
reaper thread of the process that created it, by the next ``create`` on the node (which also
removes sandboxes whose creating process died), and by ``envbuild sandbox gc``. A sandbox its
process never closed (not ``keep``) is closed at that process's exit (``runtime_shim.isolation.lifecycle``;
``close`` is safe from ``__del__`` then), or, if it died without running its exit hooks
(SIGKILL), removed by its watcher process (``runtime_shim.sdk.exitwatch``). ``info()`` is
its ``SandboxInfo``; ``attach(id)`` gives another process's running container sandbox;
``list_sandboxes()`` lists a node's.

Everything a sandbox owns is under its directory (``NodeLayout.sandbox(id)``) and, for a
container, its runtime state under the node's runc root, both named by the sandbox id
(``eb-…``), so ``sweep_sandboxes`` can find and remove the leftovers of a crashed process.

``AsyncSandbox`` (``runtime_shim.sdk.aio``) is the same sandbox for asyncio programs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from envbuild.errors import (
    BackendUnavailable,
    RuntimeShimError,
    SandboxClosed,
    SandboxNotFound,
)
from envbuild.store import Store
from runtime_shim.backends.base import (
    CreateRequest,
    Describable,
    HostProcess,
    MemoryReporting,
    Metered,
    SandboxHandle,
    Snapshottable,
    StatelessCalls,
    Watchable,
    get_backend,
    remove_sandbox_dir,
    undo_on_error,
)
from runtime_shim.isolation import agent, lifecycle
from runtime_shim.isolation.agent_session import Session, open_session
from runtime_shim.isolation.spec import parse_user
from runtime_shim.node import admission, ledger, owners
from runtime_shim.node.layout import NodeLayout, SandboxPaths
from runtime_shim.node.locks import ResolvedLock, resolve
from runtime_shim.node.model import (
    DEFAULT_OUTPUT_CAP,
    ExecResult,
    Limits,
    SandboxInfo,
    SandboxUsage,
    check_timed_out,
)
from runtime_shim.node.nodecache import NodeCache
from runtime_shim.node.records import (
    SANDBOX_META_VERSION,
    StoreLike,
    layers_in_use,
    list_sandboxes,
    node_layout,
    open_store,
    read_record,
    released_on_error,
    sandbox_info,
    set_sandbox_network,
    store_url,
    write_record,
)
from runtime_shim.sdk import exitwatch, filestream, ports
from runtime_shim.sdk.layerdirs import layer_dirs
from runtime_shim.sdk.options import CreatePlan, SandboxOptions, plan_create
from runtime_shim.sdk.process import Process
from runtime_shim.sdk.sweep import SandboxRemoval, gc_sandboxes, remove_sandbox, sweep_sandboxes

if TYPE_CHECKING:
    from runtime_shim.isolation.watch import DirWatch
    from runtime_shim.node.packdiff import SnapshotPolicy, SnapshotResult
    from runtime_shim.sdk.checkpoint import CheckpointResult

_log = logging.getLogger("envbuild.sandbox")

# The node's records and sweeps are re-exported: this module is where the SDK's callers look.
__all__ = ["DEFAULT_OUTPUT_CAP", "SANDBOX_META_VERSION", "ExecResult", "Limits", "Sandbox",
           "SandboxInfo", "SandboxPaths", "SandboxRemoval", "StoreLike", "gc_sandboxes",
           "layers_in_use", "list_sandboxes", "open_store", "remove_sandbox",
           "remove_sandbox_dir", "set_sandbox_network", "sweep_sandboxes"]

#: Snapshot layers a lock may end in before pack-diff squashes them into one.
DEFAULT_MAX_CHAIN = 8

class Sandbox:
    """A running, isolated, disposable instance of a lock. Use as a context manager."""

    def __init__(self, sandbox_id: str, lock: ResolvedLock, paths: SandboxPaths,
                 backend: SandboxHandle, layout: NodeLayout, store: Store | None = None, *,
                 backend_name: str = "container") -> None:
        self.id = sandbox_id
        self.lock = lock
        self.paths = paths
        self.backend = backend_name
        self._backend = backend
        self._layout = layout
        self._store = store
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def attach(cls, sandbox_id: str, *, store: StoreLike | None = None,
               node_dir: str | os.PathLike[str] | NodeLayout | None = None,
               runtime: str = "runc") -> Sandbox:
        """A running sandbox created by another process (e.g. ``envbuild run --keep``):
        ``SandboxNotFound`` if there is none by that id, ``BackendUnavailable`` for a microVM
        (it lives only as long as its creator). Closing it removes it, as for one this process
        created. ``store`` (needed for pack-diff) defaults to the store it was created from."""
        layout = node_layout(node_dir)
        paths = layout.sandbox(sandbox_id)
        meta = read_record(paths)
        if meta is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id} on this host",
                                  hint="envbuild sandbox ls lists them")
        name = meta.get("backend", "container")
        impl = get_backend(name)
        if store is None:
            if not meta.get("store"):
                raise RuntimeShimError(f"sandbox {sandbox_id} records no store",
                                       hint="pass store=")
            store = meta["store"]
        opened = open_store(store)
        lock = resolve(opened, meta["lock"])
        handle = impl.attach(paths, layout, lock, runtime)
        sb = cls(sandbox_id, lock, paths, handle, layout, opened, backend_name=name)
        if meta.get("expires"):
            _REAPER.watch(sb, float(meta["expires"]))
        return sb

    def pack_diff(self, publish: str | None = None, *, policy: SnapshotPolicy | None = None,
                  max_chain: int | None = DEFAULT_MAX_CHAIN,
                  source_date_epoch: int = 0) -> SnapshotResult:
        """Snapshot this sandbox: its changes become a layer (hostile-content policy applied,
        ``runtime_shim.node.packdiff``), stored with a derived lock = this lock + that layer,
        published under ``publish`` (e.g. ``snap/NAME``) if given. Processes are paused while
        the upper dir is read. When the lock would end in more than ``max_chain`` snapshot
        layers, they are squashed into one. Returns a ``SnapshotResult``."""
        from runtime_shim.sdk import snapshot

        self._check_open()
        if self._store is None:
            raise RuntimeShimError("pack_diff needs the store the sandbox was created from")
        if not isinstance(self._backend, Snapshottable):
            raise BackendUnavailable(f"pack-diff is not supported by the {self.backend} backend")
        return snapshot.take(self._backend, sandbox_id=self.id, lock=self.lock, paths=self.paths,
                             limits=self._backend.limits, store=self._store, publish=publish, policy=policy,
                             max_chain=max_chain, source_date_epoch=source_date_epoch)

    def watch(self, path: str, *, recursive: bool = False) -> DirWatch:
        """Watch directory ``path`` (``recursive``: its subtree): ``isolation.watch``."""
        self._check_open()
        if not isinstance(self._backend, Watchable):
            raise BackendUnavailable(f"watch is not supported by the {self.backend} backend")
        return self._backend.watch(path, recursive=recursive)

    def set_network(self, network: bool | Sequence[str]) -> None:
        """Change what this running sandbox may reach: ``network`` as for ``create``
        (``True`` or ``["public", ...]``: the public internet, less its ``"!CIDR"`` entries; a
        list of ``CIDR[:PORT]``: those too, private ones included; ``[]``: DNS only), or
        ``False``: nothing, not even DNS.
        Every packet sent after this returns obeys the new rules: new connections, and
        connections opened earlier to a destination now refused fail. Only a sandbox created
        with network (``network=[]`` is enough) has a namespace to change; one without raises
        ``RuntimeShimError`` (``runtime_shim.isolation.netns.update``)."""
        self._check_open()
        set_sandbox_network(self._layout, self.id, network)

    def checkpoint(self, publish: str | None = None, *,
                   leave_running: bool = False) -> CheckpointResult:
        """Freeze this sandbox and save its processes (memory, open files, cwd) and its
        files as one checkpoint lock in the store, published as ``publish`` (e.g.
        ``ckpt/NAME``) if given (``runtime_shim.sdk.checkpoint``). ``leave_running=False`` closes
        the sandbox afterwards. What cannot be dumped raises ``CheckpointRefused`` naming the
        process and the reason (the sandbox runs on). Returns a ``CheckpointResult`` (lock,
        blobs, sizes, times)."""
        from runtime_shim.sdk import checkpoint

        self._check_open()
        if self._store is None:
            raise RuntimeShimError("checkpoint needs the store the sandbox was created from")
        made = checkpoint.take(self._backend, sandbox_id=self.id, backend=self.backend,
                               lock=self.lock, paths=self.paths, store=self._store,
                               publish=publish, leave_running=leave_running)
        if not leave_running:
            self.close()
        return made

    @classmethod
    def restore(cls, checkpoint: str, *, store: StoreLike | None = None,
                node_dir: str | os.PathLike[str] | NodeLayout | None = None,
                network: bool | Sequence[str] = False, limits: Limits | None = None,
                runtime: str = "runc", ttl: float | None = None, keep: bool = False) -> Sandbox:
        """A new sandbox whose processes continue from ``checkpoint`` (a ref such as
        ``ckpt/NAME`` or a lock digest made by ``checkpoint``), on this node or another, with
        the isolation of a fresh sandbox (``network``, ``limits``, ``keep`` as for ``create``). An image
        that does not match envbuild's record of it is refused (``CheckpointRefused``) and
        nothing is left."""
        from runtime_shim.sdk import checkpoint as checkpoints

        opened = open_store(store)
        lock = resolve(opened, checkpoint)
        record = checkpoints.read_record(opened, lock)
        layout = node_layout(node_dir).ensure()
        with checkpoints.unpacked_image(opened, lock, record, layout) as image:
            return cls.create(lock.digest, store=opened, node_dir=layout,
                              backend=str(record.get("backend", "container")),
                              network=network, limits=limits, runtime=runtime, ttl=ttl,
                              keep=keep, restore=image)

    def fork(self, n: int, *, network: bool | Sequence[str] = False,
             limits: Limits | None = None) -> list[Sandbox]:
        """``n`` new sandboxes that continue from this one's current processes and files
        (checkpoint with ``leave_running=True``, then ``n`` restores on this node); this
        sandbox runs on. If one restore fails, the others are closed and the error raised."""
        if n < 1:
            raise RuntimeShimError(f"fork needs n >= 1, not {n!r}")
        made = self.checkpoint(None, leave_running=True)
        children: list[Sandbox] = []
        try:
            for _ in range(n):
                children.append(Sandbox.restore(made.lock, store=self._store,
                                                node_dir=self._layout, network=network,
                                                limits=limits or self._backend.limits))
        except BaseException:
            for child in children:
                with contextlib.suppress(Exception):
                    child.close()
            raise
        return children

    @classmethod
    def create(cls, lock: str, options: SandboxOptions | None = None, /, *,
               store: StoreLike | None = None,
               node_dir: str | os.PathLike[str] | NodeLayout | None = None,
               **fields: Any) -> Sandbox:
        """Fetch what is missing, compose and start a sandbox of ``lock`` (digest or ref) as
        ``options`` say (``SandboxOptions``, or its fields as keyword arguments:
        ``backend=``, ``network=``, ``limits=``, ``ttl=``, ``lazy=`` …).

        ``store``: a ``Store``, a directory path or an ``s3://BUCKET/PREFIX`` URL (default: the
        CLI's, ``$ENVBUILD_STORE``, else the ``cache`` dir). ``node_dir``: this host's node
        cache, by default the CLI's (``$ENVBUILD_NODE_CACHE``, else
        ``envbuild.settings.default_node_dir``). The options are checked and the lock resolved
        before anything is created on disk: a wrong ref raises ``LockNotFound`` and leaves
        nothing behind.

        Errors: ``LockNotFound``, ``StoreUnavailable`` (no store at that path),
        ``BackendUnavailable`` (unknown backend, a request it cannot honour, its runtime
        missing), ``AdmissionRefused``, ``SandboxStartError``, else ``RuntimeShimError``."""
        opts = SandboxOptions.of(options, fields)
        plan = plan_create(opts)
        opened = open_store(store)
        layout = node_layout(node_dir)
        resolved = resolve(opened, lock)  # before anything exists on disk
        layout.ensure()
        if opts.reap and owners.sweep_needed(layout, time.time()):  # O(creators), not O(sandboxes)
            sweep_sandboxes(layout, opts.runtime, automatic=True)
        node = NodeCache(layout.node)
        lower, lazy_mode = layer_dirs(node, opened, resolved, plan.lazy, plan.lazy_note)
        record = {"lock": resolved.digest, "backend": opts.backend, "kept": opts.keep,
                  "layers": [layer.digest for layer in resolved.layers],
                  "store": store_url(store if store is not None else opened), "ttl": opts.ttl,
                  "lazy": lazy_mode, "runtime": opts.runtime}
        handle, paths, expires = _start(layout, node, resolved, lower, opts, plan, record)
        sb = cls(paths.id, resolved, paths, handle, layout, opened, backend_name=opts.backend)
        if not opts.keep:
            lifecycle.track(sb)  # closed at this process's exit if nobody closes it
        if opts.ttl:
            _REAPER.watch(sb, expires)
        return sb

    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             user: str | None = None, stdin: bytes | None = None,
             on_stdout: agent.OutputCallback | None = None,
             on_stderr: agent.OutputCallback | None = None,
             check_timeout: bool = False) -> ExecResult:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``) and wait for it.

        ``on_stdout`` / ``on_stderr`` are called with each chunk of output as it arrives (in
        the calling thread, in the order the sandbox wrote it); the result still carries all
        of it (up to ``Limits.output_bytes``). A command past its ``timeout`` is killed and its
        result says ``timed_out``; with ``check_timeout=True`` that raises ``ExecTimeout``
        (carrying the result) instead."""
        req = self._request(cmd, timeout=timeout, env=env, cwd=cwd, user=user, stdin=stdin)
        started = time.monotonic()
        done = self._backend.exec(req, on_stdout=on_stdout, on_stderr=on_stderr)
        return self._result(done, started, check_timeout)

    def start(self, cmd: str | Sequence[str], *, timeout: float | None = None,
              env: Mapping[str, str] | None = None, cwd: str | None = None,
              user: str | None = None, stdin: bytes | None = None,
              on_stdout: agent.OutputCallback | None = None,
              on_stderr: agent.OutputCallback | None = None,
              pty: tuple[int, int] | None = None, detachable: bool = False) -> Process:
        """Start ``cmd`` and return at once: a ``Process`` (``runtime_shim.sdk.process``) whose
        stdin stays open (``stdin`` is written first), which can be signalled and waited for;
        output callbacks run in its own thread. ``timeout`` as exec's. ``pty=(rows, cols)``
        runs it on a new terminal (its controlling tty; ``TERM`` defaults to xterm-256color):
        input goes to the terminal, its bytes come to ``on_stdout``, ``resize`` changes it.
        ``detachable=True``: ``Process.detach()`` may later leave it running without a
        connection (for a checkpoint), and ``reattach`` takes it up again."""
        session = self._open_session(cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                                     stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr,
                                     pty=pty, detachable=detachable)
        return Process(session, lambda done, started: self._result(done, started, False))

    def reattach(self, detach_id: int, *, on_stdout: agent.OutputCallback | None = None,
                 on_stderr: agent.OutputCallback | None = None,
                 pty: tuple[int, int] | None = None, timeout: float | None = None
                 ) -> Process:
        """The command ``Process.detach()`` returned ``detach_id`` for, taken up again (also
        in a sandbox restored from a checkpoint made meanwhile): what it printed while detached
        (up to 64 KiB; ``Process.dropped`` counts the rest), then its further output and
        end. ``pty``: its terminal's size, for a command started with one. ``timeout``: how
        long the host waits for it (its own timeout still runs in the agent); default
        ``Limits.exec_timeout``. ``RuntimeShimError`` for an id the agent does not keep."""
        req = agent.ExecRequest(argv=(), attach=detach_id, pty=pty, timeout=timeout)
        return Process(self._connect_session(req, on_stdout, on_stderr),
                       lambda done, started: self._result(done, started, False))

    def _open_session(self, cmd: str | Sequence[str], *, timeout: float | None,
                      env: Mapping[str, str] | None, cwd: str | None, user: str | None,
                      stdin: bytes | None, on_stdout: agent.OutputCallback | None,
                      on_stderr: agent.OutputCallback | None,
                      pty: tuple[int, int] | None = None, detachable: bool = False) -> Session:
        """The agent session of a started command (``start`` and ``AsyncSandbox.start``)."""
        if isinstance(self._backend, StatelessCalls):
            raise BackendUnavailable("start() needs a sandbox that keeps processes; the "
                                     f"{self.backend} backend runs each call in a fresh layer",
                                     hint="use call(), or another backend")
        if pty is not None:
            agent.winsize(*pty)  # checked here, in the caller's thread
            env = {"TERM": agent.DEFAULT_TERM, **(env or {})}
        req = dataclasses.replace(self._request(cmd, timeout=timeout, env=env, cwd=cwd,
                                                user=user, stdin=stdin), pty=pty,
                                  detachable=detachable)
        return self._connect_session(req, on_stdout, on_stderr)

    def _connect_session(self, req: agent.ExecRequest, on_stdout: agent.OutputCallback | None,
                         on_stderr: agent.OutputCallback | None) -> Session:
        self._check_open()
        handle = self._backend
        return open_session(handle.connect, req, handle.limits.output_bytes,
                            deadline=handle.limits.exec_timeout, on_stdout=on_stdout,
                            on_stderr=on_stderr)

    def call(self, argv: str | Sequence[str], *, stdin: bytes | str | None = None,
             files: Mapping[str, bytes | str] | None = None, timeout: float | None = None,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             user: str | None = None) -> ExecResult:
        """A stateless call (``backend="fncall"``, ``runtime_shim.backends.fncall``, or any
        backend whose handle is ``StatelessCalls``): ``files`` written, then ``argv`` run
        with ``stdin``, in a fresh writable layer; nothing of an earlier call is visible to it."""
        self._check_open()
        handle = self._backend
        if not isinstance(handle, StatelessCalls):
            raise BackendUnavailable(f"call() needs the fncall backend, not {self.backend}",
                                     hint="Sandbox.create(..., backend='fncall'), or use exec()")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        req = self._request(argv, timeout=timeout, env=env, cwd=cwd, user=user, stdin=data)
        started = time.monotonic()
        return self._result(handle.call(req, files), started, False)

    def _request(self, cmd: str | Sequence[str], *, timeout: float | None,
                 env: Mapping[str, str] | None, cwd: str | None, user: str | None,
                 stdin: bytes | None) -> agent.ExecRequest:
        """The agent request of one exec (shared by ``AsyncSandbox``)."""
        self._check_open()
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise RuntimeShimError("exec needs a command")
        uid, gid = parse_user(user or self.lock.user)  # numeric: the agent reads no passwd
        return agent.ExecRequest(argv=tuple(argv), env=dict(env or {}),
                                 cwd=cwd or self.lock.workdir, user=f"{uid}:{gid}",
                                 timeout=timeout, stdin=stdin)

    def _result(self, done: agent.ExecOutcome, started: float, check_timeout: bool
                ) -> ExecResult:
        result = ExecResult(exit_code=done.exit_code, stdout=done.stdout, stderr=done.stderr,
                            duration=time.monotonic() - started, timed_out=done.timed_out,
                            output_truncated=done.output_truncated)
        return check_timed_out(result, self.id) if check_timeout else result

    def read_file(self, path: str) -> bytes:
        self._check_open()
        return self._backend.read_file(path)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._check_open()
        self._backend.write_file(path, data.encode() if isinstance(data, str) else data, mode)

    read_stream, write_stream = filestream.read_stream, filestream.write_stream  # in pieces

    def connect_port(self, port: int, timeout: float = 10.0) -> socket.socket:
        """A TCP socket connected to ``port`` on ``127.0.0.1`` inside this sandbox (made in its
        network namespace, ``runtime_shim.sdk.ports``); ``PortRefused`` if nothing listens."""
        self._check_open()
        return ports.connect(self, port, timeout)

    @property
    def limits(self) -> Limits:
        """What this sandbox may use (its ``SandboxOptions.limits``, defaults filled in)."""
        return self._backend.limits

    @property
    def host_pid(self) -> int | None:
        """The host pid of the sandbox's first process (a container's init, a microVM's QEMU):
        for ``nsenter``, ``/proc/PID/root`` or cgroup checks; None where the backend has none."""
        return self._backend.host_pid if isinstance(self._backend, HostProcess) else None

    @property
    def handle(self) -> SandboxHandle:
        """The backend's handle of this sandbox (``runtime_shim.backends.base``): for what only
        one backend does (a microVM's ``checkpoint(dir)``, a container's ``upper_dir()``).
        Its methods beyond the protocols are the backend's own, outside the SDK's promise."""
        return self._backend

    def info(self) -> SandboxInfo:
        """This sandbox as its record says (id, backend, lock digest, created/ready times,
        node dir, TTL and expiry; ``memory`` from a backend that reports it:
        ``runtime_shim.node.reclaim`` for containers)."""
        meta = read_record(self.paths)
        if meta is None:
            raise SandboxClosed(f"sandbox {self.id} is gone", hint="it was closed or reaped")
        info = sandbox_info(self.paths.root, meta, self._layout)
        if isinstance(self._backend, MemoryReporting) and not self._closed:
            info = dataclasses.replace(info, memory=self._backend.memory())
        return info

    def usage(self) -> SandboxUsage:
        """CPU time, memory, processes, disk now (``runtime_shim.node.usage``); refused for a
        backend that does not say (microVMs) or a sandbox whose processes are gone."""
        self._check_open()
        if not isinstance(self._backend, Metered):
            raise BackendUnavailable(f"usage is not reported by the {self.backend} backend")
        found = self._backend.usage()
        if found is None:
            raise SandboxClosed(f"sandbox {self.id} is not running (it has no cgroup)")
        return found

    def close(self) -> None:
        """Stop every process, unmount and remove the sandbox's files. Idempotent, and safe
        from another thread (the TTL reaper) and from ``__del__`` at interpreter exit
        (``runtime_shim.isolation.lifecycle``: no import, no new thread then)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        _REAPER.forget(self)
        lifecycle.untrack(self)
        try:
            self._backend.close()
        finally:
            remove_sandbox_dir(self.paths)
        try:
            ledger.Ledger(self._layout.node).release(admission.sandbox_key(self.id))
        except Exception as e:  # noqa: BLE001 - e.g. late at exit; the entry of a dir that
            _log.debug("release %s's admission: %s", self.id, e)  # is gone is dropped anyway

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosed(f"sandbox {self.id} is closed",
                                hint="create a new one (a sandbox past its ttl is closed)")

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.backend} lock={self.lock.digest[:19]}>"


def _start(layout: NodeLayout, node: NodeCache, lock: ResolvedLock, layer_dirs: list[str],
           opts: SandboxOptions, plan: CreatePlan, record: dict[str, Any]
           ) -> tuple[SandboxHandle, SandboxPaths, float]:
    """Make the sandbox's dir and record, reserve its share of the node, and have the backend
    start (or restore) it; on any failure, nothing of it is left. Returns its handle, paths
    and expiry (0: none)."""
    sandbox_id = f"eb-{uuid.uuid4().hex[:12]}"
    paths = layout.sandbox(sandbox_id)
    created = time.time()
    meta = {"version": SANDBOX_META_VERSION, "id": sandbox_id, "pid": os.getpid(),
            "pid_start": owners.process_start(os.getpid()),
            "created": created, "expires": created + opts.ttl if opts.ttl else 0.0,
            "ready": 0.0, **record}
    layout.sandboxes.mkdir(exist_ok=True)
    owners.register(layout, meta["expires"])  # before the record: the sweep index (owners)
    if not opts.keep:  # removed if this process dies without closing it (SIGKILL)
        exitwatch.watch(layout.root)
    paths.root.mkdir()
    book = ledger.Ledger(layout.node)
    with released_on_error(book, sandbox_id), undo_on_error(paths):
        write_record(paths, meta)  # first: a dir with a live creator is never swept
        # after the dir exists: an entry whose path is gone may be dropped by another
        book.admit(admission.sandbox_key(sandbox_id), plan.reservation, paths.root,
                     what=f"sandbox {sandbox_id}", settings=plan.budget)
        req = CreateRequest(
            id=sandbox_id, paths=paths, layout=layout, lock=lock, layer_dirs=tuple(layer_dirs),
            node=node, network=plan.network, limits=plan.limits, runtime=opts.runtime,
            keep=opts.keep, seccomp=opts.seccomp, restore=opts.restore,
            checkpointable=opts.checkpointable or opts.restore is not None)
        handle = plan.impl.create(req) if plan.restorer is None or opts.restore is None \
            else plan.restorer.restore(req, opts.restore)
        try:
            details = dict(handle.describe()) if isinstance(handle, Describable) else {}
            write_record(paths, {**meta, "ready": time.time(), "details": details})
        except BaseException:
            handle.close()
            raise
    return handle, paths, meta["expires"]


class _Reaper:
    """One daemon thread per process that closes this process's sandboxes at their expiry."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, weakref.ref[Sandbox]]] = []
        self._thread: threading.Thread | None = None

    def watch(self, sb: Sandbox, expires: float) -> None:
        with self._cond:
            heapq.heappush(self._heap, (expires, id(sb), weakref.ref(sb)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="envbuild-ttl-reaper",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def forget(self, sb: Sandbox) -> None:
        with self._cond:
            self._heap = [e for e in self._heap if e[2]() not in (sb, None)]
            heapq.heapify(self._heap)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.time():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.time())
                _, _, ref = heapq.heappop(self._heap)
            sb = ref()
            if sb is not None:
                with contextlib.suppress(Exception):  # a failed removal stays for gc
                    sb.close()


_REAPER = _Reaper()


