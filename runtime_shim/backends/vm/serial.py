"""The host end of the agent's serial line: many agent sessions over one byte stream.

A microVM's agent runs ``envbuild-agent --serial PORT`` on the ``envbuild.agent`` virtio serial
port; QEMU exposes the port on the host as a unix socket. Over that one stream, sessions travel
as channels (``runtime_shim/isolation/agent/README.md``, "Serial mode")::

    0x40 CHANNEL  channel u32, then one inner frame [type u8][len u32][payload]
    0x41 WINDOW   channel u32, bytes u32   (the receiver consumed that many inner-frame bytes)
    0x42 CLOSE    channel u32              (the channel's connection dropped)

Each direction of each channel starts with a window of ``SERIAL_WINDOW`` bytes of inner frames;
a sender sends a whole frame while its window is positive and subtracts the frame's size. A new
channel starts with the host's HELLO; frames for a channel that already ended are dropped.

``SerialMux.connect()`` returns one end of a socketpair that behaves exactly like a connection
to the agent's unix socket, so ``runtime_shim.isolation.agent.run`` (timeouts, KILL, output caps, hang-up
kills the command) works unchanged: the mux thread moves whole inner frames between the
socketpair and the line, and closing the socket sends CLOSE unless the session already ended.

The line is guest-written, hostile input. The mux checks only the outer framing (a known
type, the exact payload length of WINDOW and CLOSE, exactly one whole inner frame in a
CHANNEL, no frame over ``MAX_PAYLOAD`` + 9, no channel sent more than its window): a
violation is ``SandboxCompromised`` and ends the line, every open exec then fails and every
later one raises it. The inner frames are checked by the one parser every backend uses,
``runtime_shim.isolation.agent.run``: the mux passes them through unchanged, so a forged, short or
out-of-order inner frame raises there as for a container.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading

from envbuild.errors import RuntimeShimError, SandboxCompromised
from runtime_shim.isolation import agent

T_CHANNEL, T_WINDOW, T_CLOSE = 0x40, 0x41, 0x42
SERIAL_WINDOW = 256 << 10
WINDOW_ACK = 32 << 10
_FINAL = (agent.R_EXIT, agent.R_START_FAILED, agent.R_ERROR)
#: The largest outer payload: a channel id and a whole inner frame of ``MAX_PAYLOAD``.
MAX_OUTER = 4 + 5 + agent.MAX_PAYLOAD


def outer_frame(kind: int, channel: int, payload: bytes = b"") -> bytes:
    return struct.pack(">BII", kind, 4 + len(payload), channel) + payload


def _line_compromised(what: str) -> SandboxCompromised:
    return SandboxCompromised(
        f"the microVM's agent line carried {what}: the guest broke the protocol",
        hint="nothing the VM returned is trusted; close the sandbox "
             "(runtime_shim/isolation/agent/README.md, trust model)")


def _check_outer(kind: int, n: int) -> None:
    """The outer header alone: a known type with a length its layout allows."""
    if kind == T_CHANNEL:
        if not 9 <= n <= MAX_OUTER:
            raise _line_compromised(f"a CHANNEL frame of {n} bytes (9 to {MAX_OUTER})")
    elif kind == T_WINDOW:
        if n != 8:
            raise _line_compromised(f"a WINDOW frame of {n} bytes (exactly 8)")
    elif kind == T_CLOSE:
        if n != 4:
            raise _line_compromised(f"a CLOSE frame of {n} bytes (exactly 4)")
    else:
        raise _line_compromised(f"an unknown frame 0x{kind:02x}")


class _Chan:
    __slots__ = ("id", "sock", "down", "up", "credit", "acked", "final", "eof", "agent_closed")

    def __init__(self, cid: int, sock: socket.socket) -> None:
        self.id = cid
        self.sock = sock
        self.down = bytearray()  # inner frames from the agent, for the session socket
        self.up = bytearray()  # bytes from the session socket, not yet framed
        self.credit = SERIAL_WINDOW  # how much we may still send to the agent
        self.acked = 0
        self.final = False  # the agent sent the final frame
        self.eof = False  # the session socket was closed by its user
        self.agent_closed = False


class SerialMux:
    """One thread multiplexing channels over ``line`` (a connected stream socket)."""

    def __init__(self, line: socket.socket, first_channel: int = 1) -> None:
        # first_channel: a restored VM's agent has seen the ids before its checkpoint.
        self._line = line
        line.setblocking(False)
        self._rx = bytearray()
        self._tx = bytearray()
        self._chans: dict[int, _Chan] = {}
        self._next = first_channel & 0xFFFFFFFF or 1
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closed = False
        self.error: str | None = None
        self.compromised: SandboxCompromised | None = None
        self._thread = threading.Thread(target=self._run, name="envbuild-vm-serial",
                                        daemon=True)
        self._thread.start()

    @property
    def next_channel(self) -> int:
        return self._next

    def busy(self) -> bool:
        """Whether any channel is open (an exec under way)."""
        with self._lock:
            return bool(self._chans)

    def connect(self) -> socket.socket:
        """A new channel; use the returned socket as a connection to the agent."""
        if self.compromised is not None:
            raise self.compromised
        if self._closed or self.error:
            raise RuntimeShimError(f"the microVM's agent line is closed"
                                   f"{': ' + self.error if self.error else ''}")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        with self._lock:
            cid = self._next
            self._next = (self._next + 1) & 0xFFFFFFFF or 1
            self._chans[cid] = _Chan(cid, ours)
        self._wake()
        return theirs

    def close(self) -> None:
        self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        for c in list(self._chans.values()):
            c.sock.close()
        self._chans.clear()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._line.close()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # ---- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except SandboxCompromised as e:
            self.compromised = e
            self.error = str(e)
        except Exception as e:  # noqa: BLE001 - reported to every caller through connect/EOF
            self.error = f"{type(e).__name__}: {e}"
        finally:
            with self._lock:
                for c in self._chans.values():
                    c.sock.close()
                self._chans.clear()

    def _loop(self) -> None:
        line = self._line.fileno()
        while not self._closed:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            poller.register(line, select.POLLIN | (select.POLLOUT if self._tx else 0))
            with self._lock:
                chans = list(self._chans.values())
            by_fd = {}
            for c in chans:
                ev = (select.POLLOUT if c.down else 0) | \
                     (select.POLLIN if not c.eof and c.credit > 0 else 0)
                if ev:
                    poller.register(c.sock.fileno(), ev)
                    by_fd[c.sock.fileno()] = c
            for fd, ev in poller.poll():
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                elif fd == line:
                    if ev & select.POLLOUT:
                        self._tx = self._tx[self._line.send(self._tx):]
                    if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                        data = self._line.recv(1 << 20)
                        if not data:
                            raise ConnectionError("QEMU closed the agent's serial socket")
                        self._rx += data
                        self._parse_line()
                else:
                    c = by_fd[fd]
                    if ev & select.POLLOUT and c.down:
                        self._to_session(c)
                    if ev & (select.POLLIN | select.POLLHUP | select.POLLERR) and not c.eof:
                        self._from_session(c)
            self._sweep()

    def _parse_line(self) -> None:
        rx = self._rx
        pos = 0
        while len(rx) - pos >= 5:
            kind, n = struct.unpack_from(">BI", rx, pos)
            _check_outer(kind, n)
            if len(rx) - pos < 5 + n:
                break
            (cid,) = struct.unpack_from(">I", rx, pos + 5)
            payload = bytes(rx[pos + 9:pos + 5 + n])
            pos += 5 + n
            if kind == T_CHANNEL and (len(payload) < 5 or
                                      5 + int.from_bytes(payload[1:5], "big") != len(payload)):
                raise _line_compromised(f"a CHANNEL frame of {len(payload)} bytes that is not "
                                        "one whole inner frame")
            c = self._chans.get(cid)
            if c is None:  # a late frame for a channel that already ended
                continue
            if kind == T_CHANNEL:
                c.down += payload
                # the agent sends while its window is positive: it can overshoot by one frame,
                # never more (a guest ignoring the window would grow host memory without end)
                if len(c.down) + c.acked > SERIAL_WINDOW + 5 + agent.MAX_PAYLOAD:
                    raise _line_compromised(f"more than its window on channel {cid}")
                if payload[0] in _FINAL:
                    c.final = True
            elif kind == T_WINDOW:
                c.credit += struct.unpack(">I", payload)[0]
                self._frame_up(c)
            else:
                c.agent_closed = True
        del rx[:pos]

    def _to_session(self, c: _Chan) -> None:
        try:
            n = c.sock.send(c.down)
        except BlockingIOError:
            return
        except OSError:  # the session socket's user is gone: drop what it would have read
            n = len(c.down)
        del c.down[:n]
        c.acked += n
        if c.acked >= WINDOW_ACK or not c.down:
            self._tx += outer_frame(T_WINDOW, c.id, struct.pack(">I", c.acked))
            c.acked = 0

    def _from_session(self, c: _Chan) -> None:
        try:
            data = c.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            c.eof = True
        c.up += data
        self._frame_up(c)

    def _frame_up(self, c: _Chan) -> None:
        up = c.up
        pos = 0
        while c.credit > 0 and len(up) - pos >= 5:
            n = 5 + struct.unpack_from(">I", up, pos + 1)[0]
            if len(up) - pos < n:
                break
            self._tx += outer_frame(T_CHANNEL, c.id, bytes(up[pos:pos + n]))
            c.credit -= n
            pos += n
        del up[:pos]

    def _sweep(self) -> None:
        with self._lock:
            for cid, c in list(self._chans.items()):
                done = False
                if c.eof and (not c.up or c.credit > 0):  # what is left is a partial frame
                    if not c.final and not c.agent_closed:
                        self._tx += outer_frame(T_CLOSE, cid)
                    done = True
                elif c.agent_closed and not c.down:
                    done = True  # the session socket then reads EOF
                if done:
                    c.sock.close()
                    del self._chans[cid]
