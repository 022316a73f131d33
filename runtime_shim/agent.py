"""The sandbox exec agent: build it, and speak its protocol from the host.

``envbuild-agent`` (``runtime_shim/agent/agent.c``) is a static C program that runs as PID 1
of a sandbox. It listens on a unix socket and runs one command per connection; the protocol
(version 1) is specified in ``runtime_shim/agent/README.md``. In short, frames are
``[type u8][len u32 big-endian][payload]``::

    host -> agent   HELLO(version u32) ARG* ENV* CWD? USER? TIMEOUT? START
                    then STDIN* STDIN_EOF, and KILL(signal u32) at any time
    agent -> host   HELLO(version u32, name) STDOUT* STDERR* then one of
                    EXIT(code u32, flags u8, signal u8) | START_FAILED(code u32, errno u32, msg)
                    | ERROR(msg)

Building: ``agent_binary(cache_dir)`` compiles ``agent.c`` with gcc against static glibc once per
source hash into ``<cache_dir>/agent/<key>/envbuild-agent`` (compile beside, rename into place),
so every sandbox on the host bind-mounts the same file.

Talking: ``run(connect, request, cap)`` sends an ``ExecRequest`` (plain data) over a fresh
connection and streams the answer into buffers bounded by ``cap``; ``connect_agent`` opens the
socket without following a link the sandbox may have planted in its ``run/`` directory.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

from envbuild.errors import RuntimeShimError

PROTOCOL_VERSION = 1
SOURCE = Path(__file__).with_name("agent") / "agent.c"
BINARY_NAME = "envbuild-agent"
CFLAGS = ("-static", "-O2", "-Wall", "-Wextra", "-Werror")
# The key covers what decides the binary's behaviour: the source and the flags. The compiler
# version is left out on purpose: another gcc builds the same program.
KEY_TAG = "envbuild.agent.v1"

# host -> agent
T_HELLO, T_ARG, T_ENV, T_CWD, T_USER, T_TIMEOUT, T_START, T_STDIN, T_STDIN_EOF, T_KILL = \
    range(0x01, 0x0B)
# agent -> host
R_HELLO, R_STDOUT, R_STDERR, R_EXIT, R_START_FAILED, R_ERROR = range(0x81, 0x87)
F_SIGNALED, F_TIMED_OUT, F_OUTPUT_OPEN = 1, 2, 4

MAX_PAYLOAD = 1 << 20
STDIN_CHUNK = 64 << 10
#: After the host-side deadline (or output cap) the command is killed; how long to wait for
#: the agent's EXIT before hanging up (a hang-up kills the command too, see ``run``).
KILL_WAIT = 5.0
#: The agent enforces ``timeout`` itself; the host's own deadline is this much later.
HOST_TIMEOUT_SLACK = 1.0


# ---- building ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _source_key() -> str:
    h = hashlib.sha256(KEY_TAG.encode())
    h.update(" ".join(CFLAGS).encode() + b"\0")
    h.update(SOURCE.read_bytes())
    return h.hexdigest()[:16]


def agent_binary(cache_dir: str | os.PathLike[str]) -> Path:
    """The agent binary for this source under ``cache_dir``, compiled on first use."""
    target = Path(cache_dir) / "agent" / _source_key() / BINARY_NAME
    if target.is_file():
        return target
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeShimError("build the sandbox agent: gcc is not installed",
                               hint="apt-get install gcc libc6-dev (or run scripts/setup.sh)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{BINARY_NAME}-{uuid.uuid4().hex[:8]}")
    argv = [gcc, *CFLAGS, "-o", str(tmp), str(SOURCE)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            output = (proc.stderr + proc.stdout).strip()
            hint = "run scripts/setup.sh"
            if "cannot find -lc" in output or "stdio.h" in output:
                hint = ("static linking needs glibc's static library and headers: "
                        "apt-get install libc6-dev (or run scripts/setup.sh)")
            raise RuntimeShimError(
                f"build the sandbox agent: gcc exited {proc.returncode}",
                context=f"$ {' '.join(argv)}\n{output[-3000:]}", hint=hint)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        tmp.replace(target)  # another process may have won: same bytes, either is fine
    finally:
        tmp.unlink(missing_ok=True)
    return target


# ---- talking -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExecRequest:
    """One command for the agent. ``env`` overrides the agent's (the lock's) environment;
    ``user`` is ``"uid[:gid]"``; ``timeout`` seconds or None."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    timeout: float | None = None
    stdin: bytes | None = None


@dataclasses.dataclass(frozen=True)
class ExecOutcome:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    output_truncated: bool = False
    signal: int = 0  # the signal that ended the command, 0 if it exited
    output_open: bool = False  # a background process still held stdout/stderr at the exit
    start_errno: int = 0  # set when the command never started (START_FAILED)


def frame(kind: int, payload: bytes = b"") -> bytes:
    return bytes((kind,)) + len(payload).to_bytes(4, "big") + payload


def encode_request(req: ExecRequest) -> bytes:
    """HELLO and every request frame up to START (stdin follows separately)."""
    parts = [frame(T_HELLO, PROTOCOL_VERSION.to_bytes(4, "big"))]
    parts += [frame(T_ARG, _text(a, "argument")) for a in req.argv]
    parts += [frame(T_ENV, _text(f"{k}={v}", "environment variable")) for k, v in req.env.items()]
    if req.cwd is not None:
        parts.append(frame(T_CWD, _text(req.cwd, "cwd")))
    if req.user is not None:
        parts.append(frame(T_USER, _text(req.user, "user")))
    if req.timeout is not None:
        ms = max(1, min(0xFFFFFFFF, int(req.timeout * 1000)))
        parts.append(frame(T_TIMEOUT, ms.to_bytes(4, "big")))
    parts.append(frame(T_START))
    return b"".join(parts)


def _text(value: str, what: str) -> bytes:
    data = os.fsencode(value)
    if b"\0" in data or len(data) > MAX_PAYLOAD:
        raise RuntimeShimError(f"exec: {what} {value[:60]!r} contains a NUL byte or is too long")
    return data


class _Bounded:
    """Output of one stream, keeping at most ``cap`` bytes."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.chunks: list[bytes] = []
        self.size = 0
        self.overflow = False

    def add(self, data: bytes) -> None:
        room = self.cap - self.size
        if len(data) > room:
            self.overflow = True
            data = data[:room]
        if data:
            self.chunks.append(data)
            self.size += len(data)

    def data(self) -> bytes:
        return b"".join(self.chunks)


def connect_agent(run_dir_fd: int, name: str = "agent.sock") -> socket.socket:
    """Connect to the agent's socket in a directory the sandbox can write to.

    The sandbox may replace the socket with a symlink to a host socket; so the entry is opened
    with ``O_PATH | O_NOFOLLOW`` relative to a directory fd held by the host, checked to be a
    socket, and connected through ``/proc/self/fd``: no path the sandbox controls is resolved
    on the host. (A socket that a process in the sandbox bound in its place would answer, but
    only with what that sandbox could already tell us.)"""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=run_dir_fd)
    except OSError as e:
        raise RuntimeShimError(f"connect to the sandbox agent: {e.strerror}") from e
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise RuntimeShimError("connect to the sandbox agent: agent.sock is not a socket",
                                   hint="a process in the sandbox replaced it")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(f"/proc/self/fd/{fd}")
        except OSError as e:
            sock.close()
            raise RuntimeShimError(f"connect to the sandbox agent: {e.strerror}") from e
        return sock
    finally:
        os.close(fd)


def run(connect: Callable[[], socket.socket], req: ExecRequest, cap: int) -> ExecOutcome:
    """Run ``req`` on a new connection and wait for it.

    stdout and stderr keep at most ``cap`` bytes each; past that the command is killed (KILL
    frame) and the rest discarded. The agent enforces ``req.timeout``; the host sends KILL
    itself ``HOST_TIMEOUT_SLACK`` later should the agent not have. A hang-up by either side
    before the end kills the command (the agent's rule) or raises ``RuntimeShimError``."""
    sock = connect()
    try:
        return _Exchange(sock, req, cap).run()
    finally:
        sock.close()


class _Exchange:
    """One request on one connection: a single-threaded poll loop that sends stdin while it
    reads output, so neither side can block the other."""

    def __init__(self, sock: socket.socket, req: ExecRequest, cap: int) -> None:
        self.sock = sock
        self.req = req
        self.out, self.err = _Bounded(cap), _Bounded(cap)
        self.outq: deque[memoryview] = deque([memoryview(encode_request(req))])
        self.stdin = memoryview(req.stdin or b"")
        self.stdin_done = False
        self.can_send = True
        self.partial = False  # outq[0] is partly sent
        self.rx = bytearray()
        self.hello = False
        self.killed_at: float | None = None
        self.host_timed_out = False

    def run(self) -> ExecOutcome:
        started = time.monotonic()
        deadline = None if self.req.timeout is None else \
            started + self.req.timeout + HOST_TIMEOUT_SLACK
        self.sock.setblocking(False)
        poller = select.poll()
        fd = self.sock.fileno()
        while True:
            self._refill()
            poller.register(fd, select.POLLIN | (select.POLLOUT if self.outq else 0))
            now = time.monotonic()
            wait = None
            if self.killed_at is not None:
                wait = self.killed_at + KILL_WAIT - now
                if wait <= 0:  # hanging up kills the command too (the agent's rule)
                    return self._outcome(124 if self.host_timed_out else 128 + signal.SIGKILL,
                                         timed_out=self.host_timed_out, signal=signal.SIGKILL)
            elif deadline is not None:
                wait = deadline - now
                if wait <= 0:
                    self.host_timed_out = True
                    self._kill()
                    continue
            events = poller.poll(None if wait is None else max(1, int(wait * 1000) + 1))
            for _, ev in events:
                if ev & select.POLLOUT:
                    self._send()
                if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    data = self._recv()
                    if data is None:
                        continue
                    if not data:
                        raise RuntimeShimError("sandbox agent closed the connection before "
                                               "the command finished",
                                               hint="see start.log in the sandbox directory")
                    self.rx += data
                    done = self._parse()
                    if done is not None:
                        return done

    def _refill(self) -> None:
        """Queue the next stdin frame once the previous one is out (bounded memory)."""
        if self.outq or self.stdin_done or not self.can_send:
            return
        if self.stdin:
            chunk, self.stdin = self.stdin[:STDIN_CHUNK], self.stdin[STDIN_CHUNK:]
            self.outq.append(memoryview(frame(T_STDIN, bytes(chunk))))
        else:
            self.outq.append(memoryview(frame(T_STDIN_EOF)))
            self.stdin_done = True

    def _send(self) -> None:
        while self.outq and self.can_send:
            try:
                n = self.sock.send(self.outq[0])
            except BlockingIOError:
                return
            except (BrokenPipeError, ConnectionResetError):
                # the agent hung up (an ERROR or START_FAILED is on its way): read the rest
                self.can_send = False
                self.outq.clear()
                return
            if n == len(self.outq[0]):
                self.outq.popleft()
                self.partial = False
            else:
                self.outq[0] = self.outq[0][n:]
                self.partial = True

    def _recv(self) -> bytes | None:
        try:
            return self.sock.recv(1 << 18)
        except BlockingIOError:
            return None
        except ConnectionResetError:
            return b""

    def _kill(self) -> None:
        """Stop sending stdin and send KILL right after the frame that is half out, if any."""
        if self.killed_at is not None:
            return
        self.killed_at = time.monotonic()
        self.stdin_done = True
        head = self.outq[0] if self.outq and self.partial else None
        self.outq.clear()
        if head is not None:  # a half-sent frame must be finished or the stream breaks
            self.outq.append(head)
        if self.can_send:
            self.outq.append(memoryview(frame(T_KILL, int(signal.SIGKILL).to_bytes(4, "big"))))

    def _parse(self) -> ExecOutcome | None:
        rx = self.rx
        while len(rx) >= 5:
            kind = rx[0]
            n = int.from_bytes(rx[1:5], "big")
            if n > MAX_PAYLOAD:
                raise RuntimeShimError(f"sandbox agent sent a frame of {n} bytes (over the "
                                       f"{MAX_PAYLOAD} byte limit)")
            if len(rx) < 5 + n:
                return None
            payload = bytes(rx[5:5 + n])
            del rx[:5 + n]
            if kind == R_HELLO:
                version = int.from_bytes(payload[:4], "big")
                if version != PROTOCOL_VERSION:
                    raise RuntimeShimError(f"sandbox agent speaks protocol {version}, "
                                           f"envbuild speaks {PROTOCOL_VERSION}")
                self.hello = True
            elif not self.hello:
                raise RuntimeShimError(f"sandbox agent did not say HELLO (frame 0x{kind:02x})")
            elif kind in (R_STDOUT, R_STDERR):
                if self.killed_at is None:
                    (self.out if kind == R_STDOUT else self.err).add(payload)
                    if self.out.overflow or self.err.overflow:
                        self._kill()
            elif kind == R_EXIT:
                code, flags, sig = int.from_bytes(payload[:4], "big"), payload[4], payload[5]
                timed_out = bool(flags & F_TIMED_OUT) or self.host_timed_out
                return self._outcome(124 if timed_out else code, timed_out=timed_out,
                                     signal=sig if flags & F_SIGNALED else 0,
                                     output_open=bool(flags & F_OUTPUT_OPEN))
            elif kind == R_START_FAILED:
                code, err = int.from_bytes(payload[:4], "big"), int.from_bytes(payload[4:8], "big")
                self.err.add(payload[8:] + b"\n")
                return self._outcome(code, start_errno=err)
            elif kind == R_ERROR:
                raise RuntimeShimError(f"sandbox agent refused the request: "
                                       f"{payload.decode(errors='replace')}")
            else:
                raise RuntimeShimError(f"sandbox agent sent an unknown frame 0x{kind:02x}")
        return None

    def _outcome(self, code: int, **kw) -> ExecOutcome:
        return ExecOutcome(exit_code=code, stdout=self.out.data(), stderr=self.err.data(),
                           output_truncated=self.out.overflow or self.err.overflow, **kw)
