"""``ShellSession`` and ``AsyncShellSession``: a long-lived shell in a sandbox that runs one
command after another, the way an agent uses a terminal (what SWE-ReX's ``BashSession`` /
``run_in_session`` needs): the working directory, variables, functions and aliases a command
leaves persist for the next; each ``run`` returns that command's output and exit code; a
command past its timeout is interrupted (``^C``) and the session stays usable.

    with ShellSession(sb) as sh:
        sh.run("cd /src && export MODE=fast")
        r = sh.run("make test", timeout=600)     # ExecResult: exit_code, stdout, timed_out
        sh.run("echo $MODE; pwd")                # fast, /src

A thin layer on a PTY process (``Sandbox.start(pty=)``): the shell (``bash`` when the sandbox
has it, else ``sh``) is interactive on its own terminal, so a syntax error or a failing
command never ends it and ``^C`` reaches only the foreground job. Its terminal echo and
``\\n`` → ``\\r\\n`` translation are off (``stty -echo -onlcr``) and its prompts empty, so what
it prints is the commands' own output. A command is sent as ``eval '<command>'`` followed by a
marker line that prints a per-session nonce, a sequence number and ``$?``; the output is what
came before the marker (stdout and stderr merged, as on a terminal; at most ``max_output``
bytes kept, ``output_truncated`` beyond). On a timeout the session sends ``^C``, then a fresh
marker, and returns what the command printed with ``exit_code`` 124 and ``timed_out``; a
shell that does not answer within ``INTERRUPT_WAIT`` after that is closed
(``RuntimeShimError``), as is one that exited (``exit`` in a command ends the session).
The command's stdin is the terminal: a command that waits for input waits until its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from envbuild.errors import RuntimeShimError
from runtime_shim.node.model import ExecResult

if TYPE_CHECKING:
    from runtime_shim.sdk.aio import AsyncSandbox
    from runtime_shim.sdk.process import AsyncProcess, Process
    from runtime_shim.sdk.sandbox import Sandbox

#: How long the shell may take to come back after ``^C`` before the session is closed.
INTERRUPT_WAIT = 10.0
#: How long the shell may take to start and take its settings.
START_WAIT = 30.0
#: The command's exit code when its timeout interrupted it (``timeout(1)``'s, and exec's).
TIMED_OUT = 124
#: The shell's own deadline: the longest the agent takes (u32 milliseconds, ~49 days), so a
#: session lives as long as its sandbox unless closed (``Limits.exec_timeout``, an exec's
#: default deadline, would end it after an hour).
LIFETIME = 0xFFFFFFFF / 1000
_TAIL = 4096  # bytes kept after the head of a long output, to find its marker in
_SIZE = (50, 250)  # the session terminal's rows and cols: wide, so nothing wraps early
_SETUP = (b"stty -echo -onlcr 2>/dev/null; PS1=''; PS2=''; PS4=''; unset PROMPT_COMMAND "
          b"HISTFILE; set +o history 2>/dev/null\n")
_ENV = {"PS1": "", "TERM": "dumb"}
_FOREVER = 1e9


class _Transcript:
    """What the shell printed, and the markers that end each command (no I/O: both session
    kinds feed it and ask it). The marker is printed by ``printf`` from two halves, so the
    input (were it ever echoed) never contains it whole. Memory: the head of a command's
    output up to ``max_output`` and a tail of ``_TAIL`` bytes, where its marker will be."""

    def __init__(self, max_output: int) -> None:
        self.nonce = secrets.token_hex(8)
        self.seq = 0
        self.max_output = max_output
        self.buf = bytearray()
        self.dropped = 0  # bytes of the current command's output beyond max_output
        self.scanned = 0  # buf[:scanned] holds no marker of the current seq
        self.marker = self._pattern(rb"%d" % 0)
        self.stale = self._pattern(rb"\d+")

    def _pattern(self, seq: bytes) -> re.Pattern[bytes]:
        return re.compile(rb"\r?\n__envbuild_" + self.nonce.encode() + rb" " + seq
                          + rb" (\d+)\r?\n")

    def next_line(self, command: str | None) -> bytes:
        """The input that runs ``command`` (None: nothing, a resync after ^C) and ends with
        the next marker."""
        line = ""
        if command is not None:
            if "\0" in command:
                raise RuntimeShimError("a session command cannot contain a NUL byte")
            line = "eval '" + command.replace("'", "'\\''") + "'\n"
        self.seq += 1
        self.marker = self._pattern(rb"%d" % self.seq)
        self.scanned = 0
        return (line + f"printf '\\n%s_%s %s %d\\n' __envbuild {self.nonce} {self.seq} "
                "\"$?\"\n").encode()

    def feed(self, data: bytes) -> None:
        self.buf += data
        excess = len(self.buf) - self.max_output - _TAIL
        if excess > 0 and self._find() is None:  # (a marker that came is never cut)
            del self.buf[self.max_output:self.max_output + excess]
            self.dropped += excess
            self.scanned = self.max_output

    def _find(self) -> re.Match[bytes] | None:
        m = self.marker.search(self.buf, max(0, self.scanned - 128))
        if m is None:
            self.scanned = len(self.buf)
        return m

    def take(self, started: float, timed_out: bool) -> ExecResult | None:
        """The current command's result once its marker arrived, else None. Markers of
        earlier commands (one interrupted by ^C may still print its own) are left out."""
        m = self._find()
        if m is None:
            return None
        out = self.stale.sub(b"", bytes(self.buf[:m.start()]))
        excess = len(out) - self.max_output - _TAIL  # (the last chunk came with the marker)
        if excess > 0:
            out = out[:self.max_output] + out[self.max_output + excess:]
        result = ExecResult(exit_code=TIMED_OUT if timed_out else int(m[1]), stdout=out,
                            stderr=b"", duration=time.monotonic() - started,
                            timed_out=timed_out, output_truncated=self.dropped + excess > 0)
        del self.buf[:m.end()]
        self.dropped = self.scanned = 0
        return result


def _argv(has_bash: bool) -> list[str]:
    return ["/bin/bash", "--norc", "--noprofile", "--noediting", "-i"] if has_bash \
        else ["/bin/sh", "-i"]


_PROBE = ["/bin/sh", "-c", "[ -x /bin/bash ]"]


class ShellSession:
    """A persistent shell in ``sandbox`` (module docstring). ``env``, ``cwd`` and ``user`` are
    the shell's (as ``Sandbox.start``'s); ``max_output`` bounds what one command's result
    keeps (default: the sandbox's ``Limits.output_bytes``). Methods are called from one
    thread at a time."""

    def __init__(self, sandbox: Sandbox, *, env: Mapping[str, str] | None = None,
                 cwd: str | None = None, user: str | None = None,
                 max_output: int | None = None) -> None:
        self._t = _Transcript(max_output or sandbox.limits.output_bytes)
        self._cond = threading.Condition()
        has_bash = sandbox.exec(_PROBE, timeout=30).exit_code == 0
        self._proc: Process = sandbox.start(
            _argv(has_bash), env={**_ENV, **(env or {})}, cwd=cwd, user=user, pty=_SIZE,
            timeout=LIFETIME, on_stdout=self._feed)
        self._proc.write_stdin(_SETUP + self._t.next_line(None))
        if self._wait(START_WAIT, time.monotonic(), False) is None:
            self.close()
            raise RuntimeShimError(f"the session's shell did not start within {START_WAIT:.0f} s")

    def _feed(self, data: bytes) -> None:
        with self._cond:
            self._t.feed(data)
            self._cond.notify_all()

    def _wait(self, timeout: float, started: float, timed_out: bool) -> ExecResult | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (got := self._t.take(started, timed_out)) is None:
                if self._proc.done:
                    raise _ended("ShellSession")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.5))
        return got

    def run(self, command: str, timeout: float | None = None) -> ExecResult:
        """Run ``command`` in the shell and return its output (``stdout``: stdout and stderr
        merged, as on a terminal) and exit code; past ``timeout`` seconds it is interrupted
        (``timed_out``, exit code 124) and the session carries on."""
        if self._proc.done:
            raise _ended("ShellSession")
        started = time.monotonic()
        self._proc.write_stdin(self._t.next_line(command))
        got = self._wait(timeout if timeout is not None else _FOREVER, started, False)
        if got is None:  # ^C to the foreground job, then a marker of its own
            self._proc.write_stdin(b"\x03" + self._t.next_line(None))
            got = self._wait(INTERRUPT_WAIT, started, True)
            if got is None:
                self.close()
                raise _unresponsive("ShellSession")
        return got

    def close(self) -> None:
        """End the shell (and whatever it still runs)."""
        if not self._proc.done:
            self._proc.kill()
            self._proc.wait(30)

    def __enter__(self) -> ShellSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncShellSession:
    """``ShellSession`` on an ``AsyncSandbox``: ``await AsyncShellSession.open(sb)``, then
    ``await session.run(cmd)``, from the event loop the sandbox runs on."""

    def __init__(self, proc: AsyncProcess, transcript: _Transcript,
                 changed: asyncio.Event) -> None:
        self._proc, self._t, self._changed = proc, transcript, changed

    @classmethod
    async def open(cls, sandbox: AsyncSandbox, *, env: Mapping[str, str] | None = None,
                   cwd: str | None = None, user: str | None = None,
                   max_output: int | None = None) -> AsyncShellSession:
        transcript = _Transcript(max_output or sandbox.sync.limits.output_bytes)
        changed = asyncio.Event()

        def feed(data: bytes) -> None:
            transcript.feed(data)
            changed.set()

        has_bash = (await sandbox.exec(_PROBE, timeout=30)).exit_code == 0
        proc = await sandbox.start(_argv(has_bash), env={**_ENV, **(env or {})}, cwd=cwd,
                                   user=user, pty=_SIZE, timeout=LIFETIME, on_stdout=feed)
        session = cls(proc, transcript, changed)
        proc.write_stdin(_SETUP + transcript.next_line(None))
        if await session._wait(START_WAIT, time.monotonic(), False) is None:
            await session.close()
            raise RuntimeShimError(f"the session's shell did not start within {START_WAIT:.0f} s")
        return session

    async def _wait(self, timeout: float, started: float, timed_out: bool
                    ) -> ExecResult | None:
        deadline = time.monotonic() + timeout
        while (got := self._t.take(started, timed_out)) is None:
            if self._proc.done:
                raise _ended("AsyncShellSession")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
        return got

    async def run(self, command: str, timeout: float | None = None) -> ExecResult:
        """``ShellSession.run``."""
        if self._proc.done:
            raise _ended("AsyncShellSession")
        started = time.monotonic()
        self._proc.write_stdin(self._t.next_line(command))
        got = await self._wait(timeout if timeout is not None else _FOREVER, started, False)
        if got is None:
            self._proc.write_stdin(b"\x03" + self._t.next_line(None))
            got = await self._wait(INTERRUPT_WAIT, started, True)
            if got is None:
                await self.close()
                raise _unresponsive("AsyncShellSession")
        return got

    async def close(self) -> None:
        """End the shell (and whatever it still runs)."""
        if not self._proc.done:
            self._proc.kill()
            await self._proc.wait()

    async def __aenter__(self) -> AsyncShellSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _ended(kind: str) -> RuntimeShimError:
    return RuntimeShimError("the session's shell exited", hint=f"open a new {kind}")


def _unresponsive(kind: str) -> RuntimeShimError:
    return RuntimeShimError(f"the session's shell did not come back within "
                            f"{INTERRUPT_WAIT:.0f} s after ^C; the session is closed",
                            hint=f"open a new {kind}")
