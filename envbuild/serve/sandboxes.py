"""The server's sandboxes: one ``Entry`` per sandbox it created, with what E2B's API reports
about it (template, metadata, start and end times, access token) and its running processes.

A sandbox lives until it is killed or its end time passes (E2B's ``timeout``, moved by
``set_timeout`` and ``connect``); then it is closed and forgotten, and every later request
naming it is a 404. The ``Registry`` is used from the server's event loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from envbuild.serve.auth import new_token

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
    listeners: list[asyncio.Queue[Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Entry:
    id: str
    template: str
    sandbox: Any  # runtime_shim.AsyncSandbox
    token: str
    metadata: dict[str, str]
    env_vars: dict[str, str]
    started_at: float
    end_at: float
    timer: asyncio.TimerHandle | None = None
    processes: dict[int, Process] = dataclasses.field(default_factory=dict)
    next_pid: int = 1000
    #: its /etc/passwd, read on first use: name and "#uid" → ("uid:gid", home)
    users: dict[str, tuple[str, str]] | None = None
    closing: bool = False
    #: for ports (``envbuild.serve.ports``): E2B's ``trafficAccessToken``, not the envd token
    traffic_token: str = dataclasses.field(default_factory=new_token)
    #: the aiohttp client session of its port requests (``envbuild.serve.ports``), if any
    port_session: Any = None


class Registry:
    """The live sandboxes by id; ``open`` makes one with ``opener`` (the runtime_shim create)."""

    def __init__(self, opener: Callable[[str], Any], *, max_timeout: float,
                 max_sandboxes: int) -> None:
        self._opener = opener
        self._entries: dict[str, Entry] = {}
        self.max_timeout = max_timeout
        self.max_sandboxes = max_sandboxes
        self._opening = 0

    def get(self, sandbox_id: str | None) -> Entry | None:
        entry = self._entries.get(sandbox_id or "")
        return None if entry is None or entry.closing else entry

    def all(self) -> list[Entry]:
        return [e for e in self._entries.values() if not e.closing]

    def full(self) -> bool:
        return len(self._entries) + self._opening >= self.max_sandboxes

    async def open(self, template: str, *, timeout: float, metadata: Mapping[str, str],
                   env_vars: Mapping[str, str]) -> Entry:
        self._opening += 1
        try:
            sandbox = await self._opener(template)
        finally:
            self._opening -= 1
        # whole microseconds, as reported (ISO 8601): a startedAfter filter given a reported
        # start then compares equal instead of a rounding apart
        now = datetime.datetime.now(datetime.UTC).timestamp()
        entry = Entry(id=f"i{uuid.uuid4().hex[:19]}", template=template, sandbox=sandbox,
                      token=new_token(), metadata=dict(metadata), env_vars=dict(env_vars),
                      started_at=now, end_at=now)
        self._entries[entry.id] = entry
        self.set_timeout(entry, timeout)
        return entry

    def set_timeout(self, entry: Entry, timeout: float) -> None:
        """End ``entry`` ``timeout`` seconds from now (capped at ``max_timeout``)."""
        timeout = min(max(float(timeout), 0.0), self.max_timeout)
        entry.end_at = time.time() + timeout
        if entry.timer is not None:
            entry.timer.cancel()
        loop = asyncio.get_running_loop()
        entry.timer = loop.call_later(timeout, lambda: loop.create_task(self.kill(entry.id)))

    async def kill(self, sandbox_id: str) -> bool:
        entry = self.get(sandbox_id)
        if entry is None:
            return False
        entry.closing = True
        if entry.timer is not None:
            entry.timer.cancel()
        for proc in list(entry.processes.values()):
            if proc.task is not None:
                proc.task.cancel()
        if entry.port_session is not None:
            await entry.port_session.close()
        try:
            await entry.sandbox.close()
        except Exception as e:  # noqa: BLE001 - the sandbox is forgotten either way
            _log.warning("close sandbox %s: %s", sandbox_id, e)
        finally:
            self._entries.pop(sandbox_id, None)
        return True

    async def close_all(self) -> None:
        await asyncio.gather(*(self.kill(i) for i in list(self._entries)),
                             return_exceptions=True)
