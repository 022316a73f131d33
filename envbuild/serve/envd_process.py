"""envd's ``process.Process`` service over runtime_shim sandboxes: ``Start`` (a server
stream: the start event, stdout/stderr as they come, the end event with the exit code),
``Connect`` (listen to a running command), ``List`` and ``SendSignal``.

A command runs as one ``AsyncSandbox.exec`` in a task of the server, independent of the
stream that started it (E2B's semantics: a dropped stream does not end the command). Its pid
is the server's handle, not a pid inside the sandbox. It runs as a
``runtime_shim.AsyncSandbox.start`` process: ``SendInput``/``StreamInput``/``CloseStdin``
feed its stdin (opened only when ``Start`` asked for it), ``SendSignal`` signals its process
group. A ``Start`` with ``pty`` runs the command on a terminal of that size
(``AsyncSandbox.start(pty=)``): its bytes go out as ``pty`` data events, ``pty`` input (sent
or streamed) goes to the terminal, ``Update`` resizes it; a terminal's stdin is always open.

**Across a memory pause** (and a snapshot or fork with memory, which dump the sandbox while
it runs on): CRIU cannot dump a command's connection to the host, so the registry asks
``detach`` first: each command (started ``detachable`` where the backend keeps memory) is
detached in the agent (agent protocol 3; it runs on, its output kept there up to 64 KiB) and
its streams end (UNAVAILABLE, as a paused E2B sandbox's); it stays in the table with its pid.
After the restore ``reattach`` takes each up again at once: ``Connect`` by pid or tag then
gives its further output and its end, ``List`` shows it, stdin and signals reach it. A paused
sandbox's commands do not run (CRIU froze them), so a command "ends while paused" only in the
moments around the dump and the restore; it then ends as any command that ends before a
``Connect``: its end goes to the streams listening (none), it leaves the table, a later
``Connect`` is NOT_FOUND (E2B's envd forgets an ended process too). Output the agent dropped
past its bound meanwhile is noted in the sandbox's logs (``process.dropped``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shlex
import signal
from collections.abc import AsyncIterator
from typing import Any, cast

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import Process as ProcessProtocol
from protobuf import Oneof

from envbuild.errors import EnvbuildError, RuntimeShimError
from envbuild.serve import users
from envbuild.serve.events import EventLog
from envbuild.serve.sandboxes import Entry, Process, Registry

_log = logging.getLogger(__name__)

#: Commands one sandbox may run at once through envd.
MAX_PROCESSES = 256
#: Streams listening to one command at once (its Start and Connects).
MAX_LISTENERS = 8
#: How long the agent may take to detach a command before a dump (it is then ended by it).
DETACH_WAIT = 10.0


def sandbox_of(registry: Registry, ctx: RequestContext) -> Entry:
    """The sandbox the (already authenticated) request names."""
    entry = registry.get(ctx.request_headers.get("e2b-sandbox-id"))
    if entry is None:
        raise ConnectError(Code.NOT_FOUND, "sandbox was not found")
    return entry


async def user_of(entry: Entry, ctx: RequestContext) -> users.User:
    try:
        return await users.resolve(entry, users.header_user(ctx.request_headers.get(
            "authorization")))
    except users.UnknownUser as e:
        raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None


#: What listeners get when the sandbox went away under the command: no end event, an error.
_GONE = pb.ProcessEvent()
#: What a listener gets when it fell ``Limits.output_bytes`` behind (``_Listener``).
_BEHIND = pb.ProcessEvent()
#: What listeners get when the request's deadline ended the command: DEADLINE_EXCEEDED, as
#: E2B's envd ends the stream (an end event with exit 124 raced the SDK's own timer).
_TIMED_OUT = pb.ProcessEvent()


def _event(**kw: object) -> pb.ProcessEvent:
    ((name, value),) = kw.items()
    return pb.ProcessEvent(event=Oneof(name, value))  # type: ignore[arg-type]


class ProcessService(ProcessProtocol):
    """The ``process.Process`` implementation (``e2b.envd.process.process_connect.Process``);
    also the registry's process table (``detach``/``reattach`` around a dump)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._has_bash: dict[str, bool] = {}  # lock digest → /bin/bash exists in its rootfs
        registry.process_table = self

    async def detach(self, entry: Entry) -> None:
        """Detach every command of ``entry`` that can be (before CRIU dumps it); the others
        end with the dump as before."""
        for proc in list(entry.processes.values()):
            if proc.handle is None or not proc.detachable or proc.handle.done:
                continue
            proc.pausing = True
            try:
                proc.detach_id = await asyncio.wait_for(proc.handle.detach(),
                                                        DETACH_WAIT) or 0
            except (EnvbuildError, TimeoutError) as e:  # e.g. over the agent's MAX_DETACHED
                e = e if isinstance(e, EnvbuildError) else RuntimeShimError("no answer")
                entry.events.note("process.lost", f"command {proc.pid} could not be detached "
                                  f"and ends with the pause: {e.message}", "warn",
                                  pid=str(proc.pid))
            if proc.task is not None:  # its follower returns (_follow), streams end
                await asyncio.gather(proc.task, return_exceptions=True)
        entry.processes = {p.pid: p for p in entry.processes.values() if p.detach_id}

    async def reattach(self, entry: Entry) -> None:
        """Take up again the commands ``detach`` left (``entry`` runs again: restored, or
        dumped and running on); one the agent no longer has is dropped from the table."""
        for proc in list(entry.processes.values()):
            if not proc.detach_id:
                continue
            on_stdout, on_stderr = _outputs(entry, proc)
            try:
                proc.handle = await entry.sandbox.reattach(
                    proc.detach_id, on_stdout=on_stdout, on_stderr=on_stderr, pty=proc.pty)
            except EnvbuildError as e:
                entry.processes.pop(proc.pid, None)
                entry.events.note("process.lost", f"command {proc.pid} was not taken up "
                                  f"again: {e.message}", "warn", pid=str(proc.pid))
                continue
            proc.detach_id, proc.pausing = 0, False
            proc.task = asyncio.get_running_loop().create_task(_follow(entry, proc))

    async def _argv(self, entry: Entry, cfg: pb.ProcessConfig) -> list[str]:
        # the SDK runs every command as `/bin/bash -l -c CMD`; an env without bash gets sh
        if cfg.cmd != "/bin/bash":
            return [cfg.cmd, *cfg.args]
        digest = entry.sandbox.lock.digest
        if digest not in self._has_bash:
            probe = await entry.sandbox.exec(["/bin/sh", "-c", "[ -x /bin/bash ]"], timeout=30)
            self._has_bash[digest] = probe.exit_code == 0
        return [cfg.cmd if self._has_bash[digest] else "/bin/sh", *cfg.args]

    def start(self, request: pb.StartRequest, ctx: RequestContext) -> AsyncIterator[
            pb.StartResponse]:
        return self._start(request, ctx)

    async def _start(self, request: pb.StartRequest, ctx: RequestContext) -> AsyncIterator[
            pb.StartResponse]:
        entry = sandbox_of(self._registry, ctx)
        pty = _size(request.pty) if request.has_field("pty") else None
        if len(entry.processes) >= MAX_PROCESSES:
            raise ConnectError(Code.RESOURCE_EXHAUSTED,
                               f"a sandbox runs at most {MAX_PROCESSES} commands at once")
        cfg = request.process or pb.ProcessConfig()
        user = await user_of(entry, ctx)
        argv = await self._argv(entry, cfg)
        timeout_ms = ctx.timeout_ms
        entry.next_pid += 1
        proc = Process(pid=entry.next_pid, cmd=cfg.cmd, args=list(cfg.args),
                       envs=dict(cfg.envs), cwd=cfg.cwd if cfg.has_field("cwd") else None,
                       tag=request.tag if request.has_field("tag") else None, pty=pty)
        queue = _listener(entry)
        proc.listeners.append(queue)
        await self._launch(entry, proc, argv, user,
                           None if timeout_ms is None else timeout_ms / 1000)
        if not request.stdin and pty is None:  # a terminal's input is always open
            proc.handle.close_stdin()
        entry.processes[proc.pid] = proc
        entry.events.note("process.start", f"command {proc.pid} started: {shlex.join(argv)}",
                          pid=str(proc.pid), user=user.spec or "", cwd=proc.cwd or "")
        proc.task = asyncio.get_running_loop().create_task(_follow(entry, proc))
        yield pb.StartResponse(event=_event(start=pb.ProcessEvent.StartEvent(pid=proc.pid)))
        async for event in _drain(queue, proc):
            yield pb.StartResponse(event=event)

    async def _launch(self, entry: Entry, proc: Process, argv: list[str], user: users.User,
                      timeout: float | None) -> None:
        """Start ``proc``'s command (before the start event: a command that cannot start,
        e.g. a PTY of a size the SDK refuses, fails the request)."""
        cwd = users.absolute(proc.cwd, user) if proc.cwd else user.home  # E2B: home
        on_stdout, on_stderr = _outputs(entry, proc)
        # detachable where a pause keeps the processes (``detach``); the fleet's cannot
        proc.detachable = self._registry.backend.keeps_memory
        extra = {"detachable": True} if proc.detachable else {}
        try:
            proc.handle = await entry.sandbox.start(
                argv, env={**({"HOME": user.home} if user.named else {}), **entry.env_vars,
                           **proc.envs}, cwd=cwd, user=user.spec, timeout=timeout,
                on_stdout=on_stdout, on_stderr=on_stderr, pty=proc.pty, **extra)
        except RuntimeShimError as e:
            raise ConnectError(Code.FAILED_PRECONDITION, e.message) from None

    def connect(self, request: pb.ConnectRequest, ctx: RequestContext) -> AsyncIterator[
            pb.ConnectResponse]:
        return self._connect(request, ctx)

    async def _connect(self, request: pb.ConnectRequest, ctx: RequestContext
                       ) -> AsyncIterator[pb.ConnectResponse]:
        entry = sandbox_of(self._registry, ctx)
        proc = self._select(entry, request.process)
        if len(proc.listeners) >= MAX_LISTENERS:
            raise ConnectError(Code.RESOURCE_EXHAUSTED,
                               f"a command has at most {MAX_LISTENERS} streams listening")
        queue = _listener(entry)
        proc.listeners.append(queue)
        yield pb.ConnectResponse(event=_event(start=pb.ProcessEvent.StartEvent(pid=proc.pid)))
        async for event in _drain(queue, proc):
            yield pb.ConnectResponse(event=event)

    def _select(self, entry: Entry, selector: pb.ProcessSelector | None) -> Process:
        sel = selector.selector if selector is not None else None
        for proc in entry.processes.values():
            if sel is not None and ((sel.field == "pid" and proc.pid == sel.value)
                                    or (sel.field == "tag" and proc.tag == sel.value)):
                return proc
        raise ConnectError(Code.NOT_FOUND, "process not found")

    async def list(self, request: pb.ListRequest, ctx: RequestContext) -> pb.ListResponse:
        entry = sandbox_of(self._registry, ctx)
        return pb.ListResponse(processes=[
            pb.ProcessInfo(pid=p.pid, tag=p.tag, config=pb.ProcessConfig(
                cmd=p.cmd, args=p.args, envs=p.envs, cwd=p.cwd))
            for p in entry.processes.values()])

    async def send_signal(self, request: pb.SendSignalRequest, ctx: RequestContext
                          ) -> pb.SendSignalResponse:
        proc = self._select(sandbox_of(self._registry, ctx), request.process)
        sig = {pb.Signal.SIGTERM: signal.SIGTERM}.get(request.signal, signal.SIGKILL)
        if proc.handle is not None:
            try:
                proc.handle.send_signal(sig)
            except RuntimeShimError as e:  # a sandbox without signals (envbuild.serve.fleet)
                raise ConnectError(Code.FAILED_PRECONDITION, e.message) from None
        return pb.SendSignalResponse()

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext) -> pb.UpdateResponse:
        proc = self._select(sandbox_of(self._registry, ctx), request.process)
        if not request.has_field("pty"):
            return pb.UpdateResponse()
        rows, cols = _size(request.pty)
        if proc.pty is None:
            raise ConnectError(Code.FAILED_PRECONDITION, "the process has no PTY to resize")
        if proc.handle is None:
            raise ConnectError(Code.FAILED_PRECONDITION, "the process has not started yet")
        try:
            proc.handle.resize(rows, cols)
        except RuntimeShimError as e:
            raise ConnectError(Code.INVALID_ARGUMENT, e.message) from None
        return pb.UpdateResponse()

    def _stdin(self, proc: Process, inp: Oneof[str, bytes]) -> None:
        """Input of ``inp``'s kind (``stdin`` or ``pty``), which must be the process's."""
        if (inp.field == "pty") != (proc.pty is not None):
            raise ConnectError(Code.FAILED_PRECONDITION, "pty input for a process without a "
                               "PTY" if inp.field == "pty" else "stdin input for a PTY process")
        if proc.handle is None:
            raise ConnectError(Code.FAILED_PRECONDITION, "the process has not started yet")
        try:
            proc.handle.write_stdin(inp.value)
        except RuntimeShimError as e:
            raise ConnectError(Code.FAILED_PRECONDITION, e.message) from None

    async def send_input(self, request: pb.SendInputRequest, ctx: RequestContext
                         ) -> pb.SendInputResponse:
        proc = self._select(sandbox_of(self._registry, ctx), request.process)
        inp = request.input.input if request.input is not None else None
        if inp is not None:
            self._stdin(proc, inp)
        return pb.SendInputResponse()

    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest],
                           ctx: RequestContext) -> pb.StreamInputResponse:
        entry = sandbox_of(self._registry, ctx)
        proc: Process | None = None
        async for message in request:
            event = message.event
            if event is None or event.field == "keepalive":
                continue
            if event.field == "start":
                proc = self._select(entry, event.value.process)
            elif proc is None:
                raise ConnectError(Code.INVALID_ARGUMENT, "stream input before its start event")
            elif event.value.input is not None and event.value.input.input is not None:
                self._stdin(proc, event.value.input.input)
        return pb.StreamInputResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: RequestContext
                          ) -> pb.CloseStdinResponse:
        proc = self._select(sandbox_of(self._registry, ctx), request.process)
        if proc.handle is not None:
            proc.handle.close_stdin()
        return pb.CloseStdinResponse()


async def _follow(entry: Entry, proc: Process) -> None:
    """Wait for ``proc``'s command and tell its listeners how it ended (or that the sandbox
    went away under it; or, detached for a pause, that their streams end)."""
    emit = functools.partial(_emit, proc, log=entry.events)
    try:
        result = await proc.handle.wait()
        if proc.detachable and proc.handle.dropped:
            entry.events.note("process.dropped", f"command {proc.pid}: {proc.handle.dropped}"
                              " bytes of its output were dropped around a pause", "warn",
                              pid=str(proc.pid))
        if result.timed_out:  # ended by the request's deadline: E2B's stream says so
            entry.processes.pop(proc.pid, None)
            emit(_TIMED_OUT)
            return
        end = pb.ProcessEvent.EndEvent(exit_code=result.exit_code, exited=True,
                                       status=f"exit status {result.exit_code}")
    except asyncio.CancelledError:  # the sandbox is being killed: the stream breaks off
        await proc.handle.cancel()  # (E2B's does too; the SDK then probes /health)
        entry.processes.pop(proc.pid, None)
        emit(_GONE)
        raise
    except EnvbuildError as e:
        if proc.pausing:  # detached for a pause: its streams end, the table keeps it
            emit(_GONE)
            return
        end = pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status="error",
                                       error=e.message)
    entry.processes.pop(proc.pid, None)
    entry.events.note("process.end", f"command {proc.pid} ended: {end.status}"
                      + (f" ({end.error})" if end.error else ""),
                      "info" if end.exited else "error", pid=str(proc.pid))
    emit(_event(end=end))
    emit(None)


def _outputs(entry: Entry, proc: Process) -> tuple[Any, Any]:
    """The output callbacks of ``proc``'s command: data events to its listeners.
    A listener's queue is unbounded, never dropping (an end event lost would hang its
    stream): what it can hold is bounded by the command's output cap (Limits.output_bytes
    per stream, each chunk charged at least 64 bytes) times MAX_LISTENERS; a PTY's output
    is a stream without that cap, its rate bounded by how fast the listeners drain."""
    def output(kind: str) -> Any:
        return lambda data: _emit(proc, _event(data=pb.ProcessEvent.DataEvent(
            output=Oneof(kind, bytes(data)))), entry.events)  # type: ignore[arg-type]

    return output("stdout" if proc.pty is None else "pty"), output("stderr")


class _Listener(asyncio.Queue):
    """One stream's queue of events, with the output bytes it holds: a client that does not
    read is cut off at ``limit`` (a PTY's output has no cap of its own; a command's is
    ``Limits.output_bytes`` anyway), so the server's memory per stream stays bounded."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.pending = 0


def _listener(entry: Entry) -> _Listener:
    return _Listener(entry.sandbox.sync.limits.output_bytes)


def _emit(proc: Process, event: pb.ProcessEvent | None, log: EventLog) -> None:
    size = _output_size(event)
    for q in cast("list[_Listener]", list(proc.listeners)):
        if q.pending + size > q.limit:  # the client stopped reading: its stream ends
            proc.listeners.remove(q)
            q.put_nowait(_BEHIND)
            log.note("process.behind", f"command {proc.pid}: a stream fell {q.limit} bytes "
                     "of output behind and was cut", "warn", pid=str(proc.pid))
            continue
        q.pending += size
        q.put_nowait(event)


def _output_size(event: pb.ProcessEvent | None) -> int:
    if event is None or event.event is None or event.event.field != "data":
        return 0
    output = event.event.value.output
    return len(output.value) if output is not None else 0


def _size(pty: pb.PTY | None) -> tuple[int, int]:
    """A PTY message's (rows, cols); the SDK bounds them (``Sandbox.start(pty=)``)."""
    size = pty.size if pty is not None else None
    if size is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "a PTY needs its size (rows, cols)")
    return size.rows, size.cols


async def _drain(queue: _Listener, proc: Process) -> AsyncIterator[pb.ProcessEvent]:
    try:
        while (event := await queue.get()) is not None:
            if event is _GONE:
                raise ConnectError(Code.UNAVAILABLE, "the connection to the sandbox ended "
                                   "before the stream completed")
            if event is _TIMED_OUT:
                raise ConnectError(Code.DEADLINE_EXCEEDED, "the command ran past its timeout")
            if event is _BEHIND:
                raise ConnectError(Code.RESOURCE_EXHAUSTED, f"the stream fell {queue.limit} "
                                   "bytes of output behind; connect again to follow it")
            queue.pending -= _output_size(event)
            yield event
    finally:  # the stream ended or its client left: stop feeding this listener
        if queue in proc.listeners:
            proc.listeners.remove(queue)
