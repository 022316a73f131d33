"""The client's side of the data plane's streams (``runtime_shim.fleet.streams``): a command
started in a fleet sandbox as ``FleetProcess``/``AsyncFleetProcess`` (the surface of
runtime_shim's ``Process``/``AsyncProcess``: stdin, signals, PTY resize, wait), and a
socket connected to a port inside it (``connect_port``).

Each stream has a connection of its own to the sandbox's node. A command lives as long as its
stream: closing the process (``cancel``, or losing the connection) kills it on the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any

from envbuild.errors import NodeLost, RuntimeShimError
from runtime_shim.fleet import dataplane
from runtime_shim.fleet.model import SandboxRecord
from runtime_shim.fleet.streams import CHUNK, MAX_INPUT, read_exit, recv_frame
from runtime_shim.isolation.watch import WatchEvent
from runtime_shim.node.model import ExecResult

OutputCallback = Callable[[bytes], None]


def no_data_plane(what: str, sandbox_id: str) -> RuntimeShimError:
    return RuntimeShimError(f"{what} of fleet sandbox {sandbox_id} needs the nodes' data plane",
                            hint="start the fleet's daemons with --data-host ADDRESS "
                                 "(envbuild fleet start --data-host)")


def _target(record: SandboxRecord, what: str) -> tuple[tuple[str, int], str]:
    if record.data_addr is None or not record.token:
        raise no_data_plane(what, record.id)
    return (str(record.data_addr[0]), int(record.data_addr[1])), record.token


def _lost(record: SandboxRecord, e: BaseException) -> NodeLost:
    return NodeLost(f"the stream to node {record.node_id[:12]} broke: {e}",
                    node_id=record.node_id, hint="the node or its daemon may be gone; "
                                                 "`envbuild fleet nodes` shows the live ones")


def open_stream(record: SandboxRecord, sdk_id: str, request: Mapping[str, Any], what: str,
                timeout: float = 30.0) -> socket.socket:
    """A connection to the sandbox's node on which ``request`` (a stream request) was
    accepted; the daemon's refusal raised as its class."""
    addr, token = _target(record, what)
    try:
        sock = socket.create_connection(addr, timeout=5.0)
    except OSError as e:
        raise _lost(record, e) from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        dataplane.send_message(sock, {"v": dataplane.VERSION, "id": sdk_id, "token": token,
                                      **request})
        reply = dataplane.recv_message(sock)
    except (OSError, ValueError) as e:
        sock.close()
        raise _lost(record, e) from None
    if not reply.get("ok"):
        sock.close()
        raise _refusal(reply)
    sock.settimeout(None)
    return sock


def _refusal(reply: Mapping[str, Any]) -> Exception:
    if reply.get("error") == "OSError":  # a watch's directory: as the local watch raises
        return OSError(int(reply.get("errno") or 0), str(reply.get("message")))
    return dataplane.error_of(reply)


async def _read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    (n,) = struct.unpack(">I", await reader.readexactly(4))
    if not 1 <= n <= dataplane.MAX_FRAME:
        raise ValueError(f"a stream message of {n} bytes")
    body = await reader.readexactly(n)
    return body[:1], body[1:]


def start_request(cmd: Any, kwargs: Mapping[str, Any], pty: tuple[int, int] | None
                  ) -> dict[str, Any]:
    wire = dataplane.exec_request("", "", cmd, kwargs)
    return {"op": "start", "cmd": cmd, "kwargs": wire["kwargs"],
            "pty": list(pty) if pty is not None else None}


def connect_port(record: SandboxRecord, sdk_id: str, port: int, timeout: float = 10.0
                 ) -> socket.socket:
    """A blocking socket connected to ``port`` on ``127.0.0.1`` inside the sandbox."""
    return open_stream(record, sdk_id, {"op": "port", "port": port, "timeout": timeout},
                       "a port", timeout + 5.0)


class _Controls:
    """Stdin, signals and resize of a command, as messages on its stream."""

    _pty: tuple[int, int] | None
    _notice: str | None = None
    _eof = False

    def _send(self, kind: bytes, payload: bytes = b"") -> None:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        raise NotImplementedError

    def _refused(self) -> None:
        notice, self._notice = self._notice, None
        if notice is not None:
            raise RuntimeShimError(f"the node refused an input of the command: {notice}")

    def write_stdin(self, data: bytes | str) -> None:
        """Send ``data`` to the command's stdin (``RuntimeShimError`` once it is closed, or
        when the node refused an earlier input)."""
        self._refused()
        if self._eof or self.done:
            raise RuntimeShimError("the command's stdin is closed")
        raw = data.encode() if isinstance(data, str) else bytes(data)
        for i in range(0, len(raw), CHUNK):
            self._send(b"i", raw[i:i + CHUNK])

    def close_stdin(self) -> None:
        """EOF on the command's stdin, after what was written."""
        if not (self._eof or self.done):
            self._eof = True
            self._send(b"c")

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Signal the command's process group (nothing once it ended)."""
        if not 0 < int(sig) < 65:
            raise RuntimeShimError(f"signal {sig} is not a signal number")
        if not self.done:
            self._send(b"s", struct.pack(">I", int(sig)))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def resize(self, rows: int, cols: int) -> None:
        """Resize the terminal of a command started with ``pty=``."""
        if self._pty is None:
            raise RuntimeShimError("resize needs a command started with pty=(rows, cols)")
        if not (1 <= rows <= 4096 and 1 <= cols <= 4096):
            raise RuntimeShimError(f"a terminal of {rows}x{cols} (rows and cols 1..4096)")
        if not self.done:
            self._send(b"r", struct.pack(">HH", rows, cols))

    @property
    def pty(self) -> tuple[int, int] | None:
        """The terminal's size at the start, None for a command without one."""
        return self._pty


def _reset_on_close(sock: Any) -> None:
    """Closing ``sock`` resets the connection (unsent bytes are dropped, not waited for)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class FleetProcess(_Controls):
    """A command running in a fleet sandbox (``FleetSandbox.start``): its output callbacks
    run in a thread of its own; its methods may be called from any thread."""

    def __init__(self, sock: socket.socket, record: SandboxRecord, *,
                 on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                 pty: tuple[int, int] | None) -> None:
        self._sock, self._record, self._pty = sock, record, pty
        self._outputs = {b"o": on_stdout, b"e": on_stderr}
        self._sending = threading.Lock()
        self._result: ExecResult | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._read, name="fleet-process", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                kind, payload = recv_frame(self._sock, dataplane.MAX_FRAME)
                if kind == b"x":
                    self._result = read_exit(payload)
                    return
                if kind == b"n":
                    self._notice = payload.decode(errors="replace")
                elif (cb := self._outputs.get(kind)) is not None:
                    cb(payload)
        except (OSError, ValueError) as e:
            self._error = _lost(self._record, e)
        except BaseException as e:  # noqa: BLE001 - a callback's, or the node's error
            self._error = e
        finally:
            self._sock.close()  # after the exit: the node keeps nothing
            self._done.set()

    def _send(self, kind: bytes, payload: bytes = b"") -> None:
        try:
            with self._sending:
                self._sock.sendall(struct.pack(">I", len(payload) + 1) + kind + payload)
        except OSError as e:
            if not self.done:
                raise _lost(self._record, e) from None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> ExecResult:
        """The command's result once it ended; ``TimeoutError`` if that takes longer than
        ``timeout`` seconds (the command runs on)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the command did not end within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None, "an ended stream has a result (a bug)"
        return self._result

    def cancel(self) -> None:
        """Hang up: the node kills the command's group (the connection is reset, so the node
        sees it even while stdin it has not read fills the way)."""
        with contextlib.suppress(OSError):
            _reset_on_close(self._sock)
            self._sock.shutdown(socket.SHUT_RDWR)  # the reader thread wakes and closes it


class AsyncFleetProcess(_Controls):
    """A command running in a fleet sandbox (``AsyncFleetSandbox.start``), driven by a task
    of the event loop it was started on (output callbacks run in it)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 record: SandboxRecord, *, on_stdout: OutputCallback | None,
                 on_stderr: OutputCallback | None, pty: tuple[int, int] | None) -> None:
        self._reader, self._writer, self._record, self._pty = reader, writer, record, pty
        self._outputs = {b"o": on_stdout, b"e": on_stderr}
        self._task = asyncio.get_running_loop().create_task(self._read())
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _read(self) -> ExecResult:
        try:
            while True:
                kind, payload = await _read_frame(self._reader)
                if kind == b"x":
                    return read_exit(payload)
                if kind == b"n":
                    self._notice = payload.decode(errors="replace")
                elif (cb := self._outputs.get(kind)) is not None:
                    cb(payload)
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            raise _lost(self._record, e) from None
        finally:
            self._writer.close()

    def _send(self, kind: bytes, payload: bytes = b"") -> None:
        if self._writer.transport.get_write_buffer_size() > MAX_INPUT:
            raise RuntimeShimError("the command has over a MiB of stdin unsent",
                                   hint="wait for it to read, or close its stdin")
        self._writer.write(struct.pack(">I", len(payload) + 1) + kind + payload)

    @property
    def done(self) -> bool:
        return self._task.done()

    async def wait(self) -> ExecResult:
        """The command's result once it ended."""
        return await asyncio.shield(self._task)

    async def cancel(self) -> None:
        """Hang up: the node kills the command's group; returns once the stream closed."""
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                _reset_on_close(sock)
        self._writer.transport.abort()  # not waiting for unsent stdin to go out
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - ending it is the point
            pass


async def open_async(record: SandboxRecord, sdk_id: str, request: Mapping[str, Any],
                     what: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``open_stream`` on the event loop: the connection's reader and writer."""
    addr, token = _target(record, what)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*addr), 5.0)
    except (TimeoutError, OSError) as e:
        raise _lost(record, e) from None
    try:
        body = json.dumps({"v": dataplane.VERSION, "id": sdk_id, "token": token, **request},
                          separators=(",", ":")).encode()
        writer.write(struct.pack(">I", len(body)) + body)
        (n,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), 30.0))
        reply = json.loads(await reader.readexactly(min(n, dataplane.MAX_FRAME)))
    except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError) as e:
        writer.close()
        raise _lost(record, e) from None
    if not reply.get("ok"):
        writer.close()
        raise _refusal(reply)
    return reader, writer


async def start_async(record: SandboxRecord, sdk_id: str, request: Mapping[str, Any], *,
                      on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                      pty: tuple[int, int] | None) -> AsyncFleetProcess:
    """``request`` (a ``start``) on a connection of the event loop: its ``AsyncFleetProcess``."""
    reader, writer = await open_async(record, sdk_id, request, "a started command")
    return AsyncFleetProcess(reader, writer, record, on_stdout=on_stdout, on_stderr=on_stderr,
                             pty=pty)


class FleetWatch:
    """A directory watch of a fleet sandbox (``FleetSandbox.watch``): ``DirWatch``'s
    ``wait(timeout)`` (the events that came, waiting up to ``timeout`` seconds for one) and
    ``close()``. A lost connection ends it with an ``overflow`` event."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._closed = False

    def wait(self, timeout: float | None = None) -> list[WatchEvent]:
        if self._closed:
            return []
        self._sock.settimeout(timeout)
        try:
            kind, payload = recv_frame(self._sock, dataplane.MAX_FRAME)
        except TimeoutError:
            return []
        except (OSError, ValueError):
            self.close()
            return [WatchEvent("overflow", "")]
        return [WatchEvent(str(k), str(n)) for k, n in json.loads(payload)] \
            if kind == b"w" else []

    def close(self) -> None:
        self._closed = True
        self._sock.close()


#: Events a watch holds unread; past that it stops reading (the node's then overflow).
MAX_PENDING_EVENTS = 10_000


class AsyncFleetWatch:
    """A directory watch of a fleet sandbox (``AsyncFleetSandbox.watch``): ``DirWatch``'s
    ``await next_events()``, ``read()``, ``fileno()`` (-1 once closed) and ``close()``. A lost
    connection ends it with an ``overflow`` event (watch again)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._events: list[WatchEvent] = []
        self._ready = asyncio.Event()
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while len(self._events) <= MAX_PENDING_EVENTS:
                kind, payload = await _read_frame(self._reader)
                if kind == b"w":
                    self._events.extend(WatchEvent(str(k), str(n))
                                        for k, n in json.loads(payload))
                    self._ready.set()
        except (OSError, ValueError, TypeError, asyncio.IncompleteReadError):
            pass
        if not self._closed:  # lost, or too many unread: the watch's end, said so
            self._events.append(WatchEvent("overflow", ""))
            self.close()

    async def next_events(self) -> list[WatchEvent]:
        """The events that came since the last call, waiting for one; [] once closed."""
        while not self._events and not self._closed:
            self._ready.clear()
            await self._ready.wait()
        return self.read()

    def read(self) -> list[WatchEvent]:
        out, self._events = self._events, []
        return out

    def fileno(self) -> int:
        return -1 if self._closed else 0

    def close(self) -> None:
        self._closed = True
        self._ready.set()
        self._writer.close()
        if asyncio.current_task() is not self._task:
            self._task.cancel()


async def watch_async(record: SandboxRecord, sdk_id: str, path: str, recursive: bool
                      ) -> AsyncFleetWatch:
    reader, writer = await open_async(record, sdk_id, {"op": "watch", "path": path,
                                                       "recursive": recursive}, "a watch")
    return AsyncFleetWatch(reader, writer)


__all__ = ["MAX_PENDING_EVENTS", "AsyncFleetProcess", "AsyncFleetWatch", "FleetProcess",
           "FleetWatch",
           "connect_port", "no_data_plane", "open_async", "open_stream", "start_async",
           "start_request", "watch_async"]
