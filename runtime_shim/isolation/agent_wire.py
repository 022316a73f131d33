"""The exec agent's wire format: frame types, a request and an outcome as plain data, and a
request encoded as frames (the protocol is ``runtime_shim/isolation/agent/README.md``).

Versions: the agent speaks 1 to 3 and answers HELLO with the version the host asked for. A
request asks for the lowest version it needs (``ExecRequest.version``): 1, 2 for a PTY
(frames PTY and RESIZE), 3 for a command that may be detached or for taking one up again
(DETACH, ATTACH), so a sandbox whose agent predates them still runs every other exec and
refuses those in one line (``refusal``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from envbuild.errors import RuntimeShimError

#: The newest version this host and the agent built from this source speak.
PROTOCOL_VERSION = 3
#: What a request without a PTY asks for (an agent of any version answers it).
BASE_VERSION = 1
#: The first version with PTY and RESIZE frames.
PTY_VERSION = 2
#: The first version with DETACH and ATTACH (a command that outlives its connection).
DETACH_VERSION = 3

# host -> agent
T_HELLO, T_ARG, T_ENV, T_CWD, T_USER, T_TIMEOUT, T_START, T_STDIN, T_STDIN_EOF, T_KILL = \
    range(0x01, 0x0B)
T_PTY, T_RESIZE = 0x0B, 0x0C  # version 2
T_DETACH, T_ATTACH = 0x0D, 0x0E  # version 3
# agent -> host
R_HELLO, R_STDOUT, R_STDERR, R_EXIT, R_START_FAILED, R_ERROR = range(0x81, 0x87)
R_DETACHED, R_ATTACHED = 0x87, 0x88  # version 3
F_SIGNALED, F_TIMED_OUT, F_OUTPUT_OPEN = 1, 2, 4

MAX_PAYLOAD = 1 << 20
#: What one STDOUT/STDERR frame costs of ``output_bytes`` at least, whatever its payload: the
#: host's per-frame work (parsing, a callback) is paid for, so one-byte frames cannot make an
#: exec cost the host far more than its cap (issue 34, item 7).
FRAME_CHARGE = 64
STDIN_CHUNK = 64 << 10
#: Output bytes (in frames) the agent keeps for a detached command; it drops and counts the
#: rest (ATTACHED says how many). ``agent.c``'s DETACH_BUF.
DETACH_BUF = 64 << 10
#: Commands one agent keeps detached at once (``agent.c``'s MAX_DETACHED): its memory for them
#: is at most ``MAX_DETACHED * DETACH_BUF``; a DETACH beyond is an ERROR (the command is killed).
MAX_DETACHED = 64
#: Largest rows or columns of a PTY (the agent refuses more).
MAX_PTY_DIM = 4096
#: The terminal type a PTY command gets unless its env names one.
DEFAULT_TERM = "xterm-256color"


@dataclasses.dataclass(frozen=True)
class ExecRequest:
    """One command for the agent. ``env`` overrides the agent's (the lock's) environment;
    ``user`` is ``"uid[:gid]"``; ``timeout`` seconds or None; ``pty`` (rows, cols) runs it on
    a new terminal of that size (stdin, stdout and stderr are the terminal; output is its
    bytes, all as stdout). ``detachable``: the command may be detached from its connection
    (protocol 3). ``attach``: not a command but the detach id of one to take up again (only
    ``pty`` counts then: the terminal's size, so its output is handled as a terminal's)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    timeout: float | None = None
    stdin: bytes | None = None
    pty: tuple[int, int] | None = None
    detachable: bool = False
    attach: int | None = None

    @property
    def version(self) -> int:
        """The protocol version this request needs."""
        if self.detachable or self.attach is not None:
            return DETACH_VERSION
        return PTY_VERSION if self.pty is not None else BASE_VERSION


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
    detached: int = 0  # the detach id when the command was detached instead of ending


def frame(kind: int, payload: bytes = b"") -> bytes:
    return bytes((kind,)) + len(payload).to_bytes(4, "big") + payload


def winsize(rows: int, cols: int) -> bytes:
    """The payload of PTY and RESIZE: rows u16, cols u16, each in 1..``MAX_PTY_DIM``."""
    if not (isinstance(rows, int) and isinstance(cols, int)
            and 1 <= rows <= MAX_PTY_DIM and 1 <= cols <= MAX_PTY_DIM):
        raise RuntimeShimError(f"a terminal of {rows!r} x {cols!r}: rows and cols must be "
                               f"whole numbers from 1 to {MAX_PTY_DIM}")
    return rows.to_bytes(2, "big") + cols.to_bytes(2, "big")


def encode_request(req: ExecRequest) -> bytes:
    """HELLO and every request frame up to START (stdin follows separately); for an
    ``attach``, HELLO and ATTACH."""
    parts = [frame(T_HELLO, req.version.to_bytes(4, "big"))]
    if req.attach is not None:
        if not 0 < req.attach < 1 << 32:
            raise RuntimeShimError(f"attach: {req.attach!r} is not a detach id")
        return b"".join(parts + [frame(T_ATTACH, req.attach.to_bytes(4, "big"))])
    parts += [frame(T_ARG, _text(a, "argument")) for a in req.argv]
    parts += [frame(T_ENV, _text(f"{k}={v}", "environment variable")) for k, v in req.env.items()]
    if req.cwd is not None:
        parts.append(frame(T_CWD, _text(req.cwd, "cwd")))
    if req.user is not None:
        parts.append(frame(T_USER, _text(req.user, "user")))
    if req.timeout is not None:
        ms = max(1, min(0xFFFFFFFF, int(req.timeout * 1000)))
        parts.append(frame(T_TIMEOUT, ms.to_bytes(4, "big")))
    if req.pty is not None:
        parts.append(frame(T_PTY, winsize(*req.pty)))
    parts.append(frame(T_START))
    return b"".join(parts)


def refusal(req: ExecRequest, message: str) -> RuntimeShimError:
    """The error for the agent's ERROR ``message`` to ``req``: an agent that predates the
    version the request needs says so in one line (the sandbox was started by an older
    envbuild), anything else is passed on."""
    if req.version > BASE_VERSION and message.startswith("unsupported protocol version"):
        speaks = message.rsplit(" ", 1)[-1]  # "... this agent speaks 1 to 2": its newest
        what = ("run a PTY", "PTYs") if req.version == PTY_VERSION else \
            ("detach or attach a command", "detached commands")
        return RuntimeShimError(f"this sandbox's agent cannot {what[0]} (it speaks protocol "
                                f"{speaks[:8]}, {what[1]} need {req.version})",
                                hint="the sandbox was started by an older envbuild; "
                                     f"create a new one for {what[1]}")
    return RuntimeShimError(f"sandbox agent refused the request: {message}")


def _text(value: str, what: str) -> bytes:
    data = os.fsencode(value)
    if b"\0" in data or len(data) > MAX_PAYLOAD:
        raise RuntimeShimError(f"exec: {what} {value[:60]!r} contains a NUL byte or is too long")
    return data
