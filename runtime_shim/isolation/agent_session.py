"""An interactive exec on the agent's protocol: a command whose stdin stays open for the host
to write to while it runs, which the host can signal, and whose end it can wait for later.

The agent already speaks this (README.md: STDIN frames after START, STDIN_EOF, and KILL with any
signal at any time); ``agent.run`` just sends a fixed stdin and EOF up front. A ``Session`` is
the same ``_Exchange`` (every check of the agent's answers included) with stdin fed by
``write``/``close_stdin`` and signals by ``signal``: ``await session.drive()`` drives it on an
event loop (the other methods are then called from that loop), ``drive_blocking()`` in a
thread of its own (the other methods from any thread).

Bounds: at most ``MAX_PENDING_STDIN`` bytes written and not yet sent (``write`` refuses more:
the command is not reading); output is bounded as ``run``'s (``cap`` per stream).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal as signals
import socket
import threading
from collections.abc import Callable

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation.agent import (
    DEFAULT_EXEC_TIMEOUT,
    STDIN_CHUNK,
    T_KILL,
    T_STDIN,
    T_STDIN_EOF,
    ExecOutcome,
    ExecRequest,
    OutputCallback,
    _Exchange,
    frame,
)

#: Stdin bytes a session holds for a command that has not read them yet.
MAX_PENDING_STDIN = 1 << 20


class Session(_Exchange):
    """One interactive command on one agent connection (``open_session``)."""

    def __init__(self, sock: socket.socket, req: ExecRequest, cap: int,
                 on_stdout: OutputCallback | None, on_stderr: OutputCallback | None) -> None:
        super().__init__(sock, req, cap, on_stdout, on_stderr)
        self.pending = bytearray(req.stdin or b"")
        self.stdin = memoryview(b"")
        self.eof = False
        self.signals: list[int] = []
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
            self._start()
            poller = select.poll()
            fd = self.sock.fileno()
            poller.register(wake_r, select.POLLIN)
            while True:
                state = self.interest()
                if isinstance(state, ExecOutcome):
                    return state
                want_write, wait = state
                poller.register(fd, select.POLLIN | (select.POLLOUT if want_write else 0))
                for ready, ev in poller.poll(max(1, int(wait * 1000) + 1)):
                    if ready == wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(wake_r, 4096)
                        continue
                    done = self.on_events(bool(ev & (select.POLLIN | select.POLLHUP
                                                     | select.POLLERR)), bool(ev & select.POLLOUT))
                    if done is not None:
                        return done
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
        req = ExecRequest(argv=req.argv, env=req.env, cwd=req.cwd, user=req.user,
                          timeout=deadline, stdin=req.stdin)
    return Session(connect(), req, cap, on_stdout, on_stderr)
