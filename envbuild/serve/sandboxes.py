"""The server's sandboxes: one ``Entry`` per sandbox it created, with what E2B's API reports
about it (template, metadata, start and end times, access token) and its running processes.

A sandbox lives until it is killed or its end time passes (E2B's ``timeout``, moved by
``set_timeout`` and ``connect``); then it is closed and forgotten, and every later request
naming it is a 404 — unless its ``Lifecycle`` (``envbuild.serve.lifecycle``) says to pause it
then (if that pause fails it is killed). ``wake`` resumes a paused sandbox whose lifecycle has
``auto_resume``, for a request to it. ``pause`` saves it (files, and memory unless asked not
to) and closes it: its state is then ``paused`` and it has no end time until ``resume`` starts it again from
what was saved. The ``Registry`` is used from the server's event loop only.

**Records.** With a ``RecordDir`` (``envbuild.serve.records``) every change of an entry is
written to its record, and ``reattach`` (at the server's start) serves again the sandboxes of
the records a previous server process left: a running one is attached by id (one whose end
time passed while no server ran is killed then), a paused one waits for its resume.
``detach_all`` (a stop that keeps the sandboxes) ends the server's streams and leaves the
sandboxes and records; ``close_all`` kills them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, Protocol

from envbuild.errors import EnvbuildError
from envbuild.serve.auth import new_token
from envbuild.serve.events import EventLog
from envbuild.serve.lifecycle import Lifecycle
from envbuild.serve.records import Record, RecordDir

_log = logging.getLogger(__name__)

#: E2B's default sandbox timeout (seconds) when a create names none.
DEFAULT_TIMEOUT = 300


@dataclasses.dataclass
class Process:
    """A command started through envd's ``Process.Start``: its task, the events it emitted
    and who is listening."""

    pid: int
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None
    pty: tuple[int, int] | None = None  # the terminal's size at the start, None without one
    task: asyncio.Task[Any] | None = None
    handle: Any = None  # runtime_shim.sdk.process.AsyncProcess once started
    detachable: bool = False  # started detachable: a memory pause keeps it (envd_process)
    pausing: bool = False  # being detached for a dump: its end is not the command's
    detach_id: int = 0  # its id in the agent while detached (taken up after the dump)
    listeners: list[asyncio.Queue[Any]] = dataclasses.field(default_factory=list)


class ProcessTable(Protocol):
    """The envd process service (``envbuild.serve.envd_process``), which a dump with memory
    asks to detach the commands first and to take them up again after."""

    async def detach(self, entry: Entry) -> None: ...
    async def reattach(self, entry: Entry) -> None: ...


class Backend(Protocol):
    """What the registry asks of the sandboxes' provider (``envbuild.serve.backend``)."""

    @property
    def store(self) -> Any: ...  # where its snapshots are published (envbuild.serve.snapshots)
    @property
    def keeps_memory(self) -> bool: ...  # a pause or snapshot may keep the processes
    async def create(self, template: str, network: Any = None) -> Any: ...
    async def attach(self, sandbox_id: str) -> Any: ...
    async def pause(self, sandbox: Any, e2b_id: str, *, memory: bool) -> str: ...
    async def resume(self, lock: str, *, memory: bool, network: Any = None) -> Any: ...
    def forget(self, e2b_id: str) -> None: ...
    async def snapshot(self, sandbox: Any, name: str, *, memory: bool) -> str: ...
    async def fork(self, sandbox: Any, count: int, network: Any = None) -> list[Any]: ...


@dataclasses.dataclass
class Entry:
    id: str
    template: str
    sandbox: Any  # runtime_shim.AsyncSandbox while running, else None
    token: str
    metadata: dict[str, str]
    env_vars: dict[str, str]
    started_at: float
    end_at: float
    timer: asyncio.TimerHandle | None = None
    processes: dict[int, Process] = dataclasses.field(default_factory=dict)
    #: its directory watches by id (``envbuild.serve.envd_watch``): runtime_shim ``DirWatch``es
    watchers: dict[str, Any] = dataclasses.field(default_factory=dict)
    next_pid: int = 1000
    #: its /etc/passwd, read on first use: name and "#uid" → ("uid:gid", home)
    users: dict[str, tuple[str, str]] | None = None
    #: "running", "paused", "busy" (being paused or resumed), "closing"
    state: str = "running"
    #: for ports (``envbuild.serve.ports``): E2B's ``trafficAccessToken``, not the envd token
    traffic_token: str = dataclasses.field(default_factory=new_token)
    #: the aiohttp client session of its port requests (``envbuild.serve.ports``), if any
    port_session: Any = None
    cpus: int = 1
    memory_mb: int = 0
    disk_mb: int = 0
    checkpoint: str | None = None  # the lock it is paused into
    memory: bool = True  # whether ``checkpoint`` holds its memory
    #: its firewall as last set (``Sandbox.set_network``'s argument; ``envbuild.serve.egress``),
    #: None without a network (or not known: re-attached after a server restart)
    network: Any = None
    #: what the server did to it and ran in it (``envbuild.serve.events``: its logs)
    events: EventLog = dataclasses.field(default_factory=EventLog)
    #: what its timeout does and whether a request resumes it (``envbuild.serve.lifecycle``)
    lifecycle: Lifecycle = dataclasses.field(default_factory=Lifecycle)
    #: set when it is no longer "busy" (``Registry.settle``)
    changing: asyncio.Event | None = None

    def record(self) -> Record:
        return Record(id=self.id, template=self.template, metadata=self.metadata,
                      env_vars=self.env_vars, started_at=self.started_at, end_at=self.end_at,
                      token=self.token, traffic_token=self.traffic_token, cpus=self.cpus,
                      memory_mb=self.memory_mb, disk_mb=self.disk_mb,
                      sandbox=None if self.sandbox is None else self.sandbox.id,
                      checkpoint=self.checkpoint, memory=self.memory,
                      lifecycle=self.lifecycle)

    def run(self, sandbox: Any) -> None:
        """Serve ``sandbox`` as this entry's (created, attached or resumed)."""
        limits = sandbox.sync.limits
        self.sandbox, self.checkpoint, self.state = sandbox, None, "running"
        self.processes, self.users = {}, None
        self.cpus = max(1, round(limits.cpus or 1))
        self.memory_mb = (limits.memory_bytes or 0) >> 20
        self.disk_mb = (limits.disk_bytes or 0) >> 20


class Conflict(EnvbuildError):
    """A request the sandbox's state does not allow now (E2B's 409)."""


class FilesOnly(EnvbuildError):
    """A pause or snapshot with memory asked of a backend that keeps files only (a fleet)."""


class Registry:
    """The server's sandboxes by id, made by ``backend``, recorded in ``records`` if given."""

    def __init__(self, backend: Backend, *, max_timeout: float, max_sandboxes: int,
                 records: RecordDir | None = None) -> None:
        self.backend = backend
        self.records = records
        self._entries: dict[str, Entry] = {}
        self.max_timeout = max_timeout
        self.max_sandboxes = max_sandboxes
        self._opening = 0
        #: set by the envd process service: detaches commands around a dump with memory
        self.process_table: ProcessTable | None = None

    def get(self, sandbox_id: str | None) -> Entry | None:
        """A running sandbox (what envd and ports may reach)."""
        entry = self._entries.get(sandbox_id or "")
        return entry if entry is not None and entry.state == "running" else None

    def find(self, sandbox_id: str | None) -> Entry | None:
        """A sandbox in any state but closing (what the control plane names)."""
        entry = self._entries.get(sandbox_id or "")
        return None if entry is None or entry.state == "closing" else entry

    def all(self) -> list[Entry]:
        return [e for e in self._entries.values() if e.state != "closing"]

    def room(self, n: int) -> bool:
        """Whether ``n`` more sandboxes fit under ``max_sandboxes``."""
        return len(self._entries) + self._opening + n <= self.max_sandboxes

    def _save(self, entry: Entry) -> None:
        # no fsync: the record must outlive the server process, not the host (the sandboxes
        # do not survive a reboot either)
        if self.records is not None and entry.state != "closing":
            self.records.write(entry.record())

    async def open(self, template: str, *, timeout: float, metadata: Mapping[str, str],
                   env_vars: Mapping[str, str], network: Any = None,
                   lifecycle: Lifecycle | None = None) -> Entry:
        """A new sandbox of ``template``; ``network``: ``Sandbox.create``'s (None: none)."""
        self._opening += 1
        try:
            sandbox = await self.backend.create(template, network)
        finally:
            self._opening -= 1
        return self._register(template, sandbox, timeout, metadata, env_vars, network,
                              lifecycle or Lifecycle(timeout=timeout))

    def _register(self, template: str, sandbox: Any, timeout: float,
                  metadata: Mapping[str, str], env_vars: Mapping[str, str],
                  network: Any = None, lifecycle: Lifecycle | None = None) -> Entry:
        # whole microseconds, as reported (ISO 8601): a startedAfter filter given a reported
        # start then compares equal instead of a rounding apart
        now = datetime.datetime.now(datetime.UTC).timestamp()
        entry = Entry(id=f"i{uuid.uuid4().hex[:19]}", template=template, sandbox=sandbox,
                      token=new_token(), metadata=dict(metadata), env_vars=dict(env_vars),
                      started_at=now, end_at=now, network=network,
                      lifecycle=lifecycle or Lifecycle(timeout=timeout))
        entry.run(sandbox)
        self._entries[entry.id] = entry
        self.set_timeout(entry, timeout)
        entry.events.note("sandbox.create", f"created from {template}", template=template)
        return entry

    def set_timeout(self, entry: Entry, timeout: float) -> None:
        """End ``entry`` ``timeout`` seconds from now (capped at ``max_timeout``)."""
        timeout = min(max(float(timeout), 0.0), self.max_timeout)
        entry.end_at = time.time() + timeout
        self._arm(entry)
        self._save(entry)

    def _arm(self, entry: Entry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        loop = asyncio.get_running_loop()
        entry.timer = loop.call_later(max(0.0, entry.end_at - time.time()),
                                      lambda: loop.create_task(self._expire(entry)))

    async def _expire(self, entry: Entry) -> None:
        """``entry``'s end time passed: pause it if its lifecycle says so, else (or if that
        fails) kill it."""
        entry.timer = None
        if entry.lifecycle.on_timeout == "pause" and entry.state == "running":
            try:
                await self.pause(entry, memory=entry.lifecycle.memory)
                return
            except EnvbuildError as e:
                _log.warning("auto-pause of sandbox %s failed, killed: %s", entry.id, e)
        await self.kill(entry.id)

    async def wake(self, sandbox_id: str | None, allowed: Callable[[Entry], bool]) -> \
            Entry | None:
        """``get``, but a paused sandbox whose lifecycle has ``auto_resume`` is resumed first
        (once for concurrent requests; after a pause under way) if ``allowed(entry)`` (its
        token was shown)."""
        entry = self.find(sandbox_id)
        if entry is None or not entry.lifecycle.auto_resume or entry.state == "running" \
                or not allowed(entry):
            return self.get(sandbox_id)
        await self.settle(entry)
        if entry.state == "paused":  # the first request resumes it, the others settle
            try:
                await self.resume(entry, timeout=entry.lifecycle.timeout)
            except EnvbuildError as e:
                _log.warning("auto-resume of sandbox %s failed: %s", entry.id, e)
        return self.get(sandbox_id)

    async def settle(self, entry: Entry) -> None:
        """Wait while ``entry`` is being paused, resumed or dumped."""
        while entry.state == "busy" and entry.changing is not None:
            await entry.changing.wait()

    @contextlib.contextmanager
    def _changing(self, entry: Entry) -> Iterator[None]:
        """``entry`` busy while the block runs (which sets its next state); ``settle`` waits."""
        entry.state = "busy"
        done = entry.changing = asyncio.Event()
        try:
            yield
        finally:
            if entry.changing is done:
                entry.changing = None
            done.set()

    async def _detach(self, entry: Entry, keep_processes: bool = False) -> None:
        """End what the server holds of ``entry``: its timer, command streams, watches, port
        session; with ``keep_processes`` (a dump with memory follows) its commands are
        detached first (``ProcessTable``) and stay in its table, the rest end."""
        if keep_processes and self.process_table is not None:
            await self.process_table.detach(entry)
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        for watch in entry.watchers.values():
            watch.close()
        entry.watchers.clear()
        for proc in list(entry.processes.values()):
            if proc.task is not None and not proc.detach_id:
                proc.task.cancel()
        if entry.port_session is not None:
            await entry.port_session.close()
            entry.port_session = None

    async def kill(self, sandbox_id: str) -> bool:
        entry = self.find(sandbox_id)
        if entry is None:
            return False
        await self.settle(entry)  # a pause or resume under way ends first
        if entry.state == "closing":
            return False
        if entry.state == "busy":
            raise Conflict(f"sandbox {sandbox_id} is being paused or resumed")
        entry.state = "closing"
        await self._detach(entry)
        try:
            if entry.sandbox is not None:
                await entry.sandbox.close()
            else:
                self.backend.forget(entry.id)
        except Exception as e:  # noqa: BLE001 - the sandbox is forgotten either way
            _log.warning("close sandbox %s: %s", sandbox_id, e)
        finally:
            self._entries.pop(sandbox_id, None)
            if self.records is not None:
                self.records.remove(sandbox_id)
        return True

    async def pause(self, entry: Entry, *, memory: bool) -> None:
        """Save ``entry`` (memory too if ``memory``) and close its sandbox: ``Conflict`` if
        it is not running; on a failure it runs on, with its end time."""
        if entry.state != "running":
            raise Conflict(f"sandbox {entry.id} is {entry.state}, not running")
        self._files_only(memory, "a pause")
        with self._changing(entry):
            await self._detach(entry, memory)
            try:
                lock = await self.backend.pause(entry.sandbox, entry.id, memory=memory)
            except BaseException:
                entry.state = "running"
                self._arm(entry)
                await self._reattach(entry)
                raise
            entry.sandbox, entry.checkpoint, entry.memory = None, lock, memory
            entry.state = "paused"
            if not memory:
                entry.processes = {}
        self._save(entry)
        entry.events.note("sandbox.pause", "paused" + ("" if memory else " (files only)"))

    def _files_only(self, memory: bool, what: str) -> None:
        """Refuse ``what`` with ``memory`` where the backend keeps files only, before any of
        the sandbox's commands is detached or ended: it runs on as it was."""
        if memory and not self.backend.keeps_memory:
            raise FilesOnly(f"{what} with memory is not available here (this server keeps "
                            "files only): ask for mode='filesystem'",
                            hint="E2B SDK: pause(mode='filesystem'), "
                                 "create_snapshot(mode='filesystem')")

    async def _reattach(self, entry: Entry) -> None:
        """Take up the commands a dump detached (``entry`` runs again)."""
        if self.process_table is not None and entry.processes:
            await self.process_table.reattach(entry)

    @contextlib.asynccontextmanager
    async def _dumping(self, entry: Entry) -> AsyncIterator[None]:
        """``entry`` held while CRIU dumps it and it runs on: its command streams end first
        (CRIU cannot dump a connection to the host); its end time stays."""
        if entry.state != "running":
            raise Conflict(f"sandbox {entry.id} is {entry.state}, not running")
        with self._changing(entry):
            if self.backend.keeps_memory:
                await self._detach(entry, keep_processes=True)
            # else nothing is dumped (a fork copies the files): the commands stay in the table
            # and run on, which ``ProcessTable.detach`` would drop (they are not detachable)
            try:
                yield
            finally:
                if entry.state == "busy":
                    entry.state = "running"
                    self._arm(entry)
                    await self._reattach(entry)

    async def snapshot(self, entry: Entry, name: str, *, memory: bool) -> str:
        """Publish ``entry``'s snapshot ``name`` (memory too if ``memory``); its id."""
        self._files_only(memory, "a snapshot")
        if not memory:
            if entry.state != "running":
                raise Conflict(f"sandbox {entry.id} is {entry.state}, not running")
            return await self.backend.snapshot(entry.sandbox, name, memory=False)
        async with self._dumping(entry):
            return await self.backend.snapshot(entry.sandbox, name, memory=True)

    async def fork(self, entry: Entry, count: int, timeout: float) -> list[Entry | Exception]:
        """``count`` new sandboxes continuing from ``entry``'s processes and files (it runs
        on), with its template, metadata and env vars, each or the error that stopped it."""
        self._opening += count
        try:
            async with self._dumping(entry):
                made = await self.backend.fork(entry.sandbox, count, entry.network)
        finally:
            self._opening -= count
        return [c if isinstance(c, Exception) else
                self._register(entry.template, c, timeout, entry.metadata, entry.env_vars,
                               entry.network) for c in made]

    async def resume(self, entry: Entry, *, timeout: float, memory: bool = True) -> None:
        """Start ``entry`` again from what ``pause`` saved (its memory unless ``memory`` is
        False or it was paused without), for ``timeout`` seconds; ``Conflict`` if not paused."""
        if entry.state != "paused" or entry.checkpoint is None:
            raise Conflict(f"sandbox {entry.id} is {entry.state}, not paused")
        with self._changing(entry):
            try:
                sandbox = await self.backend.resume(entry.checkpoint,
                                                    memory=memory and entry.memory,
                                                    network=entry.network)
            except BaseException:
                entry.state = "paused"
                raise
            kept = entry.processes if memory and entry.memory else {}
            entry.run(sandbox)
            entry.processes = kept
            await self._reattach(entry)
        self.set_timeout(entry, timeout)
        entry.events.note("sandbox.resume", "resumed")
        try:
            self.backend.forget(entry.id)
        except EnvbuildError as e:  # the ref only protects a checkpoint no longer needed
            _log.warning("drop the paused ref of %s: %s", entry.id, e)

    async def reattach(self) -> None:
        """Serve again the sandboxes of the records left by an earlier server (see the module
        docstring); a record whose sandbox is gone is removed."""
        if self.records is None:
            return
        for rec in self.records.load(self.max_sandboxes):
            entry = Entry(id=rec.id, template=rec.template, sandbox=None, token=rec.token,
                          metadata=rec.metadata, env_vars=rec.env_vars,
                          started_at=rec.started_at, end_at=rec.end_at,
                          traffic_token=rec.traffic_token, cpus=rec.cpus,
                          memory_mb=rec.memory_mb, disk_mb=rec.disk_mb,
                          checkpoint=rec.checkpoint, memory=rec.memory, state="paused",
                          lifecycle=rec.lifecycle)
            self._entries[rec.id] = entry
            if rec.sandbox is None:
                continue
            try:
                entry.run(await self.backend.attach(rec.sandbox))
            except EnvbuildError as e:
                _log.warning("sandbox %s (%s) not re-attached, record removed: %s", rec.id,
                             rec.sandbox, e)
                self._entries.pop(rec.id)
                self.records.remove(rec.id)
                continue
            if rec.end_at <= time.time():
                _log.info("sandbox %s timed out while no server ran: %s", rec.id,
                          "paused" if rec.lifecycle.on_timeout == "pause" else "killed")
                await self._expire(entry)
            else:
                self._arm(entry)

    async def detach_all(self) -> None:
        """Stop serving every sandbox and leave them (and their records) as they are."""
        for entry in list(self._entries.values()):
            await self._detach(entry)
        self._entries.clear()

    async def close_all(self) -> None:
        await asyncio.gather(*(self.kill(i) for i in list(self._entries)),
                             return_exceptions=True)
