"""The sandbox exec agent: build it, and speak its protocol from the host.

``envbuild-agent`` (``runtime_shim/isolation/agent/agent.c``) is a static C program that runs as PID 1
of a sandbox. It accepts on a unix socket the host created outside every mount of the sandbox
(``listen_socket``; runc hands the listening fd down) and runs one command per connection; the
protocol (versions 1 to 3; the wire format is ``runtime_shim.isolation.agent_wire``) is
specified in ``runtime_shim/isolation/agent/README.md``. In short, frames are
``[type u8][len u32 big-endian][payload]``::

    host -> agent   HELLO(version u32) ARG* ENV* CWD? USER? TIMEOUT? PTY? START
                    then STDIN* STDIN_EOF, and KILL(signal u32), RESIZE at any time
    agent -> host   HELLO(version u32, name) STDOUT* STDERR* then one of
                    EXIT(code u32, flags u8, signal u8) | START_FAILED(code u32, errno u32, msg)
                    | ERROR(msg)

Building: ``agent_binary(cache_dir)`` compiles ``agent.c`` with gcc against static glibc once per
source hash into ``<cache_dir>/agent/<key>/envbuild-agent`` (compile beside, rename into place:
``runtime_shim.isolation.cbuild``), so every sandbox on the host bind-mounts the same file.

Talking: ``run(connect, request, cap, deadline=)`` (or ``await run_async(...)``) sends an
``ExecRequest`` (plain data) over a fresh connection and streams the answer into buffers
bounded by ``cap``. Every exec has a deadline (the request's timeout, else ``deadline``, by
default ``DEFAULT_EXEC_TIMEOUT``). What
comes back is parsed as hostile input: each frame's type, order and payload length are checked
against the protocol, and anything else raises ``SandboxCompromised`` (the trust model is in
``runtime_shim/isolation/agent/README.md``). The microVM backend's serial line feeds the same parser.
``on_stdout`` / ``on_stderr`` are called with each chunk of output as it arrives (the frames
of one stream that came in together are one chunk). Each output frame is charged at least
``FRAME_CHARGE`` bytes of the cap, so one-byte frames cannot cost the host more than the cap.

One exchange is a state machine (``_Exchange``) that does no waiting itself: ``interest()``
says whether it wants to write and how long it may wait, ``on_events(readable, writable)``
does the non-blocking socket work. ``run`` drives it with ``poll(2)`` in the calling thread;
``run_async`` with the event loop's ``add_reader``/``add_writer``, so one loop drives any
number of execs without a thread each. Both share every rule of the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import os
import select
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envbuild.errors import RuntimeShimError, SandboxCompromised
from runtime_shim.isolation import cbuild
from runtime_shim.isolation.agent_wire import (
    BASE_VERSION,
    DEFAULT_TERM,
    F_OUTPUT_OPEN,
    F_SIGNALED,
    F_TIMED_OUT,
    FRAME_CHARGE,
    MAX_PAYLOAD,
    MAX_PTY_DIM,
    PROTOCOL_VERSION,
    PTY_VERSION,
    R_ERROR,
    R_EXIT,
    R_HELLO,
    R_START_FAILED,
    R_STDERR,
    R_STDOUT,
    STDIN_CHUNK,
    T_ARG,
    T_CWD,
    T_ENV,
    T_HELLO,
    T_KILL,
    T_PTY,
    T_RESIZE,
    T_START,
    T_STDIN,
    T_STDIN_EOF,
    T_TIMEOUT,
    T_USER,
    ExecOutcome,
    ExecRequest,
    encode_request,
    frame,
    refusal,
    winsize,
)

#: The host side of the protocol, with the wire format (``agent_wire``) re-exported.
__all__ = [
    "BASE_VERSION", "BINARY_NAME", "CONNECT_TIMEOUT", "DEFAULT_EXEC_TIMEOUT", "DEFAULT_TERM",
    "END_WAIT", "ExecOutcome", "ExecRequest", "FRAME_CHARGE", "F_OUTPUT_OPEN", "F_SIGNALED",
    "F_TIMED_OUT", "HOST_TIMEOUT_SLACK", "KILL_WAIT", "MAX_PAYLOAD", "MAX_PTY_DIM",
    "OutputCallback", "PROTOCOL_VERSION", "PTY_VERSION", "R_ERROR", "R_EXIT", "R_HELLO",
    "R_START_FAILED", "R_STDERR", "R_STDOUT", "SOURCE", "STDIN_CHUNK", "T_ARG", "T_CWD",
    "T_ENV", "T_HELLO", "T_KILL", "T_PTY", "T_RESIZE", "T_START", "T_STDIN", "T_STDIN_EOF",
    "T_TIMEOUT", "T_USER", "agent_binary", "check_hello", "connect_agent", "encode_request",
    "frame", "hello", "listen_socket", "refusal", "run", "run_async", "winsize",
]

SOURCE = Path(__file__).with_name("agent") / "agent.c"
BINARY_NAME = "envbuild-agent"

#: After the host-side deadline (or output cap) the command is killed; how long to wait for
#: the agent's EXIT before hanging up (a hang-up kills the command too, see ``run``).
KILL_WAIT = 5.0
#: The agent enforces ``timeout`` itself; the host's own deadline is this much later.
HOST_TIMEOUT_SLACK = 1.0
#: The deadline of an exec whose caller passes ``timeout=None`` (``Limits.exec_timeout``).
DEFAULT_EXEC_TIMEOUT = 3600.0
#: How long ``connect_agent`` may take (a full backlog of a stuck agent blocks ``connect``).
CONNECT_TIMEOUT = 10.0
#: After the final frame, how long to wait for the agent to hang up (it does at once).
END_WAIT = 2.0
_FLAGS = F_SIGNALED | F_TIMED_OUT | F_OUTPUT_OPEN


# ---- building ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _source_key() -> str:
    return cbuild.source_key(SOURCE)


def agent_binary(cache_dir: str | os.PathLike[str]) -> Path:
    """The agent binary for this source under ``cache_dir``, compiled on first use
    (``runtime_shim.isolation.cbuild``)."""
    return cbuild.static_binary(cache_dir, SOURCE, BINARY_NAME, _source_key(),
                                "the sandbox agent")


# ---- talking -----------------------------------------------------------------------------


class _Bounded:
    """Output of one stream in one buffer, charged at most ``cap`` bytes.

    Every frame costs at least ``FRAME_CHARGE`` bytes of the cap whatever its payload, so a
    stream of tiny frames runs out of cap (and the command is killed) after ``cap /
    FRAME_CHARGE`` frames: the host's work per exec is bounded by the cap, not by how finely
    the output was cut. The bytes are kept in one ``bytearray``, never one object per frame."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buf = bytearray()
        self.charged = 0
        self.overflow = False

    def add(self, data: bytes | bytearray | memoryview, frames: int = 1) -> bytes:
        """Keep what the cap allows of ``data`` (``frames`` frames' payloads); return it."""
        kept = bytes(data[:max(0, self.cap - self.charged)])
        self.buf += kept
        self.charged += max(len(data), frames * FRAME_CHARGE)
        self.overflow = self.overflow or self.charged > self.cap
        return kept

    def data(self) -> bytes:
        return bytes(self.buf)


def listen_socket(dir_fd: int, name: str = "agent.sock") -> socket.socket:
    """A listening unix socket ``name`` in the host directory ``dir_fd``, mode 0600.

    The directory is outside every mount of the sandbox, so no process in it can reach,
    delete or replace the socket; the agent gets the listening fd itself (``runc run
    --preserve-fds``) and the host connects by path (``connect_agent``). Bound through
    ``/proc/self/fd`` so a deep node dir never hits the 108-byte ``sun_path`` limit."""
    path = f"/proc/self/fd/{dir_fd}/{name}"
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        # No window in which the socket is connectable by others: Linux creates the socket
        # file with the socket inode's mode (minus the umask), so set that mode before bind.
        # (os.umask would be process-wide: threads creating sandboxes at once raced on it and
        # left the whole process at umask 0177.)
        os.fchmod(sock.fileno(), 0o600)
        sock.bind(path)
        os.chmod(name, 0o600, dir_fd=dir_fd, follow_symlinks=False)
        sock.listen(512)
    except OSError as e:
        sock.close()
        raise RuntimeShimError(f"create the sandbox agent's socket: {e.strerror}") from e
    return sock


def connect_agent(path: str, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """Connect to the agent's host-side socket ``path`` (see ``listen_socket``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except TimeoutError:
        sock.close()
        raise RuntimeShimError(f"connect to the sandbox agent: no answer within {timeout:.0f} s",
                               hint="the agent is stuck; close the sandbox") from None
    except OSError as e:
        sock.close()
        hint = "the sandbox's PID 1 exited (see start.log in the sandbox directory)" \
            if e.errno == errno.ECONNREFUSED else None
        raise RuntimeShimError(f"connect to the sandbox agent: {e.strerror}", hint=hint) from e
    return sock


def hello(connect: Callable[[], socket.socket], timeout: float) -> None:
    """Check that the agent answers: HELLO on a fresh connection, its HELLO back with our
    protocol version within ``timeout`` seconds (then hang up; the agent drops the session)."""
    deadline = time.monotonic() + timeout
    sock = connect()
    try:
        sock.sendall(frame(T_HELLO, PROTOCOL_VERSION.to_bytes(4, "big")))
        reply = bytearray()
        while len(reply) < 5 or len(reply) < 5 + min(4096, int.from_bytes(reply[1:5], "big")):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeShimError(f"did not answer within {timeout:.0f} s")
            sock.settimeout(left)
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError as e:
                raise RuntimeShimError(f"hung up: {e.strerror}") from None
            if not data:
                raise RuntimeShimError("hung up before its HELLO")
            reply += data
        check_hello(bytes(reply))
    finally:
        sock.close()


def check_hello(reply: bytes) -> None:
    """The agent's first frame (at least its first 9 bytes) is HELLO with our version."""
    n = int.from_bytes(reply[1:5], "big") if len(reply) >= 5 else 0
    if len(reply) < 9 or reply[0] != R_HELLO or not 4 <= n <= 4096:
        raise _compromised(f"{reply[:40]!r} instead of HELLO")
    version = int.from_bytes(reply[5:9], "big")
    if version != PROTOCOL_VERSION:
        raise RuntimeShimError(f"speaks protocol {version}, envbuild speaks {PROTOCOL_VERSION}")


#: Called with each chunk of a command's stdout or stderr as it arrives.
OutputCallback = Callable[[bytes], None]


def run(connect: Callable[[], socket.socket], req: ExecRequest, cap: int, *,
        deadline: float = DEFAULT_EXEC_TIMEOUT, on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None) -> ExecOutcome:
    """Run ``req`` on a new connection and wait for it.

    stdout and stderr keep at most ``cap`` bytes each, a frame counting as at least
    ``FRAME_CHARGE``; past that the command is killed (KILL frame) and the rest discarded.
    ``req.timeout``, or ``deadline`` seconds when it is None, is sent to the agent, which
    kills the command then; the host sends KILL itself
    ``HOST_TIMEOUT_SLACK`` later should the agent not have, and gives up ``KILL_WAIT`` after
    that (the result says ``timed_out``). An agent that never says HELLO raises at the
    deadline. A hang-up by either side before the end kills the command (the agent's rule) or
    raises ``RuntimeShimError``; anything the protocol does not allow raises
    ``SandboxCompromised``. ``on_stdout``/``on_stderr`` get each chunk as it arrives (until a
    kill), in the order the agent sent them; an exception from one ends the exec (the
    connection closes, which kills the command) and propagates."""
    if req.timeout is None:
        req = dataclasses.replace(req, timeout=deadline)
    sock = connect()
    try:
        return _Exchange(sock, req, cap, on_stdout, on_stderr).run()
    finally:
        sock.close()


async def run_async(connect: Callable[[], socket.socket], req: ExecRequest, cap: int, *,
                    deadline: float = DEFAULT_EXEC_TIMEOUT,
                    on_stdout: OutputCallback | None = None,
                    on_stderr: OutputCallback | None = None) -> ExecOutcome:
    """``run`` on the running event loop: the same exchange, waiting in the loop instead of
    ``poll(2)``. Cancelling it closes the connection, which kills the command."""
    if req.timeout is None:
        req = dataclasses.replace(req, timeout=deadline)
    sock = connect()
    try:
        return await _Exchange(sock, req, cap, on_stdout, on_stderr).run_async()
    finally:
        sock.close()


def _compromised(what: str) -> SandboxCompromised:
    return SandboxCompromised(
        f"sandbox agent sent {what}: the exec channel broke the protocol",
        hint="nothing this exec returned is trusted; close the sandbox "
             "(runtime_shim/isolation/agent/README.md, trust model)")


class _Exchange:
    """One request on one connection, as a state machine that sends stdin while it reads
    output, so neither side can block the other; ``run`` / ``run_async`` wait for it."""

    #: The agent's frames it accepts (a ``Session`` adds version 3's).
    FRAMES = frozenset((R_HELLO, R_STDOUT, R_STDERR, R_EXIT, R_START_FAILED, R_ERROR))

    def __init__(self, sock: socket.socket, req: ExecRequest, cap: int,
                 on_stdout: OutputCallback | None = None,
                 on_stderr: OutputCallback | None = None) -> None:
        self.sock = sock
        self.req = req
        self.on_stdout, self.on_stderr = on_stdout, on_stderr
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
        self.result: ExecOutcome | None = None  # set by the final frame
        self.wake: Callable[[], None] | None = None  # ends run_async's current wait
        self.ended_at = 0.0

    def _start(self) -> None:
        timeout = self.req.timeout if self.req.timeout is not None else DEFAULT_EXEC_TIMEOUT
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout + HOST_TIMEOUT_SLACK
        self.sock.setblocking(False)

    def interest(self) -> ExecOutcome | tuple[bool, float]:
        """The outcome if the exchange is over, else (wants to write, seconds it may wait
        before ``interest`` must be asked again). Acts on the deadlines that have passed."""
        while True:
            self._refill()
            now = time.monotonic()
            if self.result is not None:  # waiting for the hang-up that follows the end
                wait = self.ended_at + END_WAIT - now
                if wait <= 0:
                    return self.result
            elif self.killed_at is not None:
                wait = self.killed_at + KILL_WAIT - now
                if wait <= 0:  # hanging up kills the command too (the agent's rule)
                    return self._outcome(124 if self.host_timed_out else 128 + signal.SIGKILL,
                                         timed_out=self.host_timed_out, signal=signal.SIGKILL)
            else:
                wait = self.deadline - now
                if wait <= 0:
                    if not self.hello:
                        raise RuntimeShimError(
                            f"sandbox agent did not answer within {self.timeout:.0f} s",
                            hint="the agent is stuck or was replaced; close the sandbox")
                    self.host_timed_out = True
                    self._kill()
                    continue
            return bool(self.outq) and self.result is None, wait

    def on_events(self, readable: bool, writable: bool) -> ExecOutcome | None:
        """Do the socket work the ready events allow; the outcome once it is known."""
        if writable and self.result is None:
            self._send()
        if readable:
            data = self._recv()
            if data is None:
                return None
            if not data:
                if self.result is not None:
                    return self.result
                raise RuntimeShimError("sandbox agent closed the connection before "
                                       "the command finished",
                                       hint="see start.log in the sandbox directory")
            if self.result is not None:
                raise _compromised(f"{len(data)} bytes after its final frame")
            self.rx += data
            self._parse()
        return None

    def run(self, wake_fd: int | None = None) -> ExecOutcome:
        """Drive the exchange with ``poll(2)`` in this thread. ``wake_fd`` (a non-blocking
        pipe's read end) is polled too: a byte on it (drained) makes the loop look at
        ``interest`` again, for another thread that queued something (a ``Session``)."""
        self._start()
        poller = select.poll()
        fd = self.sock.fileno()
        if wake_fd is not None:
            poller.register(wake_fd, select.POLLIN)
        while True:
            state = self.interest()
            if isinstance(state, ExecOutcome):
                return state
            want_write, wait = state
            poller.register(fd, select.POLLIN | (select.POLLOUT if want_write else 0))
            # (at most a day a wait: poll takes at most 2**31 - 1 ms, a deadline may be later)
            for ready, ev in poller.poll(min(max(1, int(wait * 1000) + 1), 86_400_000)):
                if ready == wake_fd:
                    with contextlib.suppress(BlockingIOError):
                        os.read(ready, 4096)
                    continue
                done = self.on_events(bool(ev & (select.POLLIN | select.POLLHUP | select.POLLERR)),
                                      bool(ev & select.POLLOUT))
                if done is not None:
                    return done

    async def run_async(self) -> ExecOutcome:
        loop = asyncio.get_running_loop()
        self._start()
        fd = self.sock.fileno()
        while True:
            state = self.interest()
            if isinstance(state, ExecOutcome):
                return state
            want_write, wait = state
            ready: asyncio.Future[str] = loop.create_future()

            def mark(what: str, ready: asyncio.Future[str] = ready) -> None:
                if not ready.done():
                    ready.set_result(what)

            self.wake = functools.partial(mark, "t")  # a Session's stdin or signal: look again

            loop.add_reader(fd, mark, "r")
            if want_write:
                loop.add_writer(fd, mark, "w")
            timer = loop.call_later(wait + 0.001, mark, "t")
            try:
                what = await ready
            finally:
                timer.cancel()
                loop.remove_reader(fd)
                if want_write:
                    loop.remove_writer(fd)
            if what != "t":
                done = self.on_events(what == "r", what == "w")
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

    def _parse(self) -> None:
        """Consume whole frames from ``rx``. Every rule of the agent's side of the protocol is
        checked here (README.md, "Agent → host"): HELLO first and once, a known type, the
        payload length of each type, a consistent EXIT, and nothing after the final frame.
        A run of output frames of one stream is handled as one chunk (``_output``)."""
        rx = self.rx
        run_kind, run, frames = 0, bytearray(), 0
        while len(rx) >= 5 and self.result is None:
            kind = rx[0]
            n = int.from_bytes(rx[1:5], "big")
            if n > MAX_PAYLOAD:
                raise _compromised(f"a frame of {n} bytes (over the {MAX_PAYLOAD} byte limit)")
            if kind not in self.FRAMES:
                raise _compromised(f"an unknown frame 0x{kind:02x}")
            if len(rx) < 5 + n:
                break
            if kind in (R_STDOUT, R_STDERR) and self.hello:
                if kind != run_kind:
                    self._output(run_kind, run, frames)
                    run_kind, run, frames = kind, bytearray(), 0
                run += rx[5:5 + n]
                frames += 1
                del rx[:5 + n]
                continue
            self._output(run_kind, run, frames)
            run_kind, run, frames = 0, bytearray(), 0
            payload = bytes(rx[5:5 + n])
            del rx[:5 + n]
            self._frame(kind, payload)
        self._output(run_kind, run, frames)
        if self.result is not None:
            if rx:
                raise _compromised(f"{len(rx)} bytes after its final frame")
            self.ended_at = time.monotonic()

    def _output(self, kind: int, data: bytearray, frames: int) -> None:
        """``frames`` STDOUT or STDERR frames in a row, their payloads joined in ``data``."""
        if not frames or self.killed_at is not None:
            return
        kept = (self.out if kind == R_STDOUT else self.err).add(data, frames)
        callback = self.on_stdout if kind == R_STDOUT else self.on_stderr
        if self.req.pty is not None:
            # a terminal is a stream for as long as it lives: its callback gets every byte,
            # the result keeps the first ``cap`` (truncated), and the cap does not kill it
            if callback is not None and data:
                callback(bytes(data))
            return
        if callback is not None and kept:
            callback(kept)
        if self.out.overflow or self.err.overflow:
            self._kill()

    def _frame(self, kind: int, payload: bytes) -> None:
        n = len(payload)
        if kind == R_HELLO:
            if self.hello:
                raise _compromised("a second HELLO")
            if n < 4:
                raise _compromised(f"a HELLO of {n} bytes (at least 4)")
            version = int.from_bytes(payload[:4], "big")
            if version != self.req.version:  # the agent answers the version it was asked
                raise RuntimeShimError(f"sandbox agent speaks protocol {version}, "
                                       f"envbuild asked for {self.req.version}")
            self.hello = True
            return
        if not self.hello and kind != R_ERROR:  # a refused version or a full agent: no HELLO
            raise _compromised(f"frame 0x{kind:02x} before HELLO")
        if kind in (R_STDOUT, R_STDERR):
            self._output(kind, bytearray(payload), 1)  # (_parse hands runs to _output itself)
        elif kind == R_EXIT:
            if n != 6:
                raise _compromised(f"an EXIT of {n} bytes (exactly 6)")
            code, flags, sig = int.from_bytes(payload[:4], "big"), payload[4], payload[5]
            signaled = bool(flags & F_SIGNALED)
            if flags & ~_FLAGS or (code != 128 + sig if signaled else (sig or code > 255)) \
                    or (signaled and not 0 < sig < 65):
                raise _compromised(f"an inconsistent EXIT (code {code}, flags {flags}, "
                                   f"signal {sig})")
            timed_out = bool(flags & F_TIMED_OUT) or self.host_timed_out
            self.result = self._outcome(124 if timed_out else code, timed_out=timed_out,
                                        signal=sig if signaled else 0,
                                        output_open=bool(flags & F_OUTPUT_OPEN))
        elif kind == R_START_FAILED:
            if n < 8:
                raise _compromised(f"a START_FAILED of {n} bytes (at least 8)")
            code, err = int.from_bytes(payload[:4], "big"), int.from_bytes(payload[4:8], "big")
            if code not in (125, 126, 127):
                raise _compromised(f"a START_FAILED with code {code} (125, 126 or 127)")
            self.err.add(payload[8:] + b"\n")
            self.result = self._outcome(code, start_errno=err)
        else:  # R_ERROR: the agent refused the request (e.g. a protocol version it lacks)
            raise refusal(self.req, payload[:300].decode(errors="replace"))

    def _outcome(self, code: int, **kw: Any) -> ExecOutcome:
        return ExecOutcome(exit_code=code, stdout=self.out.data(), stderr=self.err.data(),
                           output_truncated=self.out.overflow or self.err.overflow, **kw)

