"""``Process`` and ``AsyncProcess``: a command started in a sandbox that outlives the call that
started it (``Sandbox.start(cmd)``, ``await AsyncSandbox.start(cmd)``): written to on stdin,
signalled, waited for, while other commands run beside it.

    proc = await sb.start("cat", on_stdout=print)
    proc.write_stdin(b"hello\\n")
    proc.close_stdin()
    result = await proc.wait()          # ExecResult, as exec's

    term = sb.start("sh", pty=(24, 80), on_stdout=screen.feed)  # a terminal
    term.write_stdin("ls\\r")                                   # keystrokes
    term.resize(40, 120)                                        # SIGWINCH
    term.write_stdin("\\x03")                                   # ^C: the foreground job

    proc = sb.start(cmd, detachable=True)                     # before a checkpoint:
    pid = proc.detach()                                       # it runs on, no connection
    again = sb.reattach(pid, on_stdout=print)                 # (also after a restore)

The command runs on its own agent connection (``runtime_shim.isolation.agent_session``). An
``AsyncProcess`` is driven by a task of the event loop it was started on (its methods are
called from that loop; output callbacks run in it); a ``Process`` by a thread of its own (its
methods may be called from any thread; output callbacks run in that thread). Closing the
sandbox ends it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation.agent import ExecOutcome
from runtime_shim.isolation.agent_session import Session
from runtime_shim.node.model import ExecResult


class _Controls:
    """What both kinds of process do to their command: stdin and signals (on the session)."""

    _session: Session
    _to_result: Callable[[ExecOutcome, float], ExecResult]

    def write_stdin(self, data: bytes | str) -> None:
        """Queue ``data`` for the command's stdin (``RuntimeShimError`` once it is closed, or
        when over a MiB is still unread)."""
        self._session.write(data.encode() if isinstance(data, str) else data)

    def close_stdin(self) -> None:
        """EOF on the command's stdin, after what was written."""
        self._session.close_stdin()

    @property
    def unsent_stdin(self) -> int:
        """Bytes written to stdin and not yet sent to the command (``write_stdin`` refuses
        to hold more than ``MAX_PENDING_STDIN``)."""
        with self._session.lock:
            return len(self._session.pending)

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Signal the command's process group."""
        self._session.signal(sig)

    def kill(self) -> None:
        self._session.signal(signal.SIGKILL)

    def resize(self, rows: int, cols: int) -> None:
        """Resize the terminal of a command started with ``pty=`` (its foreground job gets
        ``SIGWINCH``); ``RuntimeShimError`` without one, or outside 1..4096."""
        self._session.resize(rows, cols)

    @property
    def pty(self) -> tuple[int, int] | None:
        """The terminal's size at the start, None for a command without one."""
        return self._session.req.pty

    @property
    def dropped(self) -> int:
        """For a reattached command: bytes of output the agent dropped while it was detached
        (it keeps the first 64 KiB); 0 otherwise."""
        return self._session.dropped

    def _detached_id(self, outcome: ExecOutcome) -> int | None:
        return outcome.detached or None

    def _result_of(self, outcome: ExecOutcome, started: float) -> ExecResult:
        if outcome.detached:
            raise RuntimeShimError(f"the command was detached (id {outcome.detached}); "
                                   "reattach to wait for it")
        return self._to_result(outcome, started)


class AsyncProcess(_Controls):
    """A running command of a sandbox (``AsyncSandbox.start``)."""

    def __init__(self, session: Session, to_result: Callable[[ExecOutcome, float], ExecResult]
                 ) -> None:
        self._session = session
        self._to_result = to_result
        self._started = time.monotonic()
        self._task: asyncio.Task[ExecOutcome] = asyncio.get_running_loop().create_task(
            session.drive())

    @property
    def done(self) -> bool:
        return self._task.done()

    async def wait(self) -> ExecResult:
        """The command's result once it ended (its output as exec's: bounded per stream)."""
        outcome = await asyncio.shield(self._task)
        return self._result_of(outcome, self._started)

    async def detach(self) -> int | None:
        """Leave the command running without this connection (``start(detachable=True)``)
        and return its detach id for ``AsyncSandbox.reattach``; None if it ended first (its
        result is then ``wait()``'s). Output not yet delivered to the callbacks stays with
        the agent; stdin written and not yet sent is not carried over."""
        self._session.detach()
        return self._detached_id(await asyncio.shield(self._task))

    async def cancel(self) -> None:
        """Hang up: the agent kills the command's group; returns once the connection closed."""
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - ending it is the point
            pass


class Process(_Controls):
    """A running command of a sandbox (``Sandbox.start``), driven by a thread of its own."""

    def __init__(self, session: Session, to_result: Callable[[ExecOutcome, float], ExecResult]
                 ) -> None:
        self._session = session
        self._to_result = to_result
        self._started = time.monotonic()
        self._outcome: ExecOutcome | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._drive, name="runtime-shim-process",
                                        daemon=True)
        self._thread.start()

    def _drive(self) -> None:
        try:
            self._outcome = self._session.drive_blocking()
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e
        finally:
            self._done.set()

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
        assert self._outcome is not None, "a driven session has an outcome (a bug)"
        return self._result_of(self._outcome, self._started)

    def detach(self, timeout: float | None = 30.0) -> int | None:
        """``AsyncProcess.detach``; ``TimeoutError`` if the agent does not answer within
        ``timeout`` seconds."""
        self._session.detach()
        if not self._done.wait(timeout):
            raise TimeoutError(f"the command was not detached within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._outcome is not None, "a driven session has an outcome (a bug)"
        return self._detached_id(self._outcome)
