"""Where ``envbuild serve --fleet ADDRESS`` gets its sandboxes: ``FleetBackend``, sandboxes of
a Ray fleet (``runtime_shim.fleet``), so one server in front of the cluster places them with
the fleet's placement (free capacity, layer locality), the nodes' admission, and its warm
pools (``FleetBackend.warm``: a create that matches a warmed pool claims a ready sandbox).

**What a fleet sandbox serves** is what its handle (``FleetSandbox``) offers: ``exec`` (E2B's
``commands.run``, with its output streamed from the node; ``cwd``, ``envs``, ``user``,
background commands and ``Connect`` to them), ``read_file``/``write_file`` (``/files``) and
every filesystem call the server makes of ``exec`` (``Stat``, ``ListDir``, ``MakeDir``,
``Move``, ``Remove``). When the daemons have a data plane (``envbuild fleet start
--data-host``) exec and files go over it, and so do the streams (``runtime_shim.fleet.
streams``): commands are started with ``FleetSandbox.start`` (stdin, ``send_stdin``,
``commands.kill`` and other signals, PTYs with input and resize), ports are spliced to the
sandbox (``get_host``, the port proxy) and directory watches stream their events
(``watch_dir``). A started command lives as long as its stream, which the server holds in its
process table (so background commands and ``Connect`` work as on one node; killing the
sandbox or stopping the server ends them). Without a data plane exec and files go through
Ray, commands run as execs, and PTYs, stdin, signals, watches and ports are refused in one
line (``Unsupported``) naming ``--data-host``.

**Pause, snapshots and fork keep the files only** (the handle's ``pack_diff``, published to
the fleet's store, which every node reads): a pause publishes it under the same ref as
``NodeBackend``'s (``PAUSED_PREFIX + <e2b id>``) and closes the sandbox, and resume creates a
fleet sandbox of that lock (placed anew, on any node); a snapshot is published under
``FS_SNAPSHOT_PREFIX + NAME``; a fork makes one pack-diff and creates ``count`` sandboxes of
it. Their processes are not carried over: a pause or snapshot that asks for memory is refused
in one line, as a node without CRIU refuses a checkpoint. Network rules follow, as on a node.

**Leases and restarts.** A fleet sandbox lives while its lease does (``runtime_shim.fleet``'s
leases): the backend creates each with a lease of ``lease`` seconds and renews the leases of
the sandboxes it serves every ``lease / 10`` seconds, so the sandboxes of a server that
stopped are reaped by their nodes ``lease`` seconds later unless a server takes them back.
The server's record of a sandbox (``envbuild.serve.records``) holds its fleet id
(``SDK-ID@NODE``), by which a restarted server re-attaches it (``Fleet.attach``, which renews
the lease); a sandbox whose lease ran out or whose node was lost is forgotten then.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import io
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envbuild.errors import EnvbuildError, RuntimeShimError
from envbuild.serve.backend import FS_SNAPSHOT_PREFIX, PAUSED_PREFIX, closed_if, each_or_error, opened_network
from runtime_shim import ExecResult, Limits

_log = logging.getLogger(__name__)

#: Seconds a node keeps a sandbox of this server without a renewal.
LEASE = 600.0
#: The label of every sandbox the server makes (``envbuild fleet ls`` shows it).
LABEL = ("envbuild-serve", "1")


class Unsupported(RuntimeShimError):
    """A feature a fleet sandbox does not offer through ``envbuild serve --fleet``."""

    reference = "fleet-unsupported"


def _unsupported(what: str, *, stream: bool = False) -> Unsupported:
    if stream:  # what the nodes' data plane carries
        return Unsupported(f"{what} is not available for a fleet sandbox without the nodes' "
                           "data plane (envbuild serve --fleet)",
                           hint="start the fleet's daemons with --data-host ADDRESS")
    return Unsupported(f"{what} is not available for a fleet sandbox (envbuild serve --fleet)",
                       hint="use envbuild serve on the node itself for a pause, snapshot or "
                            "fork with memory")


def _files_only(memory: bool, what: str) -> None:
    """Refuse ``what`` with ``memory`` (as a node without CRIU refuses a checkpoint), in one
    line that says what to ask instead (E2B's answer carries only the message)."""
    if memory:
        raise Unsupported(f"{what} with memory is not available for a fleet sandbox (envbuild "
                          "serve --fleet keeps files only): ask for mode='filesystem'",
                          hint="E2B SDK: pause(mode='filesystem'), "
                               "create_snapshot(mode='filesystem')")


class FleetBackend:
    """Create and attach sandboxes of ``fleet`` (a ``runtime_shim.fleet.Fleet``), each with
    ``limits`` and a lease of ``lease`` seconds that the backend renews while it serves it.
    Its blocking fleet calls run on ``threads`` threads of its own (a running command holds
    one while its output streams)."""

    #: A pause or snapshot keeps the files only (the module docstring).
    keeps_memory = False

    def __init__(self, fleet: Any, *, limits: Limits | None = None, lease: float = LEASE,
                 threads: int = 64) -> None:
        self.fleet = fleet
        self.limits = limits
        self.lease = lease
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "serve-fleet")
        self._served: dict[str, FleetServed] = {}
        self._renewer: asyncio.Task[None] | None = None

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the backend's threads, awaited."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: fn(*args, **kwargs))

    def warm(self, template: str, per_node: int) -> str:
        """Keep ``per_node`` ready sandboxes of ``template`` (as this backend creates them) on
        every node; creates of it then claim one. The pool key."""
        return self.fleet.warm(template, per_node=per_node, limits=self.limits)

    async def create(self, template: str, network: bool | list[str] | None = None
                     ) -> FleetServed:
        """A fleet sandbox of ``template`` with ``network`` (as ``NodeBackend.create``)."""
        async def making() -> FleetServed:
            (handle,) = await self.run(self.fleet.create, template, n=1, limits=self.limits,
                                       ttl=self.lease, labels=dict([LABEL]),
                                       network=opened_network(network))
            return await self._serve(handle)

        return await closed_if(network, making())

    async def attach(self, sandbox_id: str) -> FleetServed:
        return await self._serve(await self.run(self.fleet.attach, sandbox_id, ttl=self.lease))

    async def _serve(self, handle: Any) -> FleetServed:
        try:
            lock = await self.run(self.fleet.resolve, handle.lock)
        except BaseException:
            await self.run(handle.close)
            raise
        served = FleetServed(self, handle, lock)
        self._served[handle.id] = served
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_all())
        return served

    async def _renew_all(self) -> None:
        """Renew every served sandbox's lease, every tenth of a lease, for ever."""
        while True:
            await asyncio.sleep(self.lease / 10)
            for sid, served in list(self._served.items()):
                try:
                    await self.run(served.handle.renew, self.lease)
                except EnvbuildError as e:  # gone with its node, or closed meanwhile
                    _log.warning("renew the lease of fleet sandbox %s: %s", sid, e)

    async def pause(self, sandbox: FleetServed, e2b_id: str, *, memory: bool) -> str:
        """Publish ``sandbox``'s files (its pack-diff) under its paused ref, as
        ``NodeBackend.pause`` does, and close it; the lock saved. ``memory`` is refused."""
        _files_only(memory, "a pause")
        made = await self.run(sandbox.handle.pack_diff, PAUSED_PREFIX + e2b_id)
        await sandbox.close()
        return str(made.lock)

    async def resume(self, lock: str, *, memory: bool, network: Any = None) -> FleetServed:
        """A fleet sandbox of ``lock`` (placed anew: the layers are in the fleet's store),
        with ``network`` as for ``create``; a paused fleet sandbox never kept its memory."""
        _files_only(memory, "a resume")
        return await self.create(lock, network)

    async def snapshot(self, sandbox: FleetServed, name: str, *, memory: bool) -> str:
        """Publish ``sandbox``'s files as the snapshot ``FS_SNAPSHOT_PREFIX + name``; its id.
        ``sandbox`` runs on; ``memory`` is refused."""
        _files_only(memory, "a snapshot")
        ref = FS_SNAPSHOT_PREFIX + name
        await self.run(sandbox.handle.pack_diff, ref)
        return ref

    async def fork(self, sandbox: FleetServed, count: int, network: Any = None
                   ) -> list[FleetServed | Exception]:
        """``count`` fleet sandboxes of ``sandbox``'s files (one pack-diff, not published; its
        processes are not carried over), each a sandbox or the error its create raised;
        ``network`` as for ``create``. ``sandbox`` runs on."""
        lock = str((await self.run(sandbox.handle.pack_diff, None)).lock)
        return await each_or_error(self.create(lock, network) for _ in range(count))

    def forget(self, e2b_id: str) -> None:
        """Drop the paused ref of ``e2b_id`` in the fleet's store (idempotent)."""
        self.store.delete_ref(PAUSED_PREFIX + e2b_id)

    @property
    def store(self) -> Any:
        """The fleet's store (``envbuild.serve.snapshots`` lists its snapshot refs)."""
        return self.fleet.store


class FleetServed:
    """One fleet sandbox as the server uses a runtime_shim ``AsyncSandbox``: ``id`` (its
    fleet id), ``lock`` (resolved), ``sync.limits``, and coroutines for exec, files, commands
    and close; the rest raise ``Unsupported`` (see the module docstring)."""

    def __init__(self, backend: FleetBackend, handle: Any, lock: Any) -> None:
        self.backend = backend
        self.handle = handle  # runtime_shim.fleet.FleetSandbox
        self.id: str = handle.id
        self.lock = lock
        self.limits = backend.limits or Limits()

    @property
    def sync(self) -> FleetServed:
        """Itself: the server reads ``sandbox.sync.limits`` as of an ``AsyncSandbox``."""
        return self

    async def exec(self, cmd: str | Sequence[str], **kwargs: Any) -> ExecResult:
        return await self.backend.run(self.handle.exec, cmd, **kwargs)

    async def read_file(self, path: str) -> bytes:
        return await self.backend.run(self.handle.read_file, path)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self.backend.run(self.handle.write_file, path, data, mode)

    async def read_stream(self, path: str) -> io.BytesIO:
        """``AsyncSandbox.read_stream`` for ``/files``: the whole file (a fleet sandbox's files
        travel whole)."""
        return io.BytesIO(await self.read_file(path))

    async def write_stream(self, path: str, mode: int = 0o644, user: str | None = None,
                           hold: int = 0) -> FleetWriter:
        return FleetWriter(self, path, mode, user)  # holds the whole file whatever ``hold``

    @property
    def streams(self) -> bool:
        """Whether the sandbox's node has a data plane (commands, ports and watches go over
        it; without one only commands without stdin, signals or a PTY run, through exec)."""
        return self.handle.record.data_addr is not None and bool(self.handle.record.token)

    async def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                    cwd: str | None = None, user: str | None = None,
                    timeout: float | None = None,
                    on_stdout: Callable[[bytes], None] | None = None,
                    on_stderr: Callable[[bytes], None] | None = None,
                    pty: tuple[int, int] | None = None) -> Any:
        """``argv`` running in the sandbox, its output streamed to the callbacks (on the
        event loop): an ``AsyncFleetProcess`` over the node's data plane (stdin, signals, a
        PTY), else a ``FleetCommand`` (an exec: no stdin, signals or PTY)."""
        if self.streams:
            return await self.handle.aio().start(list(argv), env=env, cwd=cwd, user=user,
                                                 timeout=timeout, on_stdout=on_stdout,
                                                 on_stderr=on_stderr, pty=pty)
        if pty is not None:
            raise _unsupported("a PTY", stream=True)
        loop = asyncio.get_running_loop()

        def relay(cb: Callable[[bytes], None] | None) -> Callable[[bytes], None] | None:
            # the stream's thread hands each chunk to the loop, in order
            if cb is None:
                return None

            def forward(data: bytes) -> None:
                loop.call_soon_threadsafe(cb, data)
            return forward

        result = loop.run_in_executor(self.backend._pool, lambda: self.handle.exec(
            list(argv), env=env, cwd=cwd, user=user, timeout=timeout,
            on_stdout=relay(on_stdout), on_stderr=relay(on_stderr)))
        return FleetCommand(result)

    async def set_network(self, network: bool | Sequence[str]) -> None:
        """``Sandbox.set_network`` on its node (E2B's network rules)."""
        await self.backend.run(self.handle.set_network, network)

    async def watch(self, path: str, *, recursive: bool = False) -> Any:
        # envd's WatchDir answers an OSError in one line: "watch PATH: <this>"
        if not self.streams:
            raise OSError(errno.EOPNOTSUPP,
                          _unsupported("a directory watch", stream=True).message)
        try:
            return await self.handle.aio().watch(path, recursive=recursive)
        except OSError:
            raise  # no such directory, not one
        except EnvbuildError as e:  # the node lost, the sandbox gone, too many streams
            raise OSError(errno.EHOSTUNREACH, e.message) from None

    async def connect_port(self, port: int, timeout: float) -> Any:
        # the port proxy answers an OSError in one line: "connect to port N: <this>"
        if not self.streams:
            raise OSError(errno.EOPNOTSUPP, _unsupported("a port", stream=True).message)
        try:
            return await self.handle.aio().connect_port(port, timeout)
        except OSError:
            raise  # PortRefused among them
        except EnvbuildError as e:  # the node lost, the sandbox gone, too many streams
            raise OSError(errno.EHOSTUNREACH, e.message) from None

    async def close(self) -> None:
        self.backend._served.pop(self.id, None)
        await self.backend.run(self.handle.close)


class FleetWriter:
    """``AsyncSandbox.write_stream``'s writer for a fleet sandbox: the pieces are held and
    written whole at ``commit`` (``write_file``, as the lock's user), then the file is given
    to ``user`` ("uid:gid") when that is another user."""

    def __init__(self, served: FleetServed, path: str, mode: int, user: str | None) -> None:
        self.served, self.path, self.mode, self.user = served, path, mode, user
        self._buf: bytearray | None = bytearray()
        self.written = 0

    holding = False  # ``FileWriter.holding``: it copies every piece into one buffer

    async def write(self, data: bytes | bytearray | memoryview, *, lent: bool = False) -> None:
        if self._buf is None:
            raise RuntimeShimError(f"write {self.path} in sandbox: the write has ended")
        self._buf += data
        self.written += len(data)

    async def commit(self) -> None:
        if self._buf is None:
            raise RuntimeShimError(f"write {self.path} in sandbox: the write has ended")
        data, self._buf = bytes(self._buf), None
        await self.served.write_file(self.path, data, self.mode)
        if self.user and self.user != (self.served.lock.user or "0:0"):
            r = await self.served.exec(["chown", self.user, "--", self.path], user="0:0",
                                       timeout=30)
            if r.exit_code != 0:
                raise RuntimeShimError(f"chown {self.user} {self.path}: "
                                       f"{r.stderr.decode(errors='replace').strip()[-200:]}")

    async def abort(self) -> None:
        self._buf = None

    async def __aenter__(self) -> FleetWriter:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            await self.commit()
        else:
            await self.abort()


class FleetCommand:
    """A command started on a fleet sandbox without a data plane (an exec through Ray):
    ``wait`` for its result; it has no stdin
    (closing it is a no-op, writing to it ``Unsupported``) and takes no signals. It ends with
    its sandbox."""

    def __init__(self, result: asyncio.Future[ExecResult]) -> None:
        self._result = result
        # a command whose sandbox was killed under it fails with nobody waiting: not an error
        result.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def wait(self) -> ExecResult:
        return await asyncio.shield(self._result)

    async def cancel(self) -> None:
        """Stop waiting: the command ends when its sandbox is closed."""

    def close_stdin(self) -> None:
        """A fleet command's stdin is closed from the start."""

    def write_stdin(self, data: bytes) -> None:
        raise _unsupported("stdin", stream=True)

    def send_signal(self, sig: int) -> None:
        raise _unsupported("a signal to a command", stream=True)

    def resize(self, rows: int, cols: int) -> None:
        raise _unsupported("a PTY", stream=True)
