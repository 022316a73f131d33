"""The data plane's streams (``runtime_shim.fleet.streams``: started commands and ports)
refuse what they must, on a real daemon's loopback listener with stub sandboxes (the checks
are the daemon's): another sandbox's token, a guessed one, an unknown or closed sandbox, a
client opening streams by the thousand, a huge message."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import struct
import time

import pytest

from envbuild.errors import EnvbuildError, RuntimeShimError, SandboxNotFound
from runtime_shim.fleet import remote, streams
from tests.fleet_stub import data_cell  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration


@pytest.fixture
def cell(data_cell):
    return data_cell


def _open(sb, op: str, *, token: str | None = None, sdk_id: str | None = None):
    record = sb.record if token is None else dataclasses.replace(sb.record, token=token)
    request = {"start": remote.start_request(["cat"], {}, None),
               "port": {"op": "port", "port": 8080, "timeout": 1.0},
               "watch": {"op": "watch", "path": "/tmp"}}[op]
    return remote.open_stream(record, sdk_id or sb.sdk_id, request, "a test", 5.0)


def _closed(sock: socket.socket) -> bool:
    """Whether the node closes ``sock`` (whatever it sent before: the killed command's end)."""
    sock.settimeout(10)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass  # closed with our message unread
    return True


def _stub(cell, sb):
    daemon = next(iter(cell.daemons.values()))
    return daemon._entries[sb.sdk_id].sandbox


def test_a_stream_needs_its_own_sandboxs_token(cell):
    a, b = cell.fleet().create(cell.lock, n=2)
    proc = a.start(["cat"])  # its own token: opened
    proc.write_stdin(b"hi")
    proc.close_stdin()
    assert proc.wait(10).exit_code == 0
    for op in ("start", "port", "watch"):
        for token, target in (("0" * 64, a), (b.record.token, a), (a.record.token, b),
                              (a.record.token[:-1], a)):
            with pytest.raises(SandboxNotFound):
                _open(target, op, token=token)
        with pytest.raises(SandboxNotFound):  # an unknown sandbox: the same answer
            _open(a, op, sdk_id="eb-" + "0" * 12)
    assert len(_stub(cell, a).procs) == 1 and _stub(cell, b).procs == [], "nothing started"
    token = a.record.token
    a.close()
    with pytest.raises(SandboxNotFound):
        _open(a, "start", token=token)


def test_streams_per_sandbox_are_bounded(cell, monkeypatch):
    monkeypatch.setattr(streams, "MAX_STREAMS", 4)
    a, b = cell.fleet().create(cell.lock, n=2)
    held = [a.start(["cat"]) for _ in range(4)]
    refused = 0
    for _ in range(2000):  # a client opening thousands: each refused, none held
        with pytest.raises(RuntimeShimError, match="has 4 streams open"):
            _open(a, "start")
        refused += 1
    assert refused == 2000 and len(_stub(cell, a).procs) == 4
    other = b.start(["cat"])  # another sandbox's streams are its own
    other.close_stdin()
    assert other.wait(10).exit_code == 0
    held[0].cancel()
    deadline = time.monotonic() + 10
    while True:  # its slot comes back once the node saw the hang-up
        try:
            held[0] = a.start(["cat"])
            break
        except RuntimeShimError:
            assert time.monotonic() < deadline, "a hung-up stream's slot never came back"
            time.sleep(0.05)
    assert _stub(cell, a).procs[0].code == 137, "the hung-up command was killed"
    for p in held:
        p.cancel()


def test_streams_per_node_are_bounded(cell, monkeypatch):
    """All sandboxes of a node together hold at most ``MAX_NODE_STREAMS``: exec keeps
    working."""
    monkeypatch.setattr(streams, "MAX_NODE_STREAMS", 3)
    a, b = cell.fleet().create(cell.lock, n=2)
    held = [a.start(["cat"]), a.start(["cat"]), b.start(["cat"])]
    for sb in (a, b):
        with pytest.raises(RuntimeShimError, match="this node has 3 streams open"):
            _open(sb, "start")
    assert a.exec("still").stdout == b"still"
    for p in held:
        p.cancel()


def test_a_huge_message_ends_the_stream_and_its_command(cell):
    (sb,) = cell.fleet().create(cell.lock, n=1)
    sock = _open(sb, "start")
    with sock:
        sock.sendall(struct.pack(">I", streams.MAX_INPUT + 1) + b"i")
        assert _closed(sock), "the node closed the stream"
    stub = _stub(cell, sb).procs[0]
    assert stub.ended.wait(10) and stub.code == 137


def test_a_command_that_does_not_read_holds_its_client_back(cell, monkeypatch):
    """Stdin waits on the node until the command's session has room (nothing dropped, no
    queue), so the client's writes block; hanging up still kills the command."""
    import threading

    from tests.fleet_stub import StubProcess

    monkeypatch.setattr(StubProcess, "unsent_stdin", 1 << 20)  # a command that reads nothing
    (sb,) = cell.fleet().create(cell.lock, n=1)
    proc = sb.start(["cat"])
    written = [0]

    def writer() -> None:
        with contextlib.suppress(EnvbuildError):
            for _ in range(64):
                proc.write_stdin(b"x" * (1 << 20))
                written[0] += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    time.sleep(1.0)
    assert t.is_alive() and written[0] < 32, "held back by TCP, not queued on the node"
    assert _stub(cell, sb).procs[0].code is None
    proc.cancel()
    t.join(10)
    stub = _stub(cell, sb).procs[0]
    assert stub.ended.wait(10) and stub.code == 137, "the hang-up killed it while it waited"


def test_an_unknown_message_or_a_bad_control_is_refused(cell):
    (sb,) = cell.fleet().create(cell.lock, n=1)
    proc = sb.start(["cat"], pty=(24, 80))
    proc._send(b"s", b"\x00")  # a signal of one byte: a notice, the stream goes on
    deadline = time.monotonic() + 10
    while proc._notice is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(RuntimeShimError, match="the node refused an input"):
        proc.write_stdin(b"x")
    proc.close_stdin()
    assert proc.wait(10).exit_code == 0
    sock = _open(sb, "start")
    with sock:
        sock.sendall(struct.pack(">I", 1) + b"?")
        assert _closed(sock)
    assert _stub(cell, sb).procs[1].code == 137


def test_a_port_request_needs_a_port(cell):
    (sb,) = cell.fleet().create(cell.lock, n=1)
    with pytest.raises(RuntimeShimError, match="not a TCP port"):
        remote.open_stream(sb.record, sb.sdk_id, {"op": "port", "port": 70000}, "a test")
