"""Byte streams over the fleet's data plane (``runtime_shim.fleet.dataplane``), the node's
side: a ``start`` request turns its connection into a framed duplex stream to a command
started in the sandbox (``Sandbox.start``), a ``port`` request into raw bytes spliced to a
port inside the sandbox (``Sandbox.connect_port``), a ``watch`` request into a stream of a
directory's events (``Sandbox.watch``).

A stream request is a data-plane request (``{"v": 1, "op": "start"|"port"|"watch", "id",
"token", ...}``) whose token is checked as every request's; the daemon answers it with one JSON
message (``{"ok": true}``, or the error, after which the connection closes) and the
connection then carries the stream until either side closes it.

``start`` (``cmd``, ``kwargs``: ``timeout``, ``env``, ``cwd``, ``user``; ``stdin`` in
base64, written first; ``pty``: ``[rows, cols]`` or null): from then on each message is a
4-byte big-endian length and that many bytes, the first a kind. The node sends ``o``/``e``
(stdout/stderr bytes, a PTY's on ``o``), ``n`` (a notice: an input the command refused, UTF-8)
and finally ``x`` (the ``ExecResult``: its fields as JSON, its outputs raw after;
``exit_message``); the client sends ``i`` (stdin bytes), ``c`` (close stdin), ``s`` (a
signal: 4 bytes), ``r`` (a resize: rows and cols, 2 bytes each). **The command lives as
long as its stream**: a client that closes the connection (or loses it) before the ``x``
kills the command's group, as a local ``AsyncProcess.cancel`` does — nothing is left running
that nobody can reach. Whoever wants a command to outlive a client's connection keeps the
stream open itself (``envbuild serve --fleet`` keeps it in its process table, so E2B background commands and
``Connect`` work as on one node).

``watch`` (``path``, ``recursive``): the node sends ``w`` messages, each a JSON list of
``[kind, name]`` events (``Sandbox.watch``'s) as they come, until the client closes the
connection; a directory that is not there is answered with its ``errno``. A client that does
not read stops the reading (the kernel's queue then overflows: an ``overflow`` event).

``port`` (``port``, ``timeout``): the connection is then spliced to a TCP connection made to
``127.0.0.1:port`` in the sandbox's network namespace; an EOF is passed on as a half-close.

Bounds: a client's message is at most ``MAX_INPUT`` bytes (a larger one ends the stream);
stdin is handed to the command's session once it has room (``MAX_PENDING_STDIN``), the
connection unread meanwhile, so a client writing faster than the command reads is held back
by TCP; output is written to the connection as the command makes it, so a client that does not read
stops the command's output (back-pressure through the agent, nothing queued on the node); a
sandbox has at most ``MAX_STREAMS`` streams (commands, ports, watches) open and a node
``MAX_NODE_STREAMS`` (``StreamLimit`` past that), half the data plane's ``MAX_CONNECTIONS``
(every stream holds one), so exec and file calls keep the other half.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from envbuild.errors import EnvbuildError, RuntimeShimError
from runtime_shim.fleet import dataplane
from runtime_shim.isolation.agent_session import MAX_PENDING_STDIN
from runtime_shim.node.model import ExecResult

#: The largest message a client may send on a stream (a stdin chunk).
MAX_INPUT = 1 << 20
#: Streams (commands, ports, watches) a sandbox has open at once.
MAX_STREAMS = 256
#: Streams a node has open at once, all its sandboxes' (the rest of the data plane's
#: ``MAX_CONNECTIONS`` stay for exec and file calls).
MAX_NODE_STREAMS = 512
#: Bytes of stdin a client sends in one message.
CHUNK = 64 << 10
#: Seconds between looks at a command's unsent stdin while it has no room for more.
STDIN_POLL = 0.002


class StreamLimit(RuntimeShimError):
    """A sandbox has ``MAX_STREAMS`` streams open."""


def send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    sock.sendall(struct.pack(">I", len(payload) + 1) + kind + payload)


def recv_frame(sock: socket.socket, limit: int) -> tuple[bytes, bytes]:
    """The next message's kind and payload; ``ConnectionError`` at an EOF or past ``limit``."""
    (n,) = struct.unpack(">I", dataplane.recv_exact(sock, 4))
    if not 1 <= n <= limit:
        raise ConnectionError(f"a stream message of {n} bytes (1..{limit})")
    body = dataplane.recv_exact(sock, n)
    return body[:1], body[1:]


def exit_message(result: ExecResult | None, error: Mapping[str, Any] | None = None) -> bytes:
    """An ``x`` message's payload: a 4-byte length and that much JSON (the result's fields
    but its outputs, which follow raw: ``stdout`` bytes of stdout, then stderr; or the error's
    reply)."""
    if result is None:
        head, tail = dict(error or {}), b""
    else:
        head = {"exit_code": result.exit_code, "duration": result.duration,
                "timed_out": result.timed_out, "output_truncated": result.output_truncated,
                "stdout": len(result.stdout)}
        tail = result.stdout + result.stderr
    body = json.dumps(head, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body + tail


def read_exit(payload: bytes) -> ExecResult:
    """The ``ExecResult`` of an ``x`` message (``exit_message``); the node's error raised."""
    (n,) = struct.unpack(">I", payload[:4])
    head = json.loads(payload[4:4 + n])
    if head.get("ok") is False:
        raise dataplane.error_of(head)
    outputs, split = payload[4 + n:], int(head["stdout"])
    return ExecResult(exit_code=int(head["exit_code"]), stdout=outputs[:split],
                      stderr=outputs[split:], duration=float(head["duration"]),
                      timed_out=bool(head["timed_out"]),
                      output_truncated=bool(head["output_truncated"]))


class StreamDaemon(Protocol):
    """What a stream needs of a node daemon."""

    def data_token(self, sandbox_id: str) -> str | None: ...

    def data_sandbox(self, sandbox_id: str) -> Any: ...


class Streams:
    """A daemon's streams: ``serve(conn, request)`` runs one to its end (on the connection's
    thread), counting the sandbox's open ones."""

    def __init__(self, daemon: StreamDaemon) -> None:
        self.daemon = daemon
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def serve(self, conn: socket.socket, request: Mapping[str, Any]) -> None:
        try:
            sandbox_id = str(request.get("id"))
            dataplane.check_token(self.daemon.data_token(sandbox_id), request.get("token"),
                                  sandbox_id)
            sandbox = self.daemon.data_sandbox(sandbox_id)
            self._take(sandbox_id)
        except EnvbuildError as e:
            dataplane.send_message(conn, dataplane.error_reply(e))
            return
        try:
            if request.get("op") == "port":
                _serve_port(conn, sandbox, request)
            elif request.get("op") == "watch":
                _serve_watch(conn, sandbox, request)
            else:
                _serve_command(conn, sandbox, request)
        finally:
            with self._lock:
                self._open[sandbox_id] -= 1
                if not self._open[sandbox_id]:
                    del self._open[sandbox_id]

    def _take(self, sandbox_id: str) -> None:
        with self._lock:
            if self._open.get(sandbox_id, 0) >= MAX_STREAMS:
                raise StreamLimit(f"sandbox {sandbox_id} has {MAX_STREAMS} streams open",
                                  hint="end some of its commands, ports or watches first")
            if sum(self._open.values()) >= MAX_NODE_STREAMS:
                raise StreamLimit(f"this node has {MAX_NODE_STREAMS} streams open",
                                  hint="end some commands, ports or watches of its sandboxes "
                                       "first")
            self._open[sandbox_id] = self._open.get(sandbox_id, 0) + 1

    def count(self, sandbox_id: str) -> int:
        with self._lock:
            return self._open.get(sandbox_id, 0)


def _start_kwargs(request: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = dataplane.exec_kwargs(request)
    pty = request.get("pty")
    if pty is not None:
        rows, cols = pty
        kwargs["pty"] = (int(rows), int(cols))
    return kwargs


def _serve_command(conn: socket.socket, sandbox: Any, request: Mapping[str, Any]) -> None:
    """Start the command, relay its output and the client's input until it ended and the
    client closed, or kill it when the client left first."""
    argv = request.get("cmd")
    sending = threading.Lock()

    def send(kind: bytes, payload: bytes) -> None:
        with sending, contextlib.suppress(OSError):  # a client gone: the reader kills it
            send_frame(conn, kind, payload)

    with sending:  # the reply goes before the first output
        try:
            proc = _started(sandbox, argv, send, request)
        except EnvbuildError as e:
            dataplane.send_message(conn, dataplane.error_reply(e))
            return
        try:
            dataplane.send_message(conn, {"ok": True})
        except OSError:  # the client left at once
            proc.kill()
            return

    def finish() -> None:
        try:
            message = exit_message(proc.wait())
        except EnvbuildError as e:
            message = exit_message(None, dataplane.error_reply(e))
        send(b"x", message)

    threading.Thread(target=finish, name="fleet-stream-exit", daemon=True).start()
    _relay_input(conn, proc, send)


def _started(sandbox: Any, argv: Any, send: Callable[[bytes, bytes], None],
             request: Mapping[str, Any]) -> Any:
    if not (isinstance(argv, str) or (isinstance(argv, list) and argv
                                      and all(isinstance(x, str) for x in argv))):
        raise RuntimeShimError("a started command is a string or a list of strings")
    try:
        kwargs = _start_kwargs(request)
    except (TypeError, ValueError) as e:
        raise RuntimeShimError(f"bad start request: {type(e).__name__}") from None
    return sandbox.start(argv, on_stdout=lambda b: send(b"o", bytes(b)),
                         on_stderr=lambda b: send(b"e", bytes(b)), **kwargs)


def _write_stdin(conn: socket.socket, proc: Any, data: bytes) -> None:
    """``data`` to the command's stdin once its session has room for it: meanwhile this
    connection is not read, so a client writing faster than the command reads is held back
    by TCP (nothing is dropped, nothing more is queued); a client that hangs up meanwhile
    ends the stream (``ConnectionError``)."""
    hangup = select.poll()
    hangup.register(conn, select.POLLRDHUP)
    while not proc.done and proc.unsent_stdin + len(data) > MAX_PENDING_STDIN:
        if hangup.poll(0):
            raise ConnectionError("the client hung up")
        time.sleep(STDIN_POLL)
    proc.write_stdin(data)


def _relay_input(conn: socket.socket, proc: Any, send: Callable[[bytes, bytes], None]) -> None:
    """The client's messages to ``proc`` until the connection ends; then kill it unless it
    ended first."""
    controls: dict[bytes, Callable[[bytes], None]] = {
        b"i": lambda p: _write_stdin(conn, proc, p),
        b"c": lambda _: proc.close_stdin(),
        b"s": lambda p: proc.send_signal(struct.unpack(">I", p)[0]),
        b"r": lambda p: proc.resize(*struct.unpack(">HH", p)),
    }
    try:
        while True:
            kind, payload = recv_frame(conn, MAX_INPUT)
            control = controls.get(kind)
            if control is None:
                raise ConnectionError(f"unknown stream message {kind!r}")
            try:
                control(payload)
            except (EnvbuildError, struct.error) as e:
                note = e.message if isinstance(e, EnvbuildError) else "a malformed control"
                send(b"n", note.encode())
    except (OSError, ValueError):
        pass  # closed, oversize or unknown: the stream ends
    finally:
        if not proc.done:
            with contextlib.suppress(EnvbuildError, OSError):
                proc.kill()


def _serve_port(conn: socket.socket, sandbox: Any, request: Mapping[str, Any]) -> None:
    try:
        port, timeout = int(request["port"]), float(request.get("timeout") or 10.0)
        if not 1 <= port <= 65535:
            raise RuntimeShimError(f"port {port} is not a TCP port (1..65535)")
        inner = sandbox.connect_port(port, min(timeout, 60.0))
    except EnvbuildError as e:
        dataplane.send_message(conn, dataplane.error_reply(e))
        return
    except (KeyError, TypeError, ValueError) as e:
        dataplane.send_message(conn, dataplane.error_reply(RuntimeShimError(
            f"bad port request: {type(e).__name__}")))
        return
    with inner:
        inner.setblocking(True)
        inner.settimeout(None)
        dataplane.send_message(conn, {"ok": True})
        other = threading.Thread(target=_pipe, args=(inner, conn), name="fleet-port", daemon=True)
        other.start()
        _pipe(conn, inner)
        other.join()


def _serve_watch(conn: socket.socket, sandbox: Any, request: Mapping[str, Any]) -> None:
    """Send the watch's events as they come until the client closes (or sends anything)."""
    try:
        path = request["path"]
        if not isinstance(path, str):
            raise RuntimeShimError("a watch's path is a string")
        watch = sandbox.watch(path, recursive=bool(request.get("recursive")))
    except EnvbuildError as e:
        dataplane.send_message(conn, dataplane.error_reply(e))
        return
    except OSError as e:  # no such directory, not one: its errno goes to the client
        dataplane.send_message(conn, {"ok": False, "error": "OSError", "errno": e.errno,
                                      "message": e.strerror or str(e), "hint": None})
        return
    except KeyError:
        dataplane.send_message(conn, dataplane.error_reply(RuntimeShimError(
            "bad watch request: no path")))
        return
    ended = threading.Event()

    def hang_up() -> None:
        with contextlib.suppress(OSError):
            conn.recv(1)  # an EOF, or a message a watch does not take: the end
        ended.set()

    with contextlib.closing(watch):
        dataplane.send_message(conn, {"ok": True})
        threading.Thread(target=hang_up, name="fleet-watch", daemon=True).start()
        while not ended.is_set():
            events = watch.wait(0.5)
            if events:
                try:
                    send_frame(conn, b"w", json.dumps([[e.kind, e.name] for e in events],
                                                      separators=(",", ":")).encode())
                except OSError:
                    return


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until an EOF (passed on as a half-close) or an error (both
    closed)."""
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                dst.shutdown(socket.SHUT_WR)
                return
            dst.sendall(data)
    except OSError:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


__all__ = ["CHUNK", "MAX_INPUT", "MAX_NODE_STREAMS", "MAX_STREAMS", "StreamDaemon", "StreamLimit",
           "Streams", "exit_message", "read_exit", "recv_frame", "send_frame"]
