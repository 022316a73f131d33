"""The host's reading of the agent's answer (``runtime_shim.isolation.agent.run``) against a fake agent on
a socketpair: short, forged, out-of-order and trailing frames raise ``SandboxCompromised``
(never ``IndexError``, never a result built from them), and every exec ends at its deadline."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from envbuild.errors import RuntimeShimError, SandboxCompromised
from runtime_shim.isolation import agent
from runtime_shim.isolation.agent import frame

HELLO = frame(agent.R_HELLO, agent.BASE_VERSION.to_bytes(4, "big") + b"envbuild-agent 2")  # REQ asks for 1
REQ = agent.ExecRequest(argv=("true",))


def exit_frame(code: int, flags: int = 0, sig: int = 0) -> bytes:
    return frame(agent.R_EXIT, code.to_bytes(4, "big") + bytes((flags, sig)))


class FakeAgent:
    """The far end of a socketpair: sends ``chunks`` (pausing ``gap`` between them), records
    what the host sent, and hangs up afterwards unless ``hold``."""

    def __init__(self, *chunks: bytes, gap: float = 0.0, hold: bool = False) -> None:
        self.host, self.peer = socket.socketpair()
        self.received = bytearray()
        self._chunks, self._gap, self._hold = chunks, gap, hold
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._writer = threading.Thread(target=self._write, daemon=True)
        self._reader.start()
        self._writer.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.peer.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            self.received += data

    def _write(self) -> None:
        for i, chunk in enumerate(self._chunks):
            if i and self._gap:
                time.sleep(self._gap)
            try:
                self.peer.sendall(chunk)
            except OSError:
                return
        if self._hold:
            self._stop.wait(30)
        try:
            self.peer.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def run(self, req: agent.ExecRequest = REQ, cap: int = 1 << 20, **kw) -> agent.ExecOutcome:
        try:
            return agent.run(lambda: self.host, req, cap, **kw)
        finally:
            self._stop.set()
            self._reader.join(5)
            self.peer.close()


def test_a_well_formed_answer_is_the_result():
    out = FakeAgent(HELLO + frame(agent.R_STDOUT, b"real\n") + frame(agent.R_STDERR, b"e")
                    + exit_frame(3)).run()
    assert (out.exit_code, out.stdout, out.stderr, out.timed_out) == (3, b"real\n", b"e", False)
    out = FakeAgent(HELLO, exit_frame(128 + 9, agent.F_SIGNALED, 9), gap=0.05).run()
    assert (out.exit_code, out.signal) == (137, 9)
    out = FakeAgent(HELLO + frame(agent.R_START_FAILED, (127).to_bytes(4, "big")
                                  + (2).to_bytes(4, "big") + b"nope: not found")).run()
    assert (out.exit_code, out.start_errno, out.stderr) == (127, 2, b"nope: not found\n")


FORGED = {
    "short EXIT": HELLO + frame(agent.R_EXIT, b"\x00"),
    "long EXIT": HELLO + frame(agent.R_EXIT, bytes(7)),
    "short HELLO": frame(agent.R_HELLO, b"\x00\x01"),
    "empty HELLO": frame(agent.R_HELLO),
    "short START_FAILED": HELLO + frame(agent.R_START_FAILED, bytes(4)),
    "START_FAILED code 0": HELLO + frame(agent.R_START_FAILED, bytes(8) + b"ok"),
    "unknown frame": HELLO + frame(0x99, b"x") + exit_frame(0),
    "host frame type": HELLO + frame(agent.T_ARG, b"x") + exit_frame(0),
    "STDOUT before HELLO": frame(agent.R_STDOUT, b"42 passed\n") + HELLO + exit_frame(0),
    "EXIT before HELLO": exit_frame(0),
    "second HELLO": HELLO + HELLO + exit_frame(0),
    "second final frame": HELLO + exit_frame(1) + exit_frame(0),
    "data after the end": HELLO + exit_frame(0) + b"\x82",
    "over MAX_PAYLOAD": HELLO + bytes((agent.R_STDOUT,))
    + (agent.MAX_PAYLOAD + 1).to_bytes(4, "big"),
    "unknown EXIT flag": HELLO + exit_frame(0, 0x80),
    "signal without the flag": HELLO + exit_frame(0, 0, 9),
    "signaled, code mismatch": HELLO + exit_frame(0, agent.F_SIGNALED, 9),
    "signaled, signal 0": HELLO + exit_frame(128, agent.F_SIGNALED, 0),
    "exit code over 255": HELLO + exit_frame(300),
}


@pytest.mark.parametrize("name", FORGED)
def test_forged_or_short_frames_raise_sandbox_compromised(name):
    with pytest.raises(SandboxCompromised) as e:
        FakeAgent(FORGED[name]).run(deadline=5)
    assert e.value.reference == "sandbox-compromised" and e.value.hint


def test_a_frame_split_across_reads_is_fine_and_a_late_second_frame_is_not():
    whole = HELLO + frame(agent.R_STDOUT, b"abc") + exit_frame(0)
    out = FakeAgent(*[whole[i:i + 1] for i in range(len(whole))]).run()
    assert (out.exit_code, out.stdout) == (0, b"abc")
    with pytest.raises(SandboxCompromised, match="after its final frame"):
        FakeAgent(HELLO + exit_frame(0), exit_frame(0), gap=0.05).run()


def test_a_truncated_answer_is_a_channel_error_not_an_index_error():
    with pytest.raises(RuntimeShimError, match="closed the connection"):
        FakeAgent(HELLO + bytes((agent.R_EXIT, 0, 0))).run()


def test_random_answers_never_raise_anything_but_runtime_shim_errors():
    rng = random.Random(11)
    kinds = [agent.R_HELLO, agent.R_STDOUT, agent.R_STDERR, agent.R_EXIT,
             agent.R_START_FAILED, agent.R_ERROR, 0x00, 0x7F, 0xFF]
    for _ in range(150):
        data = HELLO if rng.random() < 0.8 else b""
        for _ in range(rng.randrange(1, 4)):
            payload = rng.randbytes(rng.randrange(0, 10))
            n = len(payload) if rng.random() < 0.8 else rng.randrange(0, 20)
            data += bytes((rng.choice(kinds),)) + n.to_bytes(4, "big") + payload
        try:
            out = FakeAgent(data).run(deadline=2)
        except RuntimeShimError:
            continue
        # anything accepted was a well-formed answer: HELLO, then output, then one EXIT
        assert data.startswith(HELLO) and out.exit_code <= 255


def test_timeout_none_gets_the_default_deadline_sent_to_the_agent():
    fake = FakeAgent(HELLO + exit_frame(0))
    fake.run(deadline=7.5)
    assert frame(agent.T_TIMEOUT, (7500).to_bytes(4, "big")) in fake.received
    fake = FakeAgent(HELLO + exit_frame(0))
    fake.run()
    ms = int(agent.DEFAULT_EXEC_TIMEOUT * 1000)
    assert frame(agent.T_TIMEOUT, ms.to_bytes(4, "big")) in fake.received


def test_an_agent_that_never_answers_raises_at_the_deadline():
    started = time.monotonic()
    with pytest.raises(RuntimeShimError, match="did not answer"):
        FakeAgent(hold=True).run(deadline=0.3)
    assert time.monotonic() - started < 0.3 + agent.HOST_TIMEOUT_SLACK + 1


def test_an_agent_that_stops_after_hello_is_killed_and_timed_out(monkeypatch):
    monkeypatch.setattr(agent, "KILL_WAIT", 0.2)
    fake = FakeAgent(HELLO + frame(agent.R_STDOUT, b"partial"), hold=True)
    started = time.monotonic()
    out = fake.run(deadline=0.3)
    assert time.monotonic() - started < 0.3 + agent.HOST_TIMEOUT_SLACK + 0.2 + 1
    assert (out.timed_out, out.exit_code, out.stdout) == (True, 124, b"partial")
    assert frame(agent.T_KILL, (9).to_bytes(4, "big")) in fake.received


# ---- the microVM's serial line: the same parser behind the mux ------------------------------


def _line_peer(*chunks: bytes):
    """A fake guest end of the serial line: once the host sent something (its channel is
    open), sends ``chunks``, then keeps reading."""
    from runtime_shim.backends.vm.serial import SerialMux

    host, guest = socket.socketpair()
    mux = SerialMux(host)

    def pump():
        try:
            guest.recv(1 << 16)
            for chunk in chunks:
                guest.sendall(chunk)
        except OSError:
            return
        while True:
            try:
                if not guest.recv(1 << 16):
                    return
            except OSError:
                return

    threading.Thread(target=pump, daemon=True).start()
    return mux, guest


def test_forged_inner_frames_over_the_serial_line_raise_in_the_shared_parser():
    from runtime_shim.backends.vm.serial import T_CHANNEL, outer_frame

    mux, guest = _line_peer(outer_frame(T_CHANNEL, 1, HELLO)
                            + outer_frame(T_CHANNEL, 1, frame(agent.R_EXIT, b"\x00")))
    try:
        with pytest.raises(SandboxCompromised, match="an EXIT of 1 bytes"):
            agent.run(mux.connect, REQ, 1 << 20, deadline=5)
    finally:
        mux.close()
        guest.close()


@pytest.mark.parametrize("line", [
    bytes((0x99,)) + (4).to_bytes(4, "big") + bytes(4),  # unknown outer type
    bytes((0x41,)) + (5).to_bytes(4, "big") + bytes(5),  # WINDOW of the wrong length
    bytes((0x42,)) + (0).to_bytes(4, "big"),  # CLOSE without a channel
    bytes((0x40,)) + (1 << 30).to_bytes(4, "big"),  # a CHANNEL frame of 1 GiB
    bytes((0x40,)) + (10).to_bytes(4, "big") + (1).to_bytes(4, "big") + frame(0x82, b"xy")[:6],
])
def test_broken_outer_framing_ends_the_line_as_compromised(line):
    mux, guest = _line_peer(line)
    try:
        with pytest.raises(RuntimeShimError):
            agent.run(mux.connect, REQ, 1 << 20, deadline=5)
        deadline = time.monotonic() + 5
        while mux.compromised is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(SandboxCompromised):
            mux.connect()
    finally:
        mux.close()
        guest.close()


def test_a_guest_ignoring_its_window_is_stopped_not_buffered():
    from runtime_shim.backends.vm.serial import SERIAL_WINDOW, T_CHANNEL, outer_frame

    chunk = outer_frame(T_CHANNEL, 1, frame(agent.R_STDOUT, bytes(60 << 10)))
    frames = 3 * (SERIAL_WINDOW + agent.MAX_PAYLOAD) // len(chunk)
    flood = outer_frame(T_CHANNEL, 1, HELLO) + chunk * frames
    mux, guest = _line_peer(flood)
    session = mux.connect()  # channel 1, never read: the host's window never reopens
    session.sendall(frame(agent.T_HELLO, agent.PROTOCOL_VERSION.to_bytes(4, "big")))
    try:
        deadline = time.monotonic() + 5
        while mux.compromised is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mux.compromised is not None and "window" in str(mux.compromised)
    finally:
        session.close()
        mux.close()
        guest.close()


PTY_REQ = agent.ExecRequest(argv=("sh",), pty=(24, 80))


def test_a_request_asks_for_the_lowest_version_it_needs():
    assert agent.encode_request(REQ)[5:9] == (1).to_bytes(4, "big")
    encoded = agent.encode_request(PTY_REQ)
    assert encoded[5:9] == (2).to_bytes(4, "big")
    assert frame(agent.T_PTY, bytes((0, 24, 0, 80))) + frame(agent.T_START) in encoded


def test_an_agent_must_answer_the_version_it_was_asked():
    v2 = frame(agent.R_HELLO, (2).to_bytes(4, "big") + b"x")
    with pytest.raises(RuntimeShimError, match="speaks protocol 2, envbuild asked for 1"):
        FakeAgent(v2 + exit_frame(0)).run()
    with pytest.raises(RuntimeShimError, match="speaks protocol 1, envbuild asked for 2"):
        FakeAgent(HELLO + exit_frame(0)).run(PTY_REQ)
    assert FakeAgent(v2 + exit_frame(0)).run(PTY_REQ).exit_code == 0


def test_an_agent_refusing_the_pty_version_says_so_in_one_line():
    """An agent that predates PTYs answers ERROR (and no HELLO): a clear line, not a
    compromised channel; any other ERROR before HELLO is passed on as the agent's refusal."""
    old = frame(agent.R_ERROR, b"unsupported protocol version 2; this agent speaks 1")
    with pytest.raises(RuntimeShimError) as e:
        FakeAgent(old).run(PTY_REQ)
    assert type(e.value) is RuntimeShimError
    assert e.value.message == "this sandbox's agent cannot run a PTY (it speaks protocol 1, " \
                              "PTYs need 2)"
    with pytest.raises(RuntimeShimError, match="refused the request: too many concurrent"):
        FakeAgent(frame(agent.R_ERROR, b"too many concurrent sessions")).run()


@pytest.mark.parametrize("size", [(0, 80), (24, 0), (4097, 1), (1, 4097), (24.0, 80), (-1, 2)])
def test_terminal_sizes_are_bounded(size):
    with pytest.raises(RuntimeShimError, match="rows and cols must be whole numbers from 1"):
        agent.encode_request(agent.ExecRequest(argv=("sh",), pty=size))
