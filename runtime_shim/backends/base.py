"""The backend layer: what a sandbox backend implements, and the one registry of them.

``Sandbox`` (``runtime_shim.sdk.sandbox``) does what every backend shares: resolve the lock, fetch
the layers, allocate the id and dir, record ``sandbox.json``, TTLs, exec argument handling and
pack-diff. A backend does the rest, behind three runtime-checkable protocols:

- ``Backend``: ``check`` (the library's rules for a request, e.g. no ``keep`` for a microVM),
  ``create`` / ``attach`` (→ a handle), ``list`` and ``remove`` (by id, whoever created it);
- ``SandboxHandle``: one running sandbox: ``connect`` (a fresh connection to its exec agent),
  ``exec``, ``read_file``, ``write_file``, ``close``;
- ``MemoryReporting``: optional, ``memory()`` for ``info().memory`` (RSS, shared, reclaimed);
- ``Metered``: optional, ``usage()`` for ``Sandbox.usage()`` (CPU time, memory, pids, disk);
- ``HostCosted``: optional, a backend's own ``host_reservation(limits)`` for node admission
  (``runtime_shim.node.admission``) where a container's worst case is not what it takes;
- ``FileStreams``: optional, files read and written in pieces (``Sandbox.read_stream`` /
  ``write_stream``; without it those hold the whole file in memory).
- ``Snapshottable``: optional, for pack-diff: ``quiesce`` (a context manager in which the
  sandbox's writes are stopped) and ``upper_dir`` (its changes, readable inside it).
- ``Checkpointable`` (a handle) and ``Restorable`` (a backend): optional, for checkpoints with
  memory (``Sandbox.checkpoint`` / ``Sandbox.restore`` / ``Sandbox.fork``): ``checkpoint``
  writes a ``CheckpointImage`` into a dir, ``restore`` starts a sandbox from one. Separate
  from ``Snapshottable`` so a backend that can pack-diff but not dump memory stays one.

Backends are registered by name (``register``) and looked up with ``get_backend``; the built-in
ones (``container``: ``runtime_shim.backends.container``, ``microvm``: ``runtime_shim.backends.vm.backend``,
``fncall``: ``runtime_shim.backends.fncall``, stateless calls on warm containers) are
imported on first use, so a container user never imports the VM code. Tests register a
``runtime_shim.backends.fake.FakeBackend``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from envbuild.errors import BackendUnavailable, RuntimeShimError
from envbuild.safefs import remove_tree
from runtime_shim.isolation import agent, netns
from runtime_shim.isolation.mount import mounted_targets_under, unmount
from runtime_shim.node import diskpool
from runtime_shim.node.layout import NodeLayout, SandboxPaths
from runtime_shim.node.model import Limits, MemoryInfo, SandboxUsage

if TYPE_CHECKING:
    from runtime_shim.isolation.fsaccess import FileWriter
    from runtime_shim.isolation.watch import DirWatch
    from runtime_shim.node.admission import Reservation
    from runtime_shim.node.locks import ResolvedLock
    from runtime_shim.node.nodecache import NodeCache


@dataclasses.dataclass(frozen=True)
class CreateRequest:
    """Everything a backend needs to start one sandbox (the SDK has made ``paths.root``,
    resolved the lock and fetched its layers into ``layer_dirs``, bottom first)."""

    id: str
    paths: SandboxPaths
    layout: NodeLayout
    lock: ResolvedLock
    layer_dirs: tuple[str, ...]
    node: NodeCache
    network: netns.NetworkPolicy | None
    limits: Limits
    runtime: str = "runc"  # the OCI runtime (container backend)
    keep: bool = False
    seccomp: str | Mapping[str, Any] | None = None
    checkpointable: bool = False  # Checkpointable.checkpoint will be asked of it
    # The processes come from this checkpoint image instead of a fresh start (containerd's
    # CreateOpts.Checkpoint): the SDK calls ``Restorable.restore`` instead of ``create``.
    restore: CheckpointImage | None = None


@runtime_checkable
class SandboxHandle(Protocol):
    """One running sandbox of a backend."""

    id: str
    limits: Limits

    def connect(self) -> socket.socket:
        """A new connection to the sandbox's exec agent (``runtime_shim.isolation.agent``)."""
        ...

    def exec(self, req: agent.ExecRequest, *, on_stdout: agent.OutputCallback | None = None,
             on_stderr: agent.OutputCallback | None = None) -> agent.ExecOutcome: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes, mode: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Describable(Protocol):
    """A handle with backend-specific facts for ``Sandbox.info()`` (a microVM's
    ``layer_transport``): a JSON-able mapping, recorded in ``sandbox.json`` once it started."""

    def describe(self) -> Mapping[str, object]: ...


@runtime_checkable
class Snapshottable(Protocol):
    """A handle whose changes pack-diff can read (``Sandbox.pack_diff``)."""

    def quiesce(self) -> contextlib.AbstractContextManager[None]: ...

    def upper_dir(self) -> Path: ...


@dataclasses.dataclass(frozen=True)
class CheckpointImage:
    """A backend's memory image of one sandbox: the files in ``dir`` plus ``record``.

    ``kind`` names the format and so the backend that restores it (``"criu"``: a container,
    ``runtime_shim.backends.criu``; ``"qemu"``: a microVM). ``record`` is what the backend saw when it
    dumped (JSON-able: e.g. the process tree and mounts, each image file's sha256 and size):
    the SDK stores it beside the image, and ``Restorable.restore`` checks the image it is given
    against it, never trusting what the image says about itself. ``bytes`` is the size of the
    image's files, ``seconds`` how long the dump took."""

    kind: str
    dir: Path
    record: Mapping[str, object]
    bytes: int = 0
    seconds: float = 0.0


@runtime_checkable
class Checkpointable(Protocol):
    """A handle whose processes can be dumped with their memory (``Sandbox.checkpoint``)."""

    def checkpoint(self, dest_dir: Path, *, leave_running: bool) -> CheckpointImage:
        """Dump every process of the sandbox (memory, open files, cwd) into ``dest_dir`` (an
        empty dir on the host, outside every mount of the sandbox).

        Called inside ``Snapshottable.quiesce()``: the sandbox is already stopped; the SDK
        packs ``upper_dir()`` after this returns, still inside ``quiesce``, so files and memory
        are one moment. ``leave_running=False``: the sandbox's processes are gone on return
        (its upper dir stays readable until ``close``); ``True``: they run on after
        ``quiesce`` ends. What cannot be dumped raises ``CheckpointRefused`` naming the
        process and the reason; the sandbox then runs on as before."""
        ...


@runtime_checkable
class Restorable(Protocol):
    """A backend that starts a sandbox from a ``CheckpointImage`` (``Sandbox.restore``)."""

    def restore(self, req: CreateRequest, image: CheckpointImage) -> SandboxHandle:
        """Like ``Backend.create`` (same ``req``: its ``layer_dirs`` end with the checkpoint's
        snapshot layer, so the restored files are those of the dump), but the processes come
        from ``image`` instead of a fresh start. ``image.dir`` is untrusted (it came from a
        store): refuse, before any process runs, an image that does not match
        ``image.record`` (``CheckpointRefused``); the isolation is that of a fresh sandbox of
        ``req`` (network, capabilities, seccomp, limits). On failure, undo what was made under
        ``req.paths.root`` as ``create`` does."""
        ...

    def restored_limits(self, image: CheckpointImage) -> Limits | None:
        """The limits a restore of ``image`` gets when the caller names none (a microVM's
        RAM is part of its image), or None for the defaults."""
        ...


@runtime_checkable
class StatelessCalls(Protocol):
    """A handle that serves stateless calls (``Sandbox.call``; the fncall backend): each in a
    fresh writable layer, ``reset`` between them. Its ``exec`` is such a call too, so it keeps
    no process between execs: the SDK refuses ``start`` on it and runs the async ``exec``
    through the handle's own (blocking) ``exec``."""

    def call(self, req: agent.ExecRequest, files: Mapping[str, bytes | str] | None = None
             ) -> agent.ExecOutcome:
        """``files`` (sandbox path → content) written into a fresh layer, then ``req`` run."""
        ...

    def reset(self) -> None:
        """Make the sandbox as it was before any call."""
        ...


@runtime_checkable
class HostCosted(Protocol):
    """A backend whose sandboxes take something else of the host's shared tables than a
    container's worst case (``runtime_shim.node.admission.reservation``, what a backend without
    this method is charged): a microVM (its processes live in its guest), a test's fake
    (nothing)."""

    def host_reservation(self, limits: Limits) -> Reservation:
        """What one sandbox of ``limits`` may take, at worst, of the host's tables and disk
        (``AdmissionRefused`` for limits that leave one unbounded)."""
        ...


@runtime_checkable
class Watchable(Protocol):
    """A handle whose directories can be watched from the host (``Sandbox.watch``)."""

    def watch(self, path: str, *, recursive: bool) -> DirWatch:
        """Inotify watches on ``path`` of the sandbox (``runtime_shim.isolation.watch``)."""
        ...


@runtime_checkable
class FileStreams(Protocol):
    """A handle whose files can be read and written in pieces, in bounded memory whatever
    their size (``Sandbox.read_stream`` / ``write_stream``; ``runtime_shim.isolation.fsaccess``
    says how paths are resolved and how a write is published whole)."""

    def open_read(self, path: str) -> int:
        """A read-only fd of regular file ``path`` (the caller closes it)."""
        ...

    def open_write(self, path: str, mode: int, uid: int, gid: int, hold: int = 0
                   ) -> FileWriter:
        """A writer of a new ``path`` owned by ``uid:gid`` with ``mode``, published at its
        ``commit`` (an existing file's new bytes held in memory up to ``hold``)."""
        ...


@runtime_checkable
class HostProcess(Protocol):
    """A handle whose sandbox is one process tree on this host (``Sandbox.host_pid``)."""

    @property
    def host_pid(self) -> int | None:
        """The host pid of the sandbox's first process (a container's init, a microVM's
        QEMU), None once it is gone."""
        ...


@runtime_checkable
class MemoryReporting(Protocol):
    """A handle that says what it holds of the host's memory (``Sandbox.info().memory``)."""

    def memory(self) -> MemoryInfo | None: ...


@runtime_checkable
class Metered(Protocol):
    """A handle that says what it uses now: CPU time, memory, processes, disk
    (``Sandbox.usage()``, ``runtime_shim.node.usage``); None once it stopped."""

    def usage(self) -> SandboxUsage | None: ...


@runtime_checkable
class Backend(Protocol):
    """A kind of sandbox (``container``, ``microvm``, a test's fake)."""

    name: str

    def check(self, *, keep: bool, seccomp: str | Mapping[str, Any] | None, lazy: bool) -> None:
        """Refuse, before anything is made, a request this backend cannot honour."""
        ...

    def create(self, req: CreateRequest) -> SandboxHandle:
        """Start the sandbox; on failure, undo what was made under ``req.paths.root``
        (the SDK removes the dir itself)."""
        ...

    def attach(self, paths: SandboxPaths, layout: NodeLayout, lock: ResolvedLock,
               runtime: str) -> SandboxHandle:
        """The handle of a running sandbox another process created, or ``SandboxNotFound`` /
        ``BackendUnavailable`` saying why not."""
        ...

    def remove(self, layout: NodeLayout, sandbox_id: str, runtime: str) -> None:
        """Stop and delete one sandbox, whoever created it."""
        ...


_FACTORIES: dict[str, Callable[[], Backend]] = {}
_INSTANCES: dict[str, Backend] = {}
#: The built-in backends, imported on first use ("module:attribute").
_BUILTIN = {"container": "runtime_shim.backends.container:ContainerBackend",
            "microvm": "runtime_shim.backends.vm.backend:MicroVmBackend",
            "fncall": "runtime_shim.backends.fncall:FnCallBackend"}


def register(name: str, factory: Callable[[], Backend]) -> None:
    """Make ``name`` a backend (``Sandbox.create(backend=name)``); replaces an earlier one."""
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)


def unregister(name: str) -> None:
    _FACTORIES.pop(name, None)
    _INSTANCES.pop(name, None)


def backend_names() -> tuple[str, ...]:
    return tuple(sorted({*_BUILTIN, *_FACTORIES}))


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``, or ``BackendUnavailable``."""
    if name in _INSTANCES:
        return _INSTANCES[name]
    factory = _FACTORIES.get(name)
    if factory is None and name in _BUILTIN:
        module, attr = _BUILTIN[name].split(":")
        factory = getattr(importlib.import_module(module), attr)
    if factory is None:
        raise BackendUnavailable(f"unknown sandbox backend {name!r}",
                                 hint=f"choose one of: {', '.join(backend_names())}")
    instance = factory()
    if not isinstance(instance, Backend):
        raise BackendUnavailable(f"sandbox backend {name!r} does not implement Backend")
    _INSTANCES[name] = instance
    return instance


def remove_sandbox_dir(paths: SandboxPaths) -> None:
    """Unmount everything below a sandbox's dir, then delete it: iteratively and fd-based
    (``safefs.remove_tree``: any depth, symlinks never followed, no mount crossed), so a tree
    the sandbox made 4,096 levels deep goes like a flat one. What cannot be removed raises
    ``RuntimeShimError`` naming the cause (the dir stays for ``envbuild sandbox gc``)."""
    netns.teardown(paths.root)  # slirp4netns and the namespace file of a networked sandbox
    for target in mounted_targets_under(str(paths.root)):
        unmount(target)
    diskpool.destroy_disk(paths)  # its subvolume, or its loop disk (unmounted above)
    try:
        remove_tree(paths.root)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        raise RuntimeShimError(f"remove sandbox dir {paths.root}: {e.strerror}{where}",
                               hint="fix the cause (e.g. `lsattr`, `findmnt -R`), then run "
                               "`envbuild sandbox gc`") from None


@contextlib.contextmanager
def undo_on_error(paths: SandboxPaths) -> Iterator[None]:
    """Remove the sandbox's dir if the block fails; the block's error is the one raised."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError, RuntimeShimError):
            remove_sandbox_dir(paths)
        raise
