"""Handles of fleet sandboxes, which ``runtime_shim.fleet.client.Fleet`` makes.

``FleetSandbox`` has the ``Sandbox`` methods, each one call to its node's daemon;
``AsyncFleetSandbox`` the same as coroutines; ``FastForward`` is a restarted rollout answered
from its exec log.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from envbuild.errors import NodeLost, RuntimeShimError, SandboxNotFound
from runtime_shim.fleet import dataplane, execlog, remote
from runtime_shim.fleet.cluster import CALL_TIMEOUT, EXEC_MARGIN, mapped_error, ray_api, wait_call
from runtime_shim.fleet.model import FirstExec, SandboxRecord, split_fleet_id
from runtime_shim.node.model import ExecResult, Limits, SandboxInfo


class FleetCalls(Protocol):
    """What a handle needs of its fleet (``runtime_shim.fleet.client.Fleet``)."""

    def call(self, node_id: str, method: str, *args: Any, timeout: float = CALL_TIMEOUT
             ) -> Any: ...

    def _daemon(self, node_id: str) -> Any: ...

    def replay(self, log_id: str, *, into: FleetSandbox, upto: int | None = None) -> Any: ...


def handles(fleet: FleetCalls, answers: Sequence[Any], first: FirstExec | None
             ) -> builtins.list[FleetSandbox]:
    """Handles of a daemon's create/claim answer: records, or ``(record, result)`` pairs
    when a first exec was asked for."""
    if first is None:
        return [FleetSandbox(fleet, r) for r in answers]
    return [FleetSandbox(fleet, r, first_result=res) for r, res in answers]


class FleetSandbox:
    """One fleet sandbox: ``Sandbox``'s methods, each one call to its node's daemon.
    ``first_result``: the ``ExecResult`` of ``create(..., first_exec=...)`` (else None)."""

    def __init__(self, fleet: FleetCalls, record: SandboxRecord, *,
                 first_result: ExecResult | None = None) -> None:
        self.fleet = fleet
        self.record = record
        self.first_result = first_result
        self.id = record.id
        self.node_id = record.node_id
        self.sdk_id = split_fleet_id(record.id)[0]
        self.lock = record.lock
        self.backend = record.backend
        self.exec_log = record.exec_log

    def _call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        return self.fleet.call(self.node_id, method, self.sdk_id, *args, timeout=timeout)

    def _direct(self, request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """``request`` over the node's data plane (``runtime_shim.fleet.dataplane``): its
        reply, or None when this sandbox has none or it cannot be reached (use Ray)."""
        addr, token = self.record.data_addr, self.record.token
        if addr is None or not token:
            return None
        try:
            return dataplane.call((str(addr[0]), int(addr[1])), request, timeout, self.node_id)
        except dataplane.Unreachable:
            return None

    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             user: str | None = None, stdin: bytes | None = None,
             on_stdout: Callable[[bytes], None] | None = None,
             on_stderr: Callable[[bytes], None] | None = None,
             check_timeout: bool = False) -> ExecResult:
        """``Sandbox.exec`` in the fleet; with ``on_stdout``/``on_stderr`` the output is
        streamed from the node as it arrives (the callbacks run in this thread)."""
        kwargs = _exec_kwargs(timeout, env, cwd, user, stdin, check_timeout)
        deadline = (timeout or Limits().exec_timeout) + EXEC_MARGIN
        if on_stdout is None and on_stderr is None:
            direct = self._direct(dataplane.exec_request(self.sdk_id, self.record.token or "",
                                                         cmd, kwargs), deadline)
            if direct is not None:
                return dataplane.exec_result(direct, self.id, check_timeout)
            return self._call("exec", cmd, kwargs, timeout=deadline)
        gen = self.fleet._daemon(self.node_id).exec_stream.remote(self.sdk_id, cmd, kwargs)
        end = time.monotonic() + deadline
        while True:
            left = end - time.monotonic()
            try:
                # Ray's generator with a deadline (a nil ref when nothing came in time)
                ref = gen._next_sync(timeout_s=max(0.001, left))
            except StopIteration:
                raise RuntimeShimError(f"exec stream of {self.id} ended without a result") \
                    from None
            except Exception as e:  # noqa: BLE001 - the actor died between chunks
                _get_error(e, self.node_id)
            if ref.is_nil():
                with contextlib.suppress(Exception):
                    ray_api().cancel(gen)
                raise NodeLost(f"node {self.node_id[:12]} sent nothing of the exec in "
                               f"{deadline:.0f} s", node_id=self.node_id,
                               hint="the node or its daemon is overloaded or hung; "
                                    "`envbuild fleet nodes` shows the live ones")
            kind, value = wait_call(ref, max(1.0, end - time.monotonic()), self.node_id)
            if kind == "stdout" and on_stdout:
                on_stdout(value)
            elif kind == "stderr" and on_stderr:
                on_stderr(value)
            elif kind == "result":
                return value
            elif kind == "error":
                raise value

    def start(self, cmd: str | Sequence[str], *, timeout: float | None = None,
              env: Mapping[str, str] | None = None, cwd: str | None = None,
              user: str | None = None, stdin: bytes | None = None,
              on_stdout: Callable[[bytes], None] | None = None,
              on_stderr: Callable[[bytes], None] | None = None,
              pty: tuple[int, int] | None = None) -> remote.FleetProcess:
        """``Sandbox.start`` on the node, over its data plane (``runtime_shim.fleet.streams``):
        a ``FleetProcess`` whose command lives as long as its stream (``cancel`` or a lost
        connection kills it). Output callbacks run in the process's thread."""
        request = remote.start_request(cmd if isinstance(cmd, str) else list(cmd),
                                       _exec_kwargs(timeout, env, cwd, user, stdin, False), pty)
        sock = remote.open_stream(self.record, self.sdk_id, request, "a started command")
        return remote.FleetProcess(sock, self.record, on_stdout=on_stdout, on_stderr=on_stderr,
                                   pty=pty)

    def connect_port(self, port: int, timeout: float = 10.0) -> socket.socket:
        """``Sandbox.connect_port`` over the node's data plane: a socket whose bytes are
        spliced to ``127.0.0.1:port`` inside the sandbox (``PortRefused`` if nothing
        listens)."""
        return remote.connect_port(self.record, self.sdk_id, port, timeout)

    def watch(self, path: str, *, recursive: bool = False) -> remote.FleetWatch:
        """``Sandbox.watch`` on the node, over its data plane: a ``FleetWatch``
        (``w.wait(timeout)``; ``close()`` ends it on the node); ``FileNotFoundError`` or
        ``NotADirectoryError`` as the local one."""
        return remote.FleetWatch(remote.open_stream(
            self.record, self.sdk_id, {"op": "watch", "path": path, "recursive": recursive},
            "a watch"))

    def read_file(self, path: str) -> bytes:
        direct = self._direct({"op": "read", "id": self.sdk_id, "token": self.record.token,
                               "path": path}, CALL_TIMEOUT)
        if direct is not None:
            return base64.b64decode(direct["data"])
        return self._call("read_file", path)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else data
        if self._direct({"op": "write", "id": self.sdk_id, "token": self.record.token,
                         "path": path, "data": base64.b64encode(raw).decode(), "mode": mode},
                        CALL_TIMEOUT) is None:
            self._call("write_file", path, raw, mode)

    def set_network(self, network: bool | Sequence[str]) -> None:
        """``Sandbox.set_network`` on the node."""
        self._call("set_network", network if isinstance(network, bool) else list(network))

    def pack_diff(self, publish: str | None = None, **kwargs: Any):
        """``Sandbox.pack_diff`` on the node (a ``SnapshotResult``)."""
        return self._call("pack_diff", publish, kwargs, timeout=CALL_TIMEOUT * 10)

    def info(self) -> SandboxInfo:
        return self._call("info")[0]

    def grade(self, task: str, **kwargs: Any):
        """``runtime_shim.grade`` of this sandbox on ``task``, on its node (a ``Verdict``)."""
        return self._call("grade", task, kwargs, timeout=CALL_TIMEOUT * 10)

    def renew(self, ttl: float | None = None) -> SandboxRecord:
        """Extend the lease by ``ttl`` (default: the one it was created with)."""
        self.record = self._call("renew", ttl)
        return self.record

    def close(self) -> None:
        """Stop and remove the sandbox; idempotent."""
        with contextlib.suppress(SandboxNotFound):
            self._call("close")

    def aio(self) -> AsyncFleetSandbox:
        return AsyncFleetSandbox(self)

    def __enter__(self) -> FleetSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FleetSandbox {self.id} lock={self.lock[:19]}>"


async def _awaited(ref: Any) -> Any:
    return await ref


def _get_error(e: BaseException, node_id: str) -> None:
    raise mapped_error(e, node_id, 0.0) from None


def _exec_kwargs(timeout, env, cwd, user, stdin, check_timeout) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for k, v in (("timeout", timeout), ("env", env), ("cwd", cwd), ("user", user),
                 ("stdin", stdin)):
        if v is not None:
            kwargs[k] = dict(v) if k == "env" else v
    if check_timeout:
        kwargs["check_timeout"] = True
    return kwargs


class AsyncFleetSandbox:
    """A ``FleetSandbox`` whose methods are coroutines (Ray object refs awaited on the event
    loop, each with the same deadline as the blocking form)."""

    def __init__(self, sandbox: FleetSandbox) -> None:
        self.sync = sandbox

    @property
    def id(self) -> str:
        return self.sync.id

    async def _call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        sb = self.sync
        ref = getattr(sb.fleet._daemon(sb.node_id), method).remote(sb.sdk_id, *args)
        try:
            return await asyncio.wait_for(_awaited(ref), timeout)
        except Exception as e:  # noqa: BLE001 - mapped, or re-raised as is
            raise mapped_error(e, sb.node_id, timeout, ref) from None

    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   user: str | None = None, stdin: bytes | None = None,
                   on_stdout: Callable[[bytes], None] | None = None,
                   on_stderr: Callable[[bytes], None] | None = None,
                   check_timeout: bool = False) -> ExecResult:
        if on_stdout or on_stderr:  # streaming: the blocking form in a thread
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.sync.exec(cmd, timeout=timeout, env=env, cwd=cwd,
                                             user=user, stdin=stdin, on_stdout=on_stdout,
                                             on_stderr=on_stderr, check_timeout=check_timeout))
        kwargs = _exec_kwargs(timeout, env, cwd, user, stdin, check_timeout)
        return await self._call("exec", cmd, kwargs,
                                timeout=(timeout or Limits().exec_timeout) + EXEC_MARGIN)

    async def start(self, cmd: str | Sequence[str], *, timeout: float | None = None,
                    env: Mapping[str, str] | None = None, cwd: str | None = None,
                    user: str | None = None, stdin: bytes | None = None,
                    on_stdout: Callable[[bytes], None] | None = None,
                    on_stderr: Callable[[bytes], None] | None = None,
                    pty: tuple[int, int] | None = None) -> remote.AsyncFleetProcess:
        """``FleetSandbox.start`` on the event loop: an ``AsyncFleetProcess`` (its output
        callbacks run on the loop)."""
        request = remote.start_request(cmd if isinstance(cmd, str) else list(cmd),
                                       _exec_kwargs(timeout, env, cwd, user, stdin, False), pty)
        return await remote.start_async(self.sync.record, self.sync.sdk_id, request,
                                        on_stdout=on_stdout, on_stderr=on_stderr, pty=pty)

    async def connect_port(self, port: int, timeout: float = 10.0) -> socket.socket:
        """``FleetSandbox.connect_port`` in the default executor; the socket is non-blocking
        (as ``AsyncSandbox.connect_port``'s)."""
        sock = await asyncio.get_running_loop().run_in_executor(
            None, self.sync.connect_port, port, timeout)
        sock.setblocking(False)
        return sock

    async def watch(self, path: str, *, recursive: bool = False) -> remote.AsyncFleetWatch:
        """``AsyncSandbox.watch`` on the node, over its data plane: an ``AsyncFleetWatch``
        (``await w.next_events()``; ``close()`` ends it on the node)."""
        return await remote.watch_async(self.sync.record, self.sync.sdk_id, path, recursive)

    async def read_file(self, path: str) -> bytes:
        return await self._call("read_file", path)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self._call("write_file", path, data.encode() if isinstance(data, str) else data,
                         mode)

    async def set_network(self, network: bool | Sequence[str]) -> None:
        await self._call("set_network",
                         network if isinstance(network, bool) else list(network))

    async def pack_diff(self, publish: str | None = None, **kwargs: Any):
        return await self._call("pack_diff", publish, kwargs, timeout=CALL_TIMEOUT * 10)

    async def info(self) -> SandboxInfo:
        return (await self._call("info"))[0]

    async def grade(self, task: str, **kwargs: Any):
        """``FleetSandbox.grade``, awaited."""
        return await self._call("grade", task, kwargs, timeout=CALL_TIMEOUT * 10)

    async def close(self) -> None:
        with contextlib.suppress(SandboxNotFound):
            await self._call("close")

    async def __aenter__(self) -> AsyncFleetSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class FastForward:
    """A restarted rollout's view of a sandbox: ``exec``/``write_file`` that match the exec
    log's next entry return the recorded result without running; at the first one that does
    not (or ``sync()``), the matched prefix is replayed into the sandbox so it is in that
    state, and from then on everything runs for real. ``matched``: entries answered from the
    log."""

    def __init__(self, fleet: FleetCalls, log: execlog.ExecLog, into: FleetSandbox) -> None:
        self.fleet = fleet
        self.log = log
        self.into = into
        self.matched = 0
        self._live = False

    def _next(self) -> execlog.LogEntry | None:
        if self._live or self.matched >= len(self.log.entries):
            return None
        return self.log.entries[self.matched]

    def sync(self) -> None:
        """Bring the sandbox to the matched state and stop answering from the log."""
        if not self._live:
            self._live = True
            if self.matched:
                self.fleet.replay(self.log.log_id, into=self.into, upto=self.matched)

    def exec(self, cmd: str | Sequence[str], **kwargs: Any) -> ExecResult:
        entry = self._next()
        plain = {k: v for k, v in kwargs.items() if k not in ("on_stdout", "on_stderr")}
        if entry is not None and entry.result is not None and entry.matches_exec(cmd, plain):
            self.matched += 1
            return entry.result
        self.sync()
        return self.into.exec(cmd, **kwargs)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else data
        entry = self._next()
        if entry is not None and entry.matches_write(path, raw, mode):
            self.matched += 1
            return
        self.sync()
        self.into.write_file(path, raw, mode)

    def read_file(self, path: str) -> bytes:
        self.sync()
        return self.into.read_file(path)


__all__ = ["AsyncFleetSandbox", "FastForward", "FleetCalls", "FleetSandbox", "handles"]
