"""The fleet's data plane: exec and file calls from a client straight to a node daemon over a
TCP connection, authenticated by a per-sandbox token, with Ray staying the control plane
(issue 39, item 5: an exec through Ray pays an actor call on top of the local exec).

A daemon started with ``DaemonConfig.data_host`` listens on that address (an ephemeral port;
``127.0.0.1`` on one host, the node's cluster address on many) and gives every sandbox a
256-bit token when it is handed to a caller (create, claim, attach, renew). The record it
returns to that caller carries ``data_addr`` and ``token`` (``list`` never does); a
``FleetSandbox`` with both sends ``exec`` (without output callbacks), ``read_file`` and
``write_file`` over the connection instead of Ray, and uses Ray when the daemon cannot be
reached (nothing was sent then).

Wire format (version 1): each message is a 4-byte big-endian length and that many bytes of
JSON (``MAX_FRAME`` at most; a larger length closes the connection). A request is ``{"v": 1,
"op": "exec"|"read"|"write", "id": SDK-ID, "token": HEX, ...}`` (exec: ``cmd``, ``kwargs``
with ``timeout``, ``env``, ``cwd``, ``user``, ``stdin`` in base64; write: ``path``, ``data`` in
base64, ``mode``; read: ``path``); the answer is ``{"ok": true, ...}`` (exec: the
``ExecResult``'s fields, outputs in base64; read: ``data``) or ``{"ok": false, "error": CLASS,
"message", "hint"}``. The token is compared in constant time before anything else of the
request is used; a wrong token, another sandbox's, and an unknown sandbox get the same answer
(``SandboxNotFound``). The connection carries one call at a time; a client keeps one per
node and thread.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import json
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import envbuild.errors as errors_module
from envbuild.errors import EnvbuildError, ExecTimeout, NodeLost, RuntimeShimError, SandboxNotFound
from runtime_shim.node.model import ExecResult, check_timed_out

VERSION = 1
#: The largest message either side accepts (a file written or read whole).
MAX_FRAME = 64 << 20
#: Connections a daemon serves at once (one thread each); more are closed as they come.
MAX_CONNECTIONS = 1024
_EXEC_KEYS = ("timeout", "env", "cwd", "user")
#: Requests that turn their connection into a stream (``runtime_shim.fleet.streams``).
STREAM_OPS = ("start", "port", "watch")


def send_message(sock: socket.socket, obj: Mapping[str, Any]) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> Any:
    (n,) = struct.unpack(">I", recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ConnectionError(f"a message of {n} bytes (at most {MAX_FRAME})")
    return json.loads(recv_exact(sock, n))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# -- the daemon's side --------------------------------------------------------------------

class DataServer:
    """A daemon's listener (module docstring): one thread per connection, each request
    answered by ``answer(request) -> reply``; a request of ``STREAM_OPS`` is handed to
    ``stream(connection, request)``, which has the connection to its end."""

    def __init__(self, host: str, answer: Callable[[Mapping[str, Any]], dict[str, Any]],
                 stream: Callable[[socket.socket, Mapping[str, Any]], None] | None = None
                 ) -> None:
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._answer = answer
        self._stream = stream
        self._closed = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        threading.Thread(target=self._accept, name="fleet-data-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # a flood of idle connections costs no thread
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="fleet-data",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.ExitStack() as done:
            done.callback(self._slots.release)
            while True:
                try:
                    request = recv_message(conn)
                except (OSError, ValueError):
                    return  # closed, oversize or not JSON: the connection ends
                if (self._stream is not None and isinstance(request, dict)
                        and request.get("v") == VERSION and request.get("op") in STREAM_OPS):
                    self._stream(conn, request)
                    return
                send_message(conn, self._reply(request))

    def _reply(self, request: Any) -> dict[str, Any]:
        try:
            if not isinstance(request, dict) or request.get("v") != VERSION:
                raise RuntimeShimError("unknown data-plane request version",
                                       hint=f"this daemon speaks version {VERSION}")
            return {"ok": True, **self._answer(request)}
        except EnvbuildError as e:
            return error_reply(e)
        except Exception as e:  # noqa: BLE001 - a bad request, answered, never fatal
            return {"ok": False, "error": "RuntimeShimError",
                    "message": f"bad data-plane request: {type(e).__name__}", "hint": None}

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()


def error_reply(e: EnvbuildError) -> dict[str, Any]:
    """The answer that carries ``e`` to the client (raised there as its class)."""
    return {"ok": False, "error": type(e).__name__, "message": e.message, "hint": e.hint}


def check_token(expected: str | None, given: Any, sandbox_id: str) -> None:
    """``SandboxNotFound`` unless ``given`` is the sandbox's token (constant time)."""
    if not (expected and isinstance(given, str)
            and hmac.compare_digest(expected.encode(), given.encode())):
        raise SandboxNotFound(f"no sandbox {sandbox_id} for this token",
                              hint="use the record its create or attach returned")


class DataDaemon(Protocol):
    """What ``answer`` needs of a node daemon (``runtime_shim.fleet.daemon.NodeDaemon``)."""

    def data_token(self, sandbox_id: str) -> str | None: ...

    def exec(self, sandbox_id: str, cmd: Any, kwargs: Mapping[str, Any]) -> ExecResult: ...

    def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None: ...


def answer(daemon: DataDaemon, request: Mapping[str, Any]) -> dict[str, Any]:
    """One request on ``daemon`` (module docstring), its token checked before anything else
    of it is used."""
    sandbox_id = str(request.get("id"))
    check_token(daemon.data_token(sandbox_id), request.get("token"), sandbox_id)
    op, path = request.get("op"), request.get("path")
    if op == "exec":
        cmd = request.get("cmd")
        if not (isinstance(cmd, str) or (isinstance(cmd, list) and cmd
                                         and all(isinstance(x, str) for x in cmd))):
            raise RuntimeShimError("an exec's command is a string or a list of strings")
        return result_fields(daemon.exec(sandbox_id, cmd, exec_kwargs(request)))
    if op == "read" and isinstance(path, str):
        return {"data": _b64(daemon.read_file(sandbox_id, path))}
    if op == "write" and isinstance(path, str):
        daemon.write_file(sandbox_id, path, base64.b64decode(request["data"], validate=True),
                          int(request.get("mode", 0o644)))
        return {}
    raise RuntimeShimError(f"unknown data-plane request {op!r}")


def exec_kwargs(request: Mapping[str, Any]) -> dict[str, Any]:
    """``Sandbox.exec``'s keyword arguments of an exec request (only those it may set)."""
    raw = request.get("kwargs") or {}
    kwargs = {k: raw[k] for k in _EXEC_KEYS if raw.get(k) is not None}
    if raw.get("stdin") is not None:
        kwargs["stdin"] = base64.b64decode(raw["stdin"], validate=True)
    return kwargs


def result_fields(result: ExecResult) -> dict[str, Any]:
    return {"exit_code": result.exit_code, "stdout": _b64(result.stdout),
            "stderr": _b64(result.stderr), "duration": result.duration,
            "timed_out": result.timed_out, "output_truncated": result.output_truncated}


# -- the client's side --------------------------------------------------------------------

class Unreachable(Exception):
    """The daemon's data address does not answer a connect: nothing was sent."""


_local = threading.local()


def call(address: tuple[str, int], request: dict[str, Any], timeout: float, node_id: str
         ) -> dict[str, Any]:
    """One request on this thread's connection to ``address``: the reply's fields, the
    daemon's error raised as its class, ``Unreachable`` when no connection could be made,
    ``NodeLost`` when it broke during the call."""
    conns: dict[tuple[str, int], socket.socket] = _local.__dict__.setdefault("conns", {})
    sock = conns.get(address)
    if sock is None:
        try:
            sock = socket.create_connection(address, timeout=5.0)
        except OSError as e:
            raise Unreachable(str(e)) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns[address] = sock
    try:
        sock.settimeout(timeout)
        send_message(sock, {"v": VERSION, **request})
        reply = recv_message(sock)
    except (OSError, ValueError) as e:
        conns.pop(address, None)
        with contextlib.suppress(OSError):
            sock.close()
        raise NodeLost(f"the data connection to node {node_id[:12]} broke during a call: {e}",
                       node_id=node_id, hint="the node or its daemon may be gone; "
                                             "`envbuild fleet nodes` shows the live ones") from None
    if not reply.get("ok"):
        raise error_of(reply)
    return reply


def error_of(reply: Mapping[str, Any]) -> EnvbuildError:
    cls = getattr(errors_module, str(reply.get("error")), None)
    if not (isinstance(cls, type) and issubclass(cls, EnvbuildError)) or cls is ExecTimeout:
        cls = RuntimeShimError
    return cls(str(reply.get("message")), hint=reply.get("hint"))


def exec_request(sandbox_id: str, token: str, cmd: Any, kwargs: Mapping[str, Any]
                 ) -> dict[str, Any]:
    wire = {k: kwargs[k] for k in _EXEC_KEYS if kwargs.get(k) is not None}
    if kwargs.get("stdin") is not None:
        wire["stdin"] = _b64(kwargs["stdin"])
    return {"op": "exec", "id": sandbox_id, "token": token, "cmd": cmd, "kwargs": wire}


def exec_result(reply: Mapping[str, Any], sandbox_id: str, check_timeout: bool) -> ExecResult:
    result = ExecResult(exit_code=int(reply["exit_code"]),
                        stdout=base64.b64decode(reply["stdout"]),
                        stderr=base64.b64decode(reply["stderr"]),
                        duration=float(reply["duration"]), timed_out=bool(reply["timed_out"]),
                        output_truncated=bool(reply["output_truncated"]))
    return check_timed_out(result, sandbox_id) if check_timeout else result


__all__ = ["MAX_CONNECTIONS", "MAX_FRAME", "STREAM_OPS", "VERSION", "DataDaemon", "DataServer",
           "Unreachable", "answer", "call", "check_token", "error_of", "error_reply",
           "exec_kwargs",
           "exec_request", "exec_result", "recv_exact", "recv_message", "result_fields",
           "send_message"]
