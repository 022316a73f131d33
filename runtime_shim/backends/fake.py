"""``FakeBackend``: a sandbox backend with no runtime behind it, for fast tests of the SDK.

It implements the backend protocols (``runtime_shim.backends.base``) and counts every call
(``FakeBackend.calls``, a ``Counter`` of ``"create"``, ``"exec"``, ``"close"``, …). Its
sandboxes still speak the real agent protocol to the SDK: ``connect`` returns one end of a
socketpair whose ``send`` decodes the request frames and, at STDIN_EOF, writes the reply of
``FakeBackend.handler`` (``FakeReply``) as agent frames into the other end, so ``Sandbox.exec``
and ``AsyncSandbox.exec`` run the real exchange (``runtime_shim.isolation.agent``) over a real fd. A
reply with ``delay`` is written by one scheduler thread of the backend, never a thread per exec.

``fake_lock(store)`` stores a lock with no layers (``env/fake``) to create fake sandboxes of.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from envbuild.errors import SandboxNotFound
from envbuild.oci import MEDIA_TYPE_MANIFEST
from envbuild.store import Store, put_json
from runtime_shim.backends.base import CreateRequest
from runtime_shim.isolation import agent
from runtime_shim.node.admission import Reservation
from runtime_shim.node.layout import NodeLayout, SandboxPaths
from runtime_shim.node.locks import ResolvedLock
from runtime_shim.node.model import Limits

FAKE_REF = "env/fake"


@dataclasses.dataclass(frozen=True)
class FakeReply:
    """What a fake command does: ``chunks`` of ``("stdout"|"stderr", bytes)`` in order, then
    ``exit_code``; ``delay`` seconds before any of it; ``timed_out`` ends it as the agent ends a
    command past its timeout (SIGKILL, exit 124)."""

    chunks: Sequence[tuple[str, bytes]] = ()
    exit_code: int = 0
    delay: float = 0.0
    timed_out: bool = False


def echo_handler(req: agent.ExecRequest, stdin: bytes) -> FakeReply:
    """The default handler: ``/bin/sh -c CMD`` prints CMD; otherwise prints argv; stdin goes
    back on stdout."""
    text = req.argv[2] if req.argv[:2] == ("/bin/sh", "-c") else " ".join(req.argv)
    return FakeReply(chunks=[("stdout", text.encode() + b"\n")] + ([("stdout", stdin)]
                                                                  if stdin else []))


class _Scheduler:
    """One thread that runs delayed replies at their time (for every fake sandbox)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None

    def at(self, when: float, fn: Callable[[], None]) -> None:
        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, (when, self._seq, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="fake-agent-scheduler")
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(None if not self._heap
                                    else self._heap[0][0] - time.monotonic())
                _, _, fn = heapq.heappop(self._heap)
            with contextlib.suppress(OSError):  # the host hung up first
                fn()


class _FakeConn:
    """The host's end of a fake agent connection (what ``connect`` returns)."""

    def __init__(self, sandbox: FakeSandbox) -> None:
        self._sandbox = sandbox
        self._sock, self._peer = socket.socketpair()
        self._rx = bytearray()
        self._argv: list[str] = []
        self._env: dict[str, str] = {}
        self._cwd: str | None = None
        self._user: str | None = None
        self._stdin = bytearray()

    def fileno(self) -> int:
        return self._sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self._sock.setblocking(flag)

    def recv(self, n: int) -> bytes:
        return self._sock.recv(n)

    def send(self, data: bytes | memoryview) -> int:
        self._rx += data
        while len(self._rx) >= 5:
            kind, n = self._rx[0], int.from_bytes(self._rx[1:5], "big")
            if len(self._rx) < 5 + n:
                break
            payload = bytes(self._rx[5:5 + n])
            del self._rx[:5 + n]
            self._request_frame(kind, payload)
        return len(data)

    def sendall(self, data: bytes) -> None:
        self.send(data)

    def _request_frame(self, kind: int, payload: bytes) -> None:
        if kind == agent.T_HELLO:  # answered with the version asked for, as the agent does
            self._peer.sendall(agent.frame(agent.R_HELLO, payload[:4] + b"fake"))
        elif kind == agent.T_ARG:
            self._argv.append(payload.decode())
        elif kind == agent.T_ENV:
            k, _, v = payload.decode().partition("=")
            self._env[k] = v
        elif kind == agent.T_CWD:
            self._cwd = payload.decode()
        elif kind == agent.T_USER:
            self._user = payload.decode()
        elif kind == agent.T_STDIN:
            self._stdin += payload
        elif kind == agent.T_STDIN_EOF:
            req = agent.ExecRequest(argv=tuple(self._argv), env=self._env, cwd=self._cwd,
                                    user=self._user)
            self._sandbox.requests.append(req)
            reply = self._sandbox.backend.handler(req, bytes(self._stdin))
            if reply.delay:
                self._sandbox.backend.scheduler.at(time.monotonic() + reply.delay,
                                                   lambda: self._answer(reply))
            else:
                self._answer(reply)

    def _answer(self, reply: FakeReply) -> None:
        out = b"".join(agent.frame(agent.R_STDOUT if stream == "stdout" else agent.R_STDERR,
                                   data) for stream, data in reply.chunks)
        if reply.timed_out:
            code, flags, sig = 128 + 9, agent.F_SIGNALED | agent.F_TIMED_OUT, 9
        else:
            code, flags, sig = reply.exit_code, 0, 0
        out += agent.frame(agent.R_EXIT, code.to_bytes(4, "big") + bytes([flags, sig]))
        self._peer.sendall(out)
        self._peer.close()

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(OSError):
            self._peer.close()


class FakeSandbox:
    """A fake sandbox: files in a dict, execs answered by the backend's handler."""

    def __init__(self, backend: FakeBackend, sandbox_id: str, paths: SandboxPaths,
                 lock: ResolvedLock, limits: Limits) -> None:
        self.backend = backend
        self.id = sandbox_id
        self.paths = paths
        self.lock = lock
        self.limits = limits
        self.files: dict[str, bytes] = {}
        self.requests: list[agent.ExecRequest] = []
        self.closed = False
        self.quiesced = 0

    def connect(self) -> socket.socket:
        self.backend.calls["connect"] += 1
        return _FakeConn(self)  # type: ignore[return-value]  # duck-typed for _Exchange

    def exec(self, req: agent.ExecRequest, *, on_stdout: agent.OutputCallback | None = None,
             on_stderr: agent.OutputCallback | None = None) -> agent.ExecOutcome:
        self.backend.calls["exec"] += 1
        return agent.run(self.connect, req, self.limits.output_bytes,
                         deadline=self.limits.exec_timeout, on_stdout=on_stdout,
                         on_stderr=on_stderr)

    def read_file(self, path: str) -> bytes:
        self.backend.calls["read_file"] += 1
        return self.files[path]

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        self.backend.calls["write_file"] += 1
        self.files[path] = data

    def close(self) -> None:
        self.backend.calls["close"] += 1
        self.closed = True
        self.backend.running.pop(self.id, None)

    @contextlib.contextmanager
    def quiesce(self) -> Iterator[None]:
        self.backend.calls["quiesce"] += 1
        self.quiesced += 1
        try:
            yield
        finally:
            self.quiesced -= 1

    def upper_dir(self) -> Path:
        """A plain dir under the sandbox's own dir: tests put the "changes" there."""
        upper = self.paths.root / "fake-upper"
        upper.mkdir(exist_ok=True)
        return upper


class FakeBackend:
    """A ``Backend`` with call counters (register it: ``backend.register("fake", fb)``)."""

    name = "fake"

    def __init__(self, handler: Callable[[agent.ExecRequest, bytes], FakeReply] = echo_handler,
                 *, fail_create: BaseException | None = None) -> None:
        self.handler = handler
        self.fail_create = fail_create
        self.calls: collections.Counter[str] = collections.Counter()
        self.running: dict[str, FakeSandbox] = {}
        self.scheduler = _Scheduler()

    def __call__(self) -> FakeBackend:  # so the instance itself is the registry's factory
        return self

    def check(self, *, keep: bool, seccomp: str | Mapping | None, lazy: bool) -> None:
        self.calls["check"] += 1

    def host_reservation(self, limits: Limits) -> Reservation:
        """``backend.HostCosted``: a fake takes nothing of the host (admission lets any number
        in; ``runtime_shim.node.admission`` has its own tests)."""
        return Reservation()

    def create(self, req: CreateRequest) -> FakeSandbox:
        self.calls["create"] += 1
        if self.fail_create is not None:
            (req.paths.root / "half-made").write_text("x")  # the SDK must remove it
            raise self.fail_create
        sb = FakeSandbox(self, req.id, req.paths, req.lock, req.limits)
        self.running[req.id] = sb
        return sb

    def attach(self, paths: SandboxPaths, layout: NodeLayout, lock: ResolvedLock,
               runtime: str) -> FakeSandbox:
        self.calls["attach"] += 1
        sb = self.running.get(paths.id)
        if sb is None:
            raise SandboxNotFound(f"sandbox {paths.id} is not running")
        return sb

    def remove(self, layout: NodeLayout, sandbox_id: str, runtime: str) -> None:
        self.calls["remove"] += 1
        sb = self.running.pop(sandbox_id, None)
        if sb is not None:
            sb.closed = True


def fake_lock(store: Store, ref: str = FAKE_REF, *, env: Mapping[str, str] | None = None,
              user: str = "1000:1000", workdir: str = "/workspace") -> str:
    """Store a lock of no layers under ``ref``; its digest."""
    config = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers",
                                                                 "diff_ids": []},
              "config": {"Env": [f"{k}={v}" for k, v in (env or {"PATH": "/bin"}).items()],
                         "User": user, "WorkingDir": workdir}}
    cdesc = put_json(store, config, media_type="application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": MEDIA_TYPE_MANIFEST,
                "config": {"mediaType": cdesc.media_type, "digest": cdesc.digest,
                           "size": cdesc.size}, "layers": []}
    mdesc = put_json(store, manifest)
    store.put_ref(ref, mdesc.digest)
    return mdesc.digest
