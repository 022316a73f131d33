"""An interactive exec on the agent's protocol: a command whose stdin stays open for the host
to write to while it runs, which the host can signal, and whose end it can wait for later.

The agent already speaks this (README.md: STDIN frames after START, STDIN_EOF, and KILL with any
signal at any time); ``agent.run`` just sends a fixed stdin and EOF up front. A ``Session`` is
the same ``_Exchange`` (every check of the agent's answers included) with stdin fed by
``write``/``close_stdin``, signals by ``signal`` and, for a request with ``pty``, the
terminal's size by ``resize`` (RESIZE, protocol 2): ``await session.drive()`` drives it on an
event loop (the other methods are then called from that loop), ``drive_blocking()`` in a
thread of its own (the other methods from any thread).

Detaching (protocol 3, a request with ``detachable``): ``detach()`` sends DETACH; the agent
answers DETACHED (the command's detach id) as its final frame and the command runs on without
a connection, its output kept in the agent (``DETACH_BUF``, the rest dropped and counted). A
session of a request with ``attach`` takes such a command up again on a new connection: the
agent answers ATTACHED (bytes dropped, u64) first, then the kept output and the command's
further output and end, as if it had been started on this connection (``dropped`` says how
many bytes are missing). Those two frames are accepted only in those two cases: anything
else is a compromised channel, as any other frame out of place.

Bounds: at most ``MAX_PENDING_STDIN`` bytes written and not yet sent (``write`` refuses more:
the command is not reading); output is bounded as ``run``'s (``cap`` per stream; a PTY's
output is a stream: every byte goes to ``on_stdout``, the result keeps the first ``cap``); one
pending resize (a newer one replaces it); rows and cols in 1..``MAX_PTY_DIM``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal as signals
import socket
import threading
from collections.abc import Callable

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation.agent import (
    DEFAULT_EXEC_TIMEOUT,
    R_ERROR,
    R_HELLO,
    STDIN_CHUNK,
    T_KILL,
    T_RESIZE,
    T_STDIN,
    T_STDIN_EOF,
    ExecOutcome,
    ExecRequest,
    OutputCallback,
    _compromised,
    _Exchange,
    frame,
    winsize,
)
from runtime_shim.isolation.agent_wire import DETACH_VERSION, R_ATTACHED, R_DETACHED, T_DETACH

#: Stdin bytes a session holds for a command that has not read them yet.
MAX_PENDING_STDIN = 1 << 20


class Session(_Exchange):
    """One interactive command on one agent connection (``open_session``)."""

    FRAMES = _Exchange.FRAMES | {R_DETACHED, R_ATTACHED}

    def __init__(self, sock: socket.socket, req: ExecRequest, cap: int,
                 on_stdout: OutputCallback | None, on_stderr: OutputCallback | None) -> None:
        super().__init__(sock, req, cap, on_stdout, on_stderr)
        self.pending = bytearray(req.stdin or b"")
        self.stdin = memoryview(b"")
        self.eof = False
        self.signals: list[int] = []
        self.size: bytes | None = None  # a RESIZE payload not sent yet (only the last counts)
        self.detaching = False  # DETACH asked for (sent once what is half out is out)
        self.detach_sent = False
        self.attached = req.attach is None  # an attach's ATTACHED came (or none is due)
        self.dropped = 0  # output bytes the agent dropped while the command was detached
        # write/close_stdin/signal may come from another thread than the one driving (Process)
        self.lock = threading.Lock()

    def _refill(self) -> None:
        with self.lock:
            self._refill_locked()

    def _refill_locked(self) -> None:
        # a signal first (also after stdin's EOF), then stdin as it was written, EOF when closed
        if self.outq or not self.can_send or self.killed_at is not None:
            return
        if self.signals:
            sig = self.signals.pop(0)
            self.outq.append(memoryview(frame(T_KILL, sig.to_bytes(4, "big"))))
        elif self.detaching:  # the last frame: stdin not sent yet stays with the host
            if not self.detach_sent:
                self.outq.append(memoryview(frame(T_DETACH)))
                self.detach_sent = True
        elif self.size is not None:
            self.outq.append(memoryview(frame(T_RESIZE, self.size)))
            self.size = None
        elif self.stdin_done:
            return
        elif self.pending:
            chunk = bytes(self.pending[:STDIN_CHUNK])
            del self.pending[:STDIN_CHUNK]
            self.outq.append(memoryview(frame(T_STDIN, chunk)))
        elif self.eof:
            self.outq.append(memoryview(frame(T_STDIN_EOF)))
            self.stdin_done = True

    def _poke(self) -> None:
        if self.wake is not None:
            self.wake()

    @property
    def done(self) -> bool:
        return self.result is not None

    def write(self, data: bytes) -> None:
        """Queue ``data`` for the command's stdin."""
        with self.lock:
            if self.eof or self.result is not None:
                raise RuntimeShimError("the command's stdin is closed")
            if len(self.pending) + len(data) > MAX_PENDING_STDIN:
                raise RuntimeShimError(f"the command has {len(self.pending)} bytes of stdin "
                                       "unread", hint="wait for it to read, or close its stdin")
            self.pending += data
        self._poke()

    def close_stdin(self) -> None:
        """Send EOF once what was written is out."""
        with self.lock:
            self.eof = True
        self._poke()

    def signal(self, sig: int = signals.SIGKILL) -> None:
        """Send ``sig`` to the command's process group (the agent's KILL frame)."""
        if not 0 < int(sig) < 65:
            raise RuntimeShimError(f"signal {sig} is not a signal number")
        with self.lock:
            if self.result is not None:
                return
            self.signals.append(int(sig))
        self._poke()

    def resize(self, rows: int, cols: int) -> None:
        """Set the terminal's size (a PTY session's): the kernel then sends ``SIGWINCH`` to
        its foreground job. ``RuntimeShimError`` for a session without a PTY."""
        if self.req.pty is None:
            raise RuntimeShimError("resize needs a command started with pty=(rows, cols)")
        size = winsize(rows, cols)
        with self.lock:
            if self.result is not None:
                return
            self.size = size
        self._poke()

    def detach(self) -> None:
        """Ask the agent to detach the command (the drive then ends with an outcome whose
        ``detached`` is its id, or with its end if it ended first)."""
        if self.req.version < DETACH_VERSION:  # (a reattached command detaches again)
            raise RuntimeShimError("detach needs a command started with detachable=True")
        with self.lock:
            self.detaching = True
        self._poke()

    def _frame(self, kind: int, payload: bytes) -> None:
        if not self.attached and kind not in (R_HELLO, R_ATTACHED, R_ERROR):
            raise _compromised(f"frame 0x{kind:02x} before ATTACHED")
        if kind == R_DETACHED:
            if not self.detach_sent or len(payload) != 4 or not int.from_bytes(payload, "big"):
                raise _compromised(f"an unasked or malformed DETACHED ({len(payload)} bytes)")
            self.result = self._outcome(-1, detached=int.from_bytes(payload, "big"))
        elif kind == R_ATTACHED:
            if self.attached or not self.hello or len(payload) != 8:
                raise _compromised(f"an unasked or malformed ATTACHED ({len(payload)} bytes)")
            self.attached = True
            self.dropped = int.from_bytes(payload, "big")
        else:
            super()._frame(kind, payload)

    def _output(self, kind: int, data: bytearray, frames: int) -> None:
        if frames and not self.attached:
            raise _compromised("output before ATTACHED")
        super()._output(kind, data, frames)

    async def drive(self) -> ExecOutcome:
        """Drive the exchange until the command ended; closes the connection after."""
        try:
            return await self.run_async()
        finally:
            self.sock.close()

    def drive_blocking(self) -> ExecOutcome:
        """``drive`` for a thread of its own: ``poll(2)`` on the connection and on a pipe that
        ``write``/``close_stdin``/``signal`` (from any thread) write to, to be looked at again."""
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

        def wake() -> None:
            with contextlib.suppress(BlockingIOError, OSError):  # full: a wake is pending
                os.write(wake_w, b"\0")

        self.wake = wake
        try:
            return self.run(wake_r)
        finally:
            self.wake = None
            os.close(wake_r)
            os.close(wake_w)
            self.sock.close()


def open_session(connect: Callable[[], socket.socket], req: ExecRequest, cap: int, *,
                 deadline: float = DEFAULT_EXEC_TIMEOUT,
                 on_stdout: OutputCallback | None = None,
                 on_stderr: OutputCallback | None = None) -> Session:
    """A ``Session`` of ``req`` on a new connection (nothing is sent before ``drive``).
    ``req.stdin`` is written first; stdin stays open until ``close_stdin``."""
    if req.timeout is None:
        req = dataclasses.replace(req, timeout=deadline)
    return Session(connect(), req, cap, on_stdout, on_stderr)
