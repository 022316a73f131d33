"""The exec agent's wire format: frame types, a request and an outcome as plain data, and a
request encoded as frames (the protocol is ``runtime_shim/isolation/agent/README.md``).

Versions: the agent speaks 1 and 2 and answers HELLO with the version the host asked for. A
request asks for the lowest version it needs (``ExecRequest.version``): 1, or 2 for a PTY
(frames PTY and RESIZE), so a sandbox whose agent predates PTYs still runs every other exec
and refuses a PTY in one line (``refusal``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from envbuild.errors import RuntimeShimError

#: The newest version this host and the agent built from this source speak.
PROTOCOL_VERSION = 2
#: What a request without a PTY asks for (an agent of any version answers it).
BASE_VERSION = 1
#: The first version with PTY and RESIZE frames.
PTY_VERSION = 2

# host -> agent
T_HELLO, T_ARG, T_ENV, T_CWD, T_USER, T_TIMEOUT, T_START, T_STDIN, T_STDIN_EOF, T_KILL = \
    range(0x01, 0x0B)
T_PTY, T_RESIZE = 0x0B, 0x0C  # version 2
# agent -> host
R_HELLO, R_STDOUT, R_STDERR, R_EXIT, R_START_FAILED, R_ERROR = range(0x81, 0x87)
F_SIGNALED, F_TIMED_OUT, F_OUTPUT_OPEN = 1, 2, 4

MAX_PAYLOAD = 1 << 20
#: What one STDOUT/STDERR frame costs of ``output_bytes`` at least, whatever its payload: the
#: host's per-frame work (parsing, a callback) is paid for, so one-byte frames cannot make an
#: exec cost the host far more than its cap (issue 34, item 7).
FRAME_CHARGE = 64
STDIN_CHUNK = 64 << 10
#: Largest rows or columns of a PTY (the agent refuses more).
MAX_PTY_DIM = 4096
#: The terminal type a PTY command gets unless its env names one.
DEFAULT_TERM = "xterm-256color"


@dataclasses.dataclass(frozen=True)
class ExecRequest:
    """One command for the agent. ``env`` overrides the agent's (the lock's) environment;
    ``user`` is ``"uid[:gid]"``; ``timeout`` seconds or None; ``pty`` (rows, cols) runs it on
    a new terminal of that size (stdin, stdout and stderr are the terminal; output is its
    bytes, all as stdout)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    timeout: float | None = None
    stdin: bytes | None = None
    pty: tuple[int, int] | None = None

    @property
    def version(self) -> int:
        """The protocol version this request needs."""
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
    """HELLO and every request frame up to START (stdin follows separately)."""
    parts = [frame(T_HELLO, req.version.to_bytes(4, "big"))]
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
        return RuntimeShimError(f"this sandbox's agent cannot run a PTY (it speaks protocol "
                                f"1, PTYs need {PTY_VERSION})",
                                hint="the sandbox was started by an older envbuild; "
                                     "create a new one for PTYs")
    return RuntimeShimError(f"sandbox agent refused the request: {message}")


def _text(value: str, what: str) -> bytes:
    data = os.fsencode(value)
    if b"\0" in data or len(data) > MAX_PAYLOAD:
        raise RuntimeShimError(f"exec: {what} {value[:60]!r} contains a NUL byte or is too long")
    return data
